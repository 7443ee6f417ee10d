"""The disk pre-check's estimate against what a real run writes: a fresh run folder and a
fresh cache, every byte of both counted after the run (hard links once), compared with the
estimate the run recorded before calibration (manifest `preflight.disk_needed_bytes`).
docs/reliability.md has the figures for every shipped recipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def written_bytes(*folders: Path) -> int:
    """Bytes of every file under `folders`, each inode once (the export's hard links)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for folder in folders:
        for p in folder.rglob("*"):
            st = os.lstat(p)
            if p.is_file() and not p.is_symlink() and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


@pytest.mark.parametrize("recipe", [
    "gptq-int4",
    pytest.param("w8a8-int8", marks=pytest.mark.slow),
    pytest.param("rtn-int4", marks=pytest.mark.slow),
])
def test_estimate_is_within_10_percent_of_the_bytes_written(
        recipe: str, tiny_model: Path, pause_suite: Path, tmp_path: Path) -> None:
    """pause_suite: the kill matrix's 256-token perplexity suite."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    proc = subprocess.run(
        [sys.executable, "-m", "quantize.cli", "run", recipe, "--model", str(tiny_model),
         "--out", str(out), "--suite", str(pause_suite), "--device", "cpu"],
        capture_output=True, text=True, env={**os.environ, "QUANTIZE_CACHE": str(cache)})
    assert proc.returncode in (0, 3), proc.stderr  # 3: a gate verdict, not a failure here
    estimate = json.loads((out / "manifest.json").read_text())["preflight"]["disk_needed_bytes"]
    assert set(estimate) == {"calibrate", "quantize", "export", "eval", "baseline cache",
                             "gate", "manifest"}
    written = written_bytes(out, cache)
    assert abs(sum(estimate.values()) - written) <= 0.10 * written, (estimate, written)
    # the weights dominate: the planner's bytes for them are what makes the estimate
    weights = (out / "quantize" / "model.safetensors").stat().st_size
    assert weights > 0.5 * written
