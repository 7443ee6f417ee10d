"""Data-parallel calibration for real: `quantize export --gpus 2` on CPU runs the quantize stage
under `torchrun --nproc-per-node 2` (gloo), llm-compressor's DDP GPTQ on the tiny model, and is
compared with the one-process run of the same recipe and calibration set. Then the disk tier:
weights offloaded to disk (host RAM short) give the same export as weights in RAM."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from fixtures.tiers import quantize_both_tiers

from quantize.pipeline import RunOptions, run

SPEC = """name: tiny-8x128
description: 8 packed 128-token windows of the shipped wiki text (distributed test)
builtin: wiki
num_samples: 8
seq_len: 128
seed: 0
packing: true
"""


def _export(tiny_model: Path, tmp: Path, gpus: int) -> Path:
    (tmp / "calib.yaml").write_text(SPEC)
    out = tmp / f"run-{gpus}"
    run(RunOptions(recipe="gptq-int4", model=str(tiny_model), dataset=str(tmp / "calib.yaml"),
                   out=out, device="cpu", until="export", gpus=gpus))
    return out


def _tensors(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def _kl_to_source(tiny_model: Path, export: Path) -> float:
    """Mean KL(source || quantized) of next-token distributions on held-out text."""
    import inspect

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig

    from quantize.recipe.texts import BUILTIN_TEXT

    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = tok(BUILTIN_TEXT["wiki-eval"].read_text(encoding="utf-8"))["input_ids"][:4 * 128]
    x = torch.tensor(ids).view(4, 128)
    src = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    new_flag = "dequantize" in inspect.signature(CompressedTensorsConfig).parameters
    q = AutoModelForCausalLM.from_pretrained(
        export, dtype=torch.float32, quantization_config=CompressedTensorsConfig(
            **({"dequantize": True} if new_flag else {"run_compressed": False}))).eval()
    with torch.no_grad():
        p = torch.log_softmax(src(x).logits, -1)
        r = torch.log_softmax(q(x).logits, -1)
    return float((p.exp() * (p - r)).sum(-1).mean())


def test_two_cpu_processes_match_one(tiny_model: Path, tmp_path: Path) -> None:
    one, two = _export(tiny_model, tmp_path, 1), _export(tiny_model, tmp_path, 2)

    # the stage ran on two processes, each on half of the calibration windows
    s = json.loads((two / "manifest.json").read_text())["stages"]["quantize"]["summary"]
    assert (s["processes"], s["process_group"], s["samples_per_process"]) == (2, "gloo", [4, 4])
    assert [p["rank"] for p in s["per_process"]] == [0, 1]
    assert (two / "logs" / "torchrun.log").is_file()

    # same format: files, config, tensor names, dtypes and shapes
    assert sorted(p.name for p in (one / "export").iterdir()) == \
        sorted(p.name for p in (two / "export").iterdir())
    qc = [json.loads((r / "export" / "config.json").read_text())["quantization_config"]
          for r in (one, two)]
    assert qc[0] == qc[1] and qc[1]["config_groups"]["group_0"]["format"] == "pack-quantized"
    a, b = _tensors(one / "export"), _tensors(two / "export")
    assert {k: (v.dtype, v.shape) for k, v in a.items()} == \
        {k: (v.dtype, v.shape) for k, v in b.items()}

    # same numbers up to floating-point summation order: the Hessians are summed per process
    # and then reduced. (Here they are bit-identical; without the barrier _llmc_compat adds,
    # 4-9 % of layer 1's 4-bit values differed: a rank ran layer 1 before the other had
    # written its share of layer 0.)
    packed = [k for k in a if k.endswith("weight_packed")]
    assert packed
    for k in packed:
        nibbles_a = _nibbles(a[k])
        agree = float((nibbles_a == _nibbles(b[k])).float().mean())
        assert agree >= 0.99, (k, agree)
    for k in (k for k in a if k.endswith("weight_scale")):
        assert float((a[k].float() - b[k].float()).abs().max()) <= 1e-3 * float(
            a[k].float().abs().max()), k

    # quality: the exports load and lose the same to the source model
    kl_one, kl_two = _kl_to_source(tiny_model, one / "export"), \
        _kl_to_source(tiny_model, two / "export")
    assert kl_one > 0 and abs(kl_two - kl_one) <= 0.02 * kl_one, (kl_one, kl_two)


def _nibbles(packed: Any) -> Any:
    """The 4-bit values inside compressed-tensors' int32 words (8 per word)."""
    import torch

    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return (packed.unsqueeze(-1) >> shifts) & 0xF


def test_disk_offload_gives_the_same_export(tiny_model: Path, tmp_path: Path) -> None:
    """Host RAM short: compressed-tensors keeps part of the weights in RAM (a tiny budget
    here) and the rest in an offload folder; the export must not change, and the folder
    (a copy of the weights) must be gone afterwards."""
    from transformers import AutoTokenizer

    from quantize.recipe.texts import BUILTIN_TEXT

    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = tok(BUILTIN_TEXT["wiki"].read_text(encoding="utf-8"))["input_ids"]
    samples = [ids[i * 128:(i + 1) * 128] for i in range(4)]
    outs = quantize_both_tiers(tiny_model, samples, 3_000_000, tmp_path)
    ram, disk = _tensors(outs["ram"]), _tensors(outs["disk"])
    assert {k: (v.dtype, v.shape) for k, v in ram.items()} == \
        {k: (v.dtype, v.shape) for k, v in disk.items()}
    assert all(bool((ram[k] == disk[k]).all()) for k in ram)


@pytest.mark.slow
def test_a_failing_rank_is_named(tiny_model: Path, tmp_path: Path) -> None:
    from quantize.backends import QuantizeJob
    from quantize.backends.llmcompressor import BACKEND
    from quantize.errors import QuantizationError
    from quantize.recipe.recipe import load_recipe

    out = tmp_path / "run" / "quantize"
    out.mkdir(parents=True)
    job = QuantizeJob(tmp_path / "no-such-model", load_recipe("gptq-int4"), 64, [[1, 2]] * 2,
                      "cpu", world_size=2)
    with pytest.raises(QuantizationError) as err:
        BACKEND.quantize(job, out)
    assert err.value.problem is not None and re.match(
        r"distributed quantization failed on rank \d: .*no-such-model.*torchrun\.log",
        err.value.problem)
