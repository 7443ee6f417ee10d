"""The environment refusing a write (ENOSPC, EDQUOT, EROFS, EACCES) becomes one line naming
the path and the fix, exit 2; a stage's `.partial` is removed; shared cache entries are
built by one process at a time under a kernel lock that dies with its owner."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from quantize.cli.app import handle_errors
from quantize.errors import DiskError
from quantize.run import files
from quantize.run.lock import entry_lock

CASES = [
    (OSError(errno.ENOSPC, "No space left on device", "/x/run/quantize/m.safetensors"),
     "no space left on the device writing /x/run/quantize/m.safetensors"),
    (OSError(errno.EDQUOT, "Disk quota exceeded", "/x/run/a"), "disk quota exceeded"),
    (OSError(errno.EROFS, "Read-only file system", "/ro/run"), "read-only file system"),
    (PermissionError(errno.EACCES, "Permission denied", "/root/run"), "permission denied"),
    # a write past `ulimit -f` (Python ignores SIGXFSZ: the write fails with EFBIG)
    (OSError(errno.EFBIG, "File too large", "/x/run/a"), "file-size limit (ulimit -f)"),
    (RuntimeError("Error while serializing: I/O error: File too large (os error 27)"),
     "cannot write /given: the file would exceed"),
    # the safetensors writer (Rust) raises its own type with the OS error in the text
    (RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),
     "no space left on the device writing /given"),
]


@pytest.mark.parametrize(("exc", "phrase"), CASES)
def test_disk_errors_are_one_line_with_path_and_fix(exc: BaseException, phrase: str) -> None:
    err = files.disk_error(exc, "/given")
    assert isinstance(err, DiskError) and err.exit_code == 2
    msg = str(err)
    assert phrase in msg and "\n" not in msg
    assert "re-run the same command" in msg and "resumes" in msg
    # the fields the line is made of: what went wrong (naming the path), and the fix
    assert err.problem is not None and phrase in err.problem
    assert err.hint is not None and "re-run the same command" in err.hint
    assert err.path is not None and err.path in err.problem


def test_other_errors_are_not_disk_errors() -> None:
    assert files.disk_error(ValueError("bad value")) is None
    assert files.disk_error(OSError(errno.ENOENT, "No such file", "/x")) is None


def test_a_disk_error_inside_a_stage_removes_its_partial(tmp_path: Path) -> None:
    final = tmp_path / "quantize"
    with pytest.raises(DiskError) as info, files.atomic_dir(final) as tmp:
        (tmp / "half.safetensors").write_bytes(b"x" * 100)
        raise RuntimeError("I/O error: No space left on device (os error 28)")
    assert info.value.problem is not None and "no space left" in info.value.problem
    assert info.value.path == str(final)
    assert not final.exists() and not files.tmp_dir_for(final).exists()


def test_a_full_disk_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifest is replaced atomically: ENOSPC while writing leaves the old one intact
    and no temporary file."""
    path = tmp_path / "manifest.json"
    path.write_text("old")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(DiskError) as info:
        files.atomic_write_text(path, "new")
    assert info.value.path == str(path)
    assert info.value.problem is not None and f"writing {path}" in info.value.problem
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["manifest.json"]


def _cli(exc: BaseException) -> click.Command:
    @click.command()
    @handle_errors
    def cmd() -> None:
        raise exc

    return cmd


@pytest.mark.parametrize(("exc", "phrase"), CASES[:4])
def test_the_cli_maps_them_to_exit_2_without_traceback(exc: BaseException, phrase: str) -> None:
    res = CliRunner().invoke(_cli(exc))
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and phrase in lines[0]
    assert "internal error" not in res.output and "Traceback" not in res.output


def test_a_read_only_run_folder_is_one_line(tmp_path: Path) -> None:
    """As root permissions do not bind, so a read-only mount is the integration test's job;
    here the mkdir failure itself."""
    from quantize.run.lock import run_lock

    def refuse(*_a: object, **_k: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "run"))

    orig = Path.mkdir
    Path.mkdir = refuse  # type: ignore[method-assign,assignment]
    try:
        with pytest.raises(DiskError) as info, run_lock(tmp_path / "run"):
            pass
    finally:
        Path.mkdir = orig  # type: ignore[method-assign]
    assert info.value.problem is not None and "read-only file system" in info.value.problem
    assert info.value.path == str(tmp_path / "run")
    assert info.value.hint is not None and info.value.hint.startswith("use a writable folder")


# --- cache entries under a kernel lock ------------------------------------------------------
def test_one_conversion_when_threads_race_on_a_fresh_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Four callers of default_model_dir on an empty cache (flock conflicts between open
    files, so threads race like processes): one converts, the others wait, say so, and get
    the same folder. Before the lock, the second died on FileExistsError (its .partial)."""
    from quantize.model import source

    monkeypatch.setenv("QUANTIZE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"gguf")
    monkeypatch.setattr(source, "gguf_path", lambda: gguf)
    calls: list[int] = []
    # the converter holds the lock until the three others have said they wait (a fixed
    # sleep let a loaded machine start them after it had finished: no one waited)
    from quantize.run import lock

    waiting = threading.Semaphore(0)
    say_waiting = lock._say_waiting

    def counted(what: str, path: Path) -> Callable[[str], None]:
        say = say_waiting(what, path)

        def say_and_count(holder: str) -> None:
            say(holder)
            waiting.release()
        return say_and_count

    monkeypatch.setattr(lock, "_say_waiting", counted)

    def convert(_g: Path, out: Path) -> None:
        calls.append(1)
        for _ in range(3):
            if not waiting.acquire(timeout=60):
                raise TimeoutError("the other callers never waited for the lock")
        (out / "config.json").write_text('{"model_type": "llama"}')

    monkeypatch.setattr(source, "_convert_gguf", convert)
    got: list[Path] = []
    threads = [threading.Thread(target=lambda: got.append(source.default_model_dir()))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(got) == 4 and len(set(got)) == 1
    assert (got[0] / ".complete").is_file()
    assert "waiting for process" in capsys.readouterr().err


def test_the_conversion_checks_free_space_first(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from quantize.model import source

    monkeypatch.setenv("QUANTIZE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(source, "gguf_path", lambda: tmp_path / "m.gguf")
    monkeypatch.setattr(source, "free_bytes", lambda _p: 10 * 2**20)
    with pytest.raises(DiskError) as info:
        source.default_model_dir()
    err = info.value
    assert err.path == str(tmp_path / "cache" / "models")
    assert err.problem is not None and "needs 262 MiB" in err.problem
    assert "10 MiB is free" in err.problem
    assert err.hint is not None and "QUANTIZE_CACHE" in err.hint
    assert not any((tmp_path / "cache" / "models").glob("*.partial"))


def test_model_hashes_of_two_models_are_both_kept(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """hashes.json is read, merged and written under its lock: a process that hashed model B
    while another wrote model A's entry keeps A's."""
    import json

    from quantize.model import source

    monkeypatch.setenv("QUANTIZE_CACHE", str(tmp_path / "cache"))
    refs = []
    for name in ("a", "b"):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(f'{{"model_type": "llama", "n": "{name}"}}')
        (d / "model.safetensors").write_bytes(name.encode() * 10)
        refs.append(source.ModelRef(name, d, name))
    source.model_fingerprint(refs[0])
    stale = json.loads((tmp_path / "cache" / "hashes.json").read_text())
    real_read = source._read_hashes
    seen = iter([{}])  # B's process read the cache before A's entry was written
    monkeypatch.setattr(source, "_read_hashes", lambda p: next(seen, None) or real_read(p))
    source.model_fingerprint(refs[1])
    after = json.loads((tmp_path / "cache" / "hashes.json").read_text())
    assert set(stale) <= set(after) and len(after) == 4


HOLDER = """
import sys, time
from pathlib import Path
from quantize.run.lock import entry_lock
with entry_lock(Path(sys.argv[1]), what="a test entry"):
    Path(sys.argv[2]).write_text("held")
    time.sleep(600)
"""


def test_a_dead_owner_never_blocks(tmp_path: Path) -> None:
    """A process holding an entry lock is SIGKILLed: the next taker gets it at once (the
    kernel dropped the flock), and while it lived a taker said whom it waited for."""
    lock, held = tmp_path / ".entry.lock", tmp_path / "held"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), str(held)],
                            env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    try:
        deadline = time.time() + 60
        while not held.exists():
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.05)
        said: list[str] = []
        from quantize.errors import LockedError
        from quantize.run import lock as lockmod

        with pytest.raises(LockedError) as err:
            lockmod._take(lock, wait_s=0.3, on_wait=said.append,
                          refused=lambda h: (f"gave up waiting for {h} to finish a test entry",
                                             "stop it"))
        assert err.value.problem == f"gave up waiting for process {proc.pid} to finish a test entry"
        assert (err.value.path, err.value.hint) == (str(lock), "stop it")
        assert said == [f"process {proc.pid}"]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with entry_lock(lock, wait_s=5):  # the dead owner's lock is gone with it
        assert lock.read_text() == str(os.getpid())
