"""The run lock is held by the kernel: a live owner refuses others, a dead one holds
nothing, and processes racing for a folder with a stale lock never share it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from quantize.errors import DiskError, LockedError
from quantize.run.lock import entry_lock, run_lock

_HOLD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from quantize.run.lock import run_lock
    with run_lock(Path(sys.argv[1])):
        Path(sys.argv[2]).write_text("held")
        time.sleep(30)
""")


def test_lock_refuses_a_live_owner_and_clears_a_dead_one(tmp_path: Path) -> None:
    ready = tmp_path.parent / f"{tmp_path.name}.ready"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path), str(ready)])
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert holder.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(LockedError) as err, run_lock(tmp_path):
            pass
        assert (err.value.path, err.value.problem) == (str(tmp_path),
                                                       f"is in use by process {holder.pid}")
        assert err.value.hint is not None and "--out" in err.value.hint
    finally:
        holder.kill()
        holder.wait()
    # the owner was killed (-9): its lock file is still there, but nothing holds it
    assert (tmp_path / ".lock").read_text() == str(holder.pid)
    with run_lock(tmp_path):
        assert (tmp_path / ".lock").read_text() == str(os.getpid())
    assert not (tmp_path / ".lock").exists()


_RACER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from quantize.errors import LockedError
    from quantize.run.lock import run_lock
    run, log, go = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
    while time.time() < go:
        pass
    try:
        with run_lock(run):
            inside = run / "inside"
            fd = os.open(inside, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # fails if shared
            time.sleep(0.02)
            os.close(fd)
            os.unlink(inside)
        print("owned")
    except LockedError:
        print("refused")
    except FileExistsError:
        print("SHARED")
""")


@pytest.mark.e2e  # 90 interpreters (~15 CPU s)
def test_racing_processes_never_share_a_folder_with_a_stale_lock(tmp_path: Path) -> None:
    """The defect of the pid-file lock: several runs started together on a folder whose
    owner was killed (-9) each cleared the stale lock and each took it."""
    run = tmp_path / "run"
    run.mkdir()
    rounds, racers, owned = 15, 6, 0
    for _ in range(rounds):
        (run / ".lock").write_text("999999")  # left by a run killed with -9
        go = time.time() + 1.5  # after every interpreter has started
        procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(run), "-", str(go)],
                                  stdout=subprocess.PIPE, text=True) for _ in range(racers)]
        outs = [p.communicate(timeout=120)[0].strip() for p in procs]
        assert "SHARED" not in outs, outs
        assert all(o in ("owned", "refused") for o in outs), outs
        assert outs.count("owned") >= 1, outs
        owned += outs.count("owned")
    assert owned >= rounds


def test_entry_lock_serialises_writers(tmp_path: Path) -> None:
    lock = tmp_path / "entry.lock"
    with entry_lock(lock), pytest.raises(LockedError), entry_lock(lock, wait_s=0.2):
        pass
    with entry_lock(lock, wait_s=0.2):
        pass
    assert lock.exists()  # a shared cache's lock file stays


# --- #47: places a run folder cannot be; a lock file that is not one; killed writers' leftovers
def _disk_error(run_dir: Path) -> DiskError:
    with pytest.raises(DiskError) as err, run_lock(run_dir):
        pass
    return err.value


def test_a_run_folder_that_is_a_file_or_a_device(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("mine")
    err = _disk_error(tmp_path / "f")
    assert (err.path, err.problem) == (str(tmp_path / "f"), "is a file, not a folder")
    assert err.hint is not None and "--out" in err.hint
    assert (tmp_path / "f").read_text() == "mine"
    assert _disk_error(Path("/dev/null")).problem == "is not a folder"
    err = _disk_error(tmp_path / "f" / "run")  # under a file
    assert err.problem is not None and "(Not a directory)" in err.problem


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_folder_where_no_file_can_be_made() -> None:
    err = _disk_error(Path("/proc"))
    assert err.path == "/proc/.lock" or (err.problem and "/proc/.lock" in err.problem)


def test_a_lock_that_is_a_folder_a_link_or_a_fifo_is_refused_untouched(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").mkdir()
    err = _disk_error(run)
    assert (err.path, err.problem) == (str(run / ".lock"), "is a folder, not a lock file")
    (run / ".lock").rmdir()
    victim = tmp_path / "victim"
    victim.write_text("must stay")
    (run / ".lock").symlink_to(victim)  # followed, the lock would truncate the victim
    assert _disk_error(run).problem == "is a link, not a lock file"
    assert victim.read_text() == "must stay"
    (run / ".lock").unlink()
    os.mkfifo(run / ".lock")
    assert _disk_error(run).problem == "is a special file (a FIFO or device), not a lock file"


def test_taking_the_lock_sweeps_what_killed_writers_left(tmp_path: Path) -> None:
    from quantize.run.lock import sweep_leftovers

    run = tmp_path / "run"
    for d in (".export.old", ".eval.partial", "export", ".offload"):
        (run / d).mkdir(parents=True)
    (run / ".export.old" / "model.safetensors").write_bytes(b"x")
    (run / ".manifest.json.ab12.tmp").write_text("{")
    (run / "manifest.json").write_text("{}")
    with run_lock(run):
        assert sorted(p.name for p in run.iterdir()) == [".lock", ".offload", "export",
                                                         "manifest.json"]
    assert sweep_leftovers(run) == []
    # not a run folder (no manifest.json): a `.x.old` there is the user's
    home = tmp_path / "home"
    (home / ".config.old").mkdir(parents=True)
    (home / ".manifest.json.ab12.tmp").write_text("theirs")
    with run_lock(home):
        pass
    assert sorted(p.name for p in home.iterdir()) == [".config.old", ".manifest.json.ab12.tmp"]
