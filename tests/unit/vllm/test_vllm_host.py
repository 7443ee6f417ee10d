"""The worker protocol of quantize.vllm.host (no vLLM needed: an unknown op is answered by
the worker itself before it imports vllm)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from quantize.vllm import host


def test_a_relative_workdir_still_gets_the_result(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker runs inside workdir; a relative workdir once made it write its result to
    workdir/workdir/... and the caller saw 'exited without a result'."""
    monkeypatch.chdir(tmp_path)
    res = host.run_worker(Path(sys.executable), {"op": "nope"}, Path("rel") / "logs", "t", 120)
    assert res.get("error_type") != "Crash", res
    assert "unknown op" in str(res.get("error")), res
    assert (tmp_path / "rel" / "logs" / "t.result.json").is_file()
