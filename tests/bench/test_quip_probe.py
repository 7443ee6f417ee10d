"""bench/quip_probe.py: the rotation variant and its control run on a tiny model, score both
texts, keep the embeddings tied, and the rotation changes the quantized model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from bench import quip_probe


@pytest.mark.slow  # a bench script's check: make test-slow
def test_the_rotated_variant_and_its_control(tiny_model: Path, tmp_path: Path) -> None:
    cal = tmp_path / "calibration.safetensors"
    ids = torch.randint(5, 1000, (4, 64))
    save_file({"input_ids": ids, "lengths": torch.full((4,), 64)}, str(cal))
    control = quip_probe.run(tiny_model, cal, "control", None)
    rotated = quip_probe.run(tiny_model, cal, "hadamard-64",
                             {"transform_type": "hadamard", "transform_block_size": 64})
    for row in (control, rotated):
        assert math.isfinite(row["wiki_ppl"]) and math.isfinite(row["novel_ppl"])
        assert row["tokens"] == 16368 and row["tied_embeddings"]
    assert rotated["wiki_ppl"] != pytest.approx(control["wiki_ppl"], rel=1e-6)
