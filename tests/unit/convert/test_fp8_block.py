"""FP8-block -> bf16: values equal the block dequantization (partial edge blocks included),
scales found across shards, MTP layers kept, and transformers computes the dequantized
model's logits from the output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fixtures.convert_models import IDS, kl, loaded_logits, reference_logits
from safetensors.torch import load_file

from quantize.convert.fp8_block import block_size, reference
from quantize.convert.run import convert
from quantize.errors import ModelError
from quantize.model.formats import detect


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_values_are_the_block_dequantization(fp8_dir: tuple, tmp_path: Path) -> None:
    src, ref = fp8_dir
    r = convert(src, "hf-bf16", tmp_path / "out")
    assert r.smoke.skipped is not None and "needs whole blocks" in r.smoke.skipped
    got = _weights(tmp_path / "out")
    assert set(got) == set(ref)  # every weight, MTP layer 2 included; no scale left
    assert any(".layers.2." in n for n in got)
    for name, want in ref.items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], want.to(torch.bfloat16)), name
    assert r.tensors.tensors == len(ref)
    assert r.tensors.worst_max_abs < 2e-2 and r.tensors.min_cosine > 0.9999
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["num_nextn_predict_layers"] == 1
    assert r.preserved


def test_partial_edge_block_reference_matches_by_hand() -> None:
    w = torch.ones(5, 3).to(torch.float8_e4m3fn)
    s = torch.tensor([[2.0, 3.0], [5.0, 7.0]])
    out = reference(w, s, (4, 2))
    assert out[0].tolist() == [2.0, 2.0, 3.0] and out[4].tolist() == [5.0, 5.0, 7.0]


def test_a_scale_grid_that_does_not_fit_the_block_is_refused(fp8_dir: tuple, tmp_path: Path
                                                             ) -> None:
    import shutil

    m = tmp_path / "m"
    shutil.copytree(fp8_dir[0], m)
    cfg = json.loads((m / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [128, 128]
    (m / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=r"blocks of 128x128 over"):
        block_size(detect(m))


def test_transformers_computes_the_dequantized_model(fp8_even_dir: tuple, bf16_dir: Path,
                                                     tmp_path: Path) -> None:
    src, ref = fp8_even_dir
    r = convert(src, "hf-bf16", tmp_path / "out")
    want = reference_logits(bf16_dir, {k: v.to(torch.bfloat16).float() for k, v in ref.items()},
                            IDS)
    got = loaded_logits(tmp_path / "out", IDS)
    assert kl(want, got) < 1e-4
    # the report's own smoke test: the source loads in transformers' FP8 path here
    assert r.smoke.skipped is None and r.smoke.kl is not None and r.smoke.kl < 1e-3


def test_large_weights_are_dequantized_and_checked_in_row_chunks(tmp_path: Path) -> None:
    from quantize.convert.fp8_block import Fp8BlockToDense
    from quantize.model.formats import Detected, Format

    d = Detected(Format.FP8_BLOCK, tmp_path, quant_config={"weight_block_size": [4, 4]})
    conv = Fp8BlockToDense(d, "float32")
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(150, 10, generator=g) * 10).to(torch.float8_e4m3fn)  # 3 chunks of 64
    s = torch.rand(38, 3, generator=g)
    done = conv.convert({"a.weight": w, "a.weight_scale_inv": s})
    assert torch.equal(done.tensors["a.weight"], reference(w, s, (4, 4)))
    (check,) = done.checks
    assert check.max_abs == 0.0 and check.cosine == 1.0
