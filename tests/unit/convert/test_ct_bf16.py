"""compressed-tensors -> bf16 through compressed-tensors' own decompressors, module by
module: values equal the source's dequantization and transformers computes that model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from fixtures.convert_models import IDS, kl, loaded_logits, reference_logits
from safetensors.torch import load_file

from quantize.convert.ct_bf16 import DROPPED_REASON, CompressedToDense
from quantize.convert.run import Options, convert
from quantize.model.formats import detect


def test_w4a16_decompresses_to_the_reference(ct_dir: tuple, bf16_dir: Path, tmp_path: Path
                                             ) -> None:
    src, ref = ct_dir
    r = convert(src, "hf-bf16", tmp_path / "out", Options(smoke=False))
    assert r.preserved
    got: dict[str, torch.Tensor] = {}
    for f in (tmp_path / "out").glob("*.safetensors"):
        got.update(load_file(f))
    assert set(got) == set(ref)
    for name, want in ref.items():
        assert torch.equal(got[name], want.to(torch.bfloat16)), name
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in cfg
    want = reference_logits(bf16_dir, {k: v.to(torch.bfloat16).float() for k, v in ref.items()},
                            IDS)
    assert kl(want, loaded_logits(tmp_path / "out", IDS)) < 1e-4


def test_activation_scales_are_dropped_with_their_reason(ct_dir: tuple) -> None:
    conv = CompressedToDense(detect(ct_dir[0]), "bfloat16")
    m = "model.layers.0.mlp.up_proj"
    tensors = {n: t for f in ct_dir[0].glob("*.safetensors") for n, t in load_file(f).items()
               if n.startswith(m + ".")}
    primary = f"{m}.weight_packed"
    group = {primary: tensors.pop(primary), **tensors, f"{m}.input_scale": torch.ones(1)}
    out = conv.convert(group)
    assert set(out.tensors) == {f"{m}.weight"}
    assert out.dropped == {f"{m}.input_scale": DROPPED_REASON}
    assert out.mapped[f"{m}.weight_scale"] == f"{m}.weight"
