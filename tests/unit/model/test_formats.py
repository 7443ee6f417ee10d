"""quantize.model.formats: every format named from headers only, and every unknown or
contradictory input refused in one line naming what was found."""

# ruff: noqa: F811  (session fixtures imported from fixtures.convert_models)
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from fixtures.convert_models import (  # noqa: F401 (fixtures)
    awq_dir,
    bf16_dir,
    bf16_mtp_dir,
    ct_dir,
    fp8_dir,
    gptq_dir,
)
from safetensors.torch import save_file

from quantize.errors import ModelError
from quantize.model.formats import Format, detect, mtp_layer_names


def test_each_format_is_named(bf16_dir: Path, fp8_dir: tuple, gptq_dir: tuple, awq_dir: tuple,
                              ct_dir: tuple) -> None:
    assert detect(bf16_dir).format is Format.HF_BF16
    fp8 = detect(fp8_dir[0])
    assert (fp8.format, fp8.detail) == (Format.FP8_BLOCK, "block 48x48")
    assert detect(gptq_dir[0]).describe() == "gptq (gptq)"
    assert detect(awq_dir[0]).describe() == "awq (gemm)"
    ct = detect(ct_dir[0])
    assert (ct.format, ct.detail) == (Format.COMPRESSED_TENSORS, "pack-quantized")
    # headers only: every tensor is listed with its file and shape, none was read
    assert all(t.nbytes > 0 for t in ct.tensors.values())


def test_shipped_gguf_is_named_with_its_file_type() -> None:
    from quantize.model.source import gguf_path

    d = detect(gguf_path())
    assert d.format is Format.GGUF
    assert d.detail == "Q4_1"
    assert "Q4_1" in d.notes[0]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _set_qc(folder: Path, qc: dict | None) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    if qc is None:
        cfg.pop("quantization_config", None)
    else:
        cfg["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(cfg))


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_config_gptq_over_plain_tensors_is_refused(bf16_dir: Path, tmp_path: Path) -> None:
    m = _copy(bf16_dir, tmp_path / "m")
    _set_qc(m, {"quant_method": "gptq", "bits": 4})
    with pytest.raises(ModelError) as exc:
        detect(m)
    msg = _one_line(exc)
    assert "config says quant_method 'gptq' but the tensors are plain float tensors" in msg
    assert "supported:" in msg


def test_packed_tensors_without_config_are_refused(gptq_dir: tuple, tmp_path: Path) -> None:
    m = _copy(gptq_dir[0], tmp_path / "m")
    _set_qc(m, None)
    with pytest.raises(ModelError, match="GPTQ/AWQ qweight tensors without a quantization"):
        detect(m)


def test_modelopt_is_refused_naming_the_scale_convention(bf16_dir: Path, tmp_path: Path
                                                         ) -> None:
    m = _copy(bf16_dir, tmp_path / "m")
    _set_qc(m, {"quant_method": "modelopt", "quant_algo": "NVFP4"})
    with pytest.raises(ModelError, match=r"ModelOpt.*reciprocal of compressed-tensors"):
        detect(m)


def test_unknown_method_is_refused(bf16_dir: Path, tmp_path: Path) -> None:
    m = _copy(bf16_dir, tmp_path / "m")
    _set_qc(m, {"quant_method": "bitsandbytes"})
    with pytest.raises(ModelError, match="quant_method 'bitsandbytes'"):
        detect(m)


def test_pickles_are_refused(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    torch.save({"w": torch.zeros(2)}, tmp_path / "m" / "pytorch_model.bin")
    with pytest.raises(ModelError, match=r"pickle weights only \(pytorch_model.bin\)"):
        detect(tmp_path / "m")
    with pytest.raises(ModelError, match=r"a pickle file \(.bin\)"):
        detect(tmp_path / "m" / "pytorch_model.bin")


def test_truncated_shard_is_refused(bf16_dir: Path, tmp_path: Path) -> None:
    m = _copy(bf16_dir, tmp_path / "m")
    f = m / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelError, match="is truncated: tensor"):
        detect(m)


def test_index_naming_a_missing_shard_is_refused(fp8_dir: tuple, tmp_path: Path) -> None:
    m = _copy(fp8_dir[0], tmp_path / "m")
    (m / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelError, match=r"names 1 shard\(s\) that are missing"):
        detect(m)


def test_no_config_is_refused(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    save_file({"w": torch.zeros(2)}, tmp_path / "m" / "model.safetensors")
    with pytest.raises(ModelError, match=r"without config.json"):
        detect(tmp_path / "m")


def test_mtp_layers_are_found_from_the_weights() -> None:
    names = {"model.layers.0.mlp.up_proj.weight", "model.layers.2.eh_proj.weight",
             "model.mtp.0.norm.weight", "model.norm.weight"}
    assert mtp_layer_names(names, 2) == {"model.layers.2.eh_proj.weight",
                                         "model.mtp.0.norm.weight"}
