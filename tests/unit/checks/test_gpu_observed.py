"""Rules learnt from vLLM 0.26's CUDA build on an H200 (bench/results/2026-12-04-vllm-gpu.json):
an export vLLM refused there is refused before calibration when the GPU is named."""

from __future__ import annotations

import pytest

from quantize.checks import preflight
from quantize.checks.formats import GpuTarget
from quantize.errors import PreflightError
from quantize.model.config import ModelConfig
from quantize.planner import plan as P
from quantize.planner.gpus import find
from quantize.planner.rows import PlanRequest
from quantize.recipe.recipe import load_recipe

SMOL = ModelConfig.model_validate({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 2, "num_attention_heads": 9,
    "num_key_value_heads": 3, "vocab_size": 1000, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16"})


@pytest.mark.parametrize("gpu", [("h200", 90), ("a100-80gb", 80), ("rtx5090", 120)])
def test_two_bit_weights_are_refused_on_any_cuda_gpu(gpu: tuple[str, int]) -> None:
    with pytest.raises(PreflightError) as err:
        preflight.check(load_recipe("rtn-int2"), SMOL, gpu=GpuTarget(*gpu))
    assert err.value.problem is not None and "2-bit integer weights" in err.value.problem
    assert "Failed to find a kernel" in err.value.problem  # vLLM's own words
    assert err.value.hint is not None and err.value.hint.startswith("formats native on")
    # 4 and 8 bits pass
    preflight.check(load_recipe("rtn-int4"), SMOL, gpu=GpuTarget(*gpu))
    preflight.check(load_recipe("w8a16-int8"), SMOL, gpu=GpuTarget(*gpu))


def test_the_planner_marks_two_bit_rows_unsupported() -> None:
    plan = P.make_plan(PlanRequest(model="meta-llama/Llama-3.1-8B-Instruct", gpu=find("h200"),
                                   context=8192, concurrency=4,
                                   recipes=["rtn-int2,rtn-int4"]))
    rows = {r.recipe: r for r in plan.rows}
    assert rows["rtn-int2"].status == "unsupported"
    assert "no vLLM CUDA kernel" in rows["rtn-int2"].reason
    assert rows["rtn-int4"].status == "fits"
