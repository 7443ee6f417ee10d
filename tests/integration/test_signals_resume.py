"""SIGTERM (a scheduler or container stop, `kill`) and SIGHUP (the terminal closed) stop a
real `quantize run` the way Ctrl-C does, at the kill matrix's points: exit 128+signal, one
`interrupted (SIGTERM): finished stages are kept; ...` line, no traceback, the lock released,
no `.partial` left, the interrupted stage not in the manifest; the same command then
resumes and ends with the hashes of an uninterrupted run (tests/integration/test_resume.py
checks the same for SIGKILL and SIGINT, with the same helpers).

`make test` sends 2 of them; `make test-slow` the whole table.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
from fixtures.pause import resume_and_compare, start_paused, wait_for_pause

SIGNALS = (signal.SIGTERM, signal.SIGHUP)
POINTS = ["calibrate:written", "quantize:start", "quantize:written", "export:half",
          "eval:baseline", "gate:written"]
DEFAULT = {("export:half", signal.SIGTERM), ("eval:baseline", signal.SIGHUP)}


def _cases() -> list[Any]:
    return [pytest.param(p, s, id=f"{p}-{s.name}",
                         marks=() if (p, s) in DEFAULT else pytest.mark.slow)
            for p in POINTS for s in SIGNALS]


def signal_point_count() -> int:
    """Points x signals (docs/reliability.md quotes it)."""
    return len(POINTS) * len(SIGNALS)


@pytest.mark.parametrize(("point", "sig"), _cases())
def test_term_and_hup_stop_cleanly_and_resume(point: str, sig: signal.Signals, tiny_model: Path,
                                              pause_suite: Path, pause_reference: Path,
                                              tmp_path: Path) -> None:
    out, marker = tmp_path / "run", tmp_path / "paused"
    proc = start_paused(tiny_model, out, pause_suite, point, marker)
    try:
        wait_for_pause(proc, marker)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=300)
    except BaseException:
        proc.kill()  # never leave a paused run behind a failed test
        proc.wait()
        raise
    assert proc.returncode == 128 + sig, err
    assert err.strip().splitlines()[-1] == (
        f"interrupted ({sig.name}): finished stages are kept; re-run the same command to "
        "resume"), err
    assert "Traceback" not in err and "error:" not in err
    assert not (out / ".lock").exists()  # released, as after Ctrl-C
    stage = point.split(":")[0]
    manifest = json.loads((out / "manifest.json").read_text()) if (
        out / "manifest.json").exists() else {"stages": {}}
    assert stage not in manifest["stages"]
    assert not (out / f".{stage}.partial").exists() and not (out / stage).exists()
    resume_and_compare(point, tiny_model, pause_suite, out, pause_reference)
