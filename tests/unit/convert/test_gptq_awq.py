"""GPTQ (v1, asym and sym) and AutoAWQ GEMM -> compressed-tensors W4A16: the same codes,
scales and zeros (max-abs 0 against the source's own dequantization), the config llm-compressor
writes, and plain transformers computes the source's dequantized model from the output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fixtures.convert_models import IDS, kl, loaded_logits, reference_logits, to_gptq
from safetensors.torch import load_file

from quantize.convert.gptq_awq import _unpack_cols, _unpack_rows, _v2_zeros
from quantize.convert.run import Options, convert
from quantize.errors import ModelError


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _repack(src: Path, out: Path, bf16: Path, ref: dict) -> dict:
    r = convert(src, "compressed-tensors", out, Options(smoke=False))
    assert r.preserved
    assert r.tensors.tensors == 20 and r.tensors.worst_max_abs == 0.0  # lossless repack
    assert kl(reference_logits(bf16, ref, IDS), loaded_logits(out, IDS)) < 1e-4
    return json.loads((out / "config.json").read_text())["quantization_config"]


def test_gptq_asym_repacks_losslessly(gptq_dir: tuple, bf16_dir: Path, tmp_path: Path) -> None:
    qc = _repack(gptq_dir[0], tmp_path / "out", bf16_dir, gptq_dir[1])
    w = qc["config_groups"]["group_0"]["weights"]
    assert (qc["quant_method"], qc["format"]) == ("compressed-tensors", "pack-quantized")
    assert (w["num_bits"], w["symmetric"], w["group_size"], w["strategy"], w["type"]) == \
        (4, False, 32, "group", "int")
    assert qc["ignore"] == ["lm_head"]
    names = _weights(tmp_path / "out")
    up = "model.layers.0.mlp.up_proj"
    assert names[f"{up}.weight_packed"].shape == (128, 8)  # [out, in/8]
    assert names[f"{up}.weight_scale"].shape == (128, 2)  # [out, groups]
    assert names[f"{up}.weight_zero_point"].shape == (16, 2)  # [out/8, groups]
    assert names[f"{up}.weight_shape"].tolist() == [128, 64]


def test_gptq_sym_has_no_zero_point(bf16_dir: Path, tmp_path: Path) -> None:
    ref = to_gptq(bf16_dir, tmp_path / "src", sym=True)
    qc = _repack(tmp_path / "src", tmp_path / "out", bf16_dir, ref)
    assert qc["config_groups"]["group_0"]["weights"]["symmetric"] is True
    assert not any("zero_point" in n for n in _weights(tmp_path / "out"))


def test_awq_gemm_repacks_losslessly(awq_dir: tuple, bf16_dir: Path, tmp_path: Path) -> None:
    qc = _repack(awq_dir[0], tmp_path / "out", bf16_dir, awq_dir[1])
    assert qc["config_groups"]["group_0"]["weights"]["symmetric"] is False


def test_act_order_with_a_permuted_g_idx_is_refused_before_any_work(bf16_dir: Path,
                                                                   tmp_path: Path) -> None:
    to_gptq(bf16_dir, tmp_path / "src", act_order=True)
    with pytest.raises(ModelError, match=r"act-order .* permuted g_idx"):
        convert(tmp_path / "src", "compressed-tensors", tmp_path / "out")
    assert not list(tmp_path.glob(".out*")) and not (tmp_path / "out").exists()


def test_act_order_converts_to_bf16_with_its_g_idx(bf16_dir: Path, tmp_path: Path) -> None:
    ref = to_gptq(bf16_dir, tmp_path / "src", act_order=True)
    r = convert(tmp_path / "src", "hf-bf16", tmp_path / "out", Options(smoke=False))
    assert r.preserved
    got = _weights(tmp_path / "out")
    for name, want in ref.items():
        assert torch.equal(got[name], want.to(torch.bfloat16)), name


def test_v1_zero_offset_carries_across_nibbles() -> None:
    # zero code 0 is stored by v1 as -1 in its nibble, borrowing from the next one
    codes = torch.tensor([[0, 5, 15, 1, 0, 0, 7, 8]], dtype=torch.int64)
    word = sum(int(c) << (4 * j) for j, c in enumerate(codes[0]))
    v1 = (word - 0x11111111) & 0xFFFFFFFF
    stored = torch.tensor([[v1 - (1 << 32) if v1 >= 1 << 31 else v1]], dtype=torch.int32)
    assert _unpack_cols(_v2_zeros(stored)).tolist() == codes.tolist()
    rows = torch.tensor([[word - (1 << 32) if word >= 1 << 31 else word]], dtype=torch.int32)
    assert _unpack_rows(rows)[:, 0].tolist() == codes[0].tolist()
