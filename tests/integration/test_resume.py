"""Kill a real `quantize run` subprocess at named points (QUANTIZE_PAUSE_AT makes it sleep
there), then re-run the same command: it resumes from the last finished stage, never reuses
a half-written folder, and the export is hash-identical to an uninterrupted run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

FAST = [("export:written", signal.SIGKILL), ("calibrate:start", signal.SIGINT)]
SLOW = [("calibrate:written", signal.SIGKILL), ("quantize:start", signal.SIGINT),
        ("quantize:written", signal.SIGKILL), ("export:start", signal.SIGKILL),
        ("eval:written", signal.SIGKILL), ("gate:start", signal.SIGINT)]


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("suite") / "resume.yaml"
    p.write_text("name: resume\nmetrics:\n  - name: ppl\n    kind: perplexity\n"
                 "    direction: lower_is_better\n    builtin: wiki-eval\n    max_tokens: 256\n"
                 "    seq_len: 128\n    threshold: 0.5\n")
    return p


def cmd(model: Path, out: Path, suite: Path) -> list[str]:
    return [sys.executable, "-m", "quantize.cli", "run", "fp8-dynamic", "--model", str(model),
            "--out", str(out), "--suite", str(suite), "--device", "cpu"]


def export_files(out: Path) -> dict[str, str]:
    files: dict[str, str] = json.loads((out / "export" / "manifest.json").read_text())["files"]
    return files


@pytest.fixture(scope="module")
def reference(tiny_model: Path, suite: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "run"
    subprocess.run(cmd(tiny_model, out, suite), check=True, capture_output=True)
    return out


def _kill_at(point: str, sig: signal.Signals, tiny_model: Path, suite: Path, out: Path) -> None:
    marker = out.parent / "paused"
    env = {**os.environ, "QUANTIZE_PAUSE_AT": point, "QUANTIZE_PAUSE_MARKER": str(marker)}
    proc = subprocess.Popen(cmd(tiny_model, out, suite), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "never reached the pause point"
        time.sleep(0.2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    if sig == signal.SIGINT:
        assert "interrupted" in err and "Traceback" not in err
    stage, when = point.split(":")
    # the interrupted stage never looks finished
    manifest = json.loads((out / "manifest.json").read_text()) if (
        out / "manifest.json").exists() else {"stages": {}}
    assert stage not in manifest["stages"]
    if when == "start" or sig == signal.SIGINT:
        assert not (out / stage).exists()


def _resume(tiny_model: Path, suite: Path, out: Path, reference: Path) -> None:
    proc = subprocess.run(cmd(tiny_model, out, suite), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert export_files(out) == export_files(reference)
    assert not list(out.glob(".*.partial")) and not (out / ".lock").exists()


@pytest.mark.parametrize(("point", "sig"), FAST)
def test_kill_and_resume(point: str, sig: signal.Signals, tiny_model: Path, suite: Path,
                         reference: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _kill_at(point, sig, tiny_model, suite, out)
    _resume(tiny_model, suite, out, reference)


@pytest.mark.slow
@pytest.mark.parametrize(("point", "sig"), SLOW)
def test_kill_and_resume_everywhere(point: str, sig: signal.Signals, tiny_model: Path,
                                    suite: Path, reference: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _kill_at(point, sig, tiny_model, suite, out)
    _resume(tiny_model, suite, out, reference)
