"""Faults of the environment, on real file systems: a run whose disk fills up at each stage
that writes, a folder that turns read-only, an output folder that is read-only from the
start, a disk too small for the run (refused before calibration), and several processes
started together on a fresh model cache.

The disk is a real tmpfs (mounted by the test, so it needs root; without it the module
skips and tests/unit/run/test_fault_errors.py injects the same errors in-process). A real
`quantize run fp8-dynamic` on the tiny model pauses at a named point
(QUANTIZE_PAUSE_AT/QUANTIZE_PAUSE_UNTIL, quantize.run.files.pause_point); the test fills
the tmpfs to the last byte (or makes the run folder read-only) and lets the run go on. Each fault
must end the run with exit 2 and exactly one line naming the path and the fix, no
traceback, the manifest byte-for-byte unchanged and no `.partial` left; the next run (disk
freed) must resume at the stage that failed. The chain of faults ends in a run whose
hashes equal an uninterrupted run's.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures.pause import cmd, env, stage_hashes, start_paused, wait_for_pause

MiB = 2**20
# (pause point, fault): the stage named by the point is the one that must fail
CHAIN = [
    ("calibrate:start", "full"),  # token ids, written by safetensors' Rust writer
    ("quantize:start", "full"),  # llm-compressor saving the checkpoint
    ("quantize:start", "read-only"),  # the run folder turned read-only
    ("export:half", "full"),  # half of the export's files copied
    ("eval:start", "full"),  # the baseline's cache entry (cache on the same disk)
    ("gate:start", "full"),  # gate.json
]
PHRASE = {"full": "no space left on the device", "read-only": "read-only file system"}


def _mount(path: Path, size: str, *options: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    opts = ",".join((f"size={size}", *options))
    return subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _can_mount() -> bool:
    if os.geteuid() != 0:
        return False
    probe = Path(f"/tmp/quantize-fault-probe-{os.getpid()}")
    ok = _mount(probe, "1m")
    if ok:
        subprocess.run(["umount", str(probe)], check=True)
    with contextlib.suppress(OSError):
        probe.rmdir()
    return ok


pytestmark = pytest.mark.skipif(
    not _can_mount(), reason="mounting a tmpfs needs root; tests/unit/run/test_fault_errors.py "
    "covers the same errors in-process")


@contextlib.contextmanager
def tmpfs(path: Path, size: str, *options: str) -> Iterator[Path]:
    assert _mount(path, size, *options)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(root: Path) -> Path:
    """Write a file until the file system has not one more byte."""
    filler = root / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (MiB, 4096, 1):
            while True:
                try:
                    os.write(fd, b"\0" * chunk)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
                    break
    finally:
        os.close(fd)
    return filler


def one_error_line(err: str, phrase: str) -> str:
    """The stderr of a refused run: one `error:` line, the last, no traceback."""
    assert "Traceback" not in err and "internal error" not in err, err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
    assert phrase in errors[0] and "re-run the same command" in errors[0], errors[0]
    return errors[0]


def test_full_disk_and_read_only_folder_at_each_writing_stage(
        tiny_model: Path, pause_suite: Path, pause_reference: Path, tmp_path: Path) -> None:
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    with tmpfs(tmp_path / "disk", "96m") as disk:
        out, cache = disk / "run", disk / "cache"
        counts = {"injected": 0, "survived": 0, "messages": 0}
        previous: str | None = None
        for point, fault in CHAIN:
            marker, go = ctl / "paused", ctl / "go"
            proc = start_paused(tiny_model, out, pause_suite, point, marker,
                                QUANTIZE_CACHE=str(cache), QUANTIZE_PAUSE_UNTIL=str(go))
            try:
                wait_for_pause(proc, marker, timeout_s=600)
                manifest = out / "manifest.json"
                before = manifest.read_bytes() if manifest.exists() else None
                if fault == "full":
                    filler = fill(disk)
                else:  # a read-only bind mount over the run folder (remounting the tmpfs
                    # itself read-only is refused while the run holds its lock file open)
                    subprocess.run(["mount", "--bind", str(out), str(out)], check=True)
                    subprocess.run(["mount", "-o", "remount,bind,ro", str(out)], check=True)
                counts["injected"] += 1
                go.touch()
                _, err = proc.communicate(timeout=600)
            except BaseException:
                proc.kill()  # never leave a paused run behind a failed test
                proc.wait()
                raise
            if fault == "full":
                filler.unlink()
            else:
                subprocess.run(["umount", str(out)], check=True)
            assert proc.returncode == 2, err
            line = one_error_line(err, PHRASE[fault])
            assert str(disk) in line, line
            counts["messages"] += 1
            stage = point.split(":")[0]
            # the resumed stage before this fault ran, the earlier ones were kept
            if previous is not None:
                assert f"{previous}: no finished result yet" in err, err
            assert (manifest.read_bytes() if manifest.exists() else None) == before
            assert not (out / f".{stage}.partial").exists() and not (out / stage).exists()
            counts["survived"] += 1
            previous = stage
            marker.unlink()
            go.unlink()
        done = subprocess.run(cmd(tiny_model, out, pause_suite), capture_output=True, text=True,
                              env=env(QUANTIZE_CACHE=str(cache)))
        assert done.returncode == 0, done.stderr
        assert "gate: no finished result yet" in done.stderr
        for before_gate in ("calibrate", "quantize", "export", "eval"):
            assert f"skip {before_gate}: inputs unchanged" in done.stderr, done.stderr
        assert stage_hashes(out) == stage_hashes(pause_reference)
        assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []
    assert counts == {"injected": len(CHAIN), "survived": len(CHAIN), "messages": len(CHAIN)}


def test_a_disk_too_small_is_refused_before_calibration(tiny_model: Path, pause_suite: Path,
                                                        tmp_path: Path) -> None:
    """8 MiB free, the run needs ~20 MB: refused at once, nothing written; with
    --no-disk-check it goes on and the full disk still stops it on one line."""
    with tmpfs(tmp_path / "disk", "8m") as disk:
        out = disk / "run"
        e = env(QUANTIZE_CACHE=str(disk / "cache"))
        proc = subprocess.run(cmd(tiny_model, out, pause_suite), capture_output=True, text=True,
                              env=e)
        assert proc.returncode == 2, proc.stderr
        assert "calibrate:" not in proc.stderr  # refused before the first stage
        line = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        assert len(line) == 1 and "not enough disk space" in line[0], proc.stderr
        assert str(out) in line[0] and "MiB is free there" in line[0]
        assert "--no-disk-check" in line[0] and "Traceback" not in proc.stderr
        assert not out.exists()
        late = subprocess.run([*cmd(tiny_model, out, pause_suite), "--no-disk-check"],
                              capture_output=True, text=True, env=e)
        assert late.returncode == 2, late.stderr
        one_error_line(late.stderr, "no space left on the device")
        m = json.loads((out / "manifest.json").read_text())
        assert list(m["stages"]) == ["calibrate"]  # what finished is kept for the re-run
        assert not list(out.glob(".*.partial"))


def test_a_read_only_output_folder_is_one_line(tiny_model: Path, pause_suite: Path,
                                               tmp_path: Path) -> None:
    with tmpfs(tmp_path / "ro", "1m", "ro") as ro:
        proc = subprocess.run(cmd(tiny_model, ro / "run", pause_suite), capture_output=True,
                              text=True, env=env())
        assert proc.returncode == 2, proc.stderr
        line = one_error_line(proc.stderr, "read-only file system")
        assert str(ro / "run") in line
        assert list(ro.iterdir()) == []


CONVERT = ("from quantize.model.source import default_model_dir, model_fingerprint, "
           "resolve_model; default_model_dir(); "
           "print('fingerprint', model_fingerprint(resolve_model('default')))")


@pytest.mark.slow  # a second real conversion: ~1.5 min on an idle 2-core machine, 5.6 loaded
def test_processes_started_together_on_a_fresh_cache(tmp_path: Path) -> None:
    """Three processes on an empty cache, each resolving the default model (real GGUF
    conversion, ~20-50 s): one converts, the others say what they wait for and reuse it;
    all succeed with the same fingerprint. Before the lock, the second one died with
    FileExistsError on the conversion's .partial folder."""
    cache = tmp_path / "cache"
    e = {**os.environ, "QUANTIZE_CACHE": str(cache)}
    procs = [subprocess.Popen([sys.executable, "-c", CONVERT], env=e, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(3)]
    results = [(*p.communicate(timeout=600), p.returncode) for p in procs]
    results = [(rc, out, err) for out, err, rc in results]
    for rc, _out, err in results:
        assert rc == 0, err
    assert sum("to bf16 safetensors (first use only)" in err for _, _, err in results) == 1
    assert sum("waiting for process" in err for _, _, err in results) >= 1
    prints = {out.strip() for _, out, _ in results}
    assert len(prints) == 1 and next(iter(prints)).startswith("fingerprint ")
    models = cache / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == [
        "SmolLM2-135M-Instruct-bf16"]
