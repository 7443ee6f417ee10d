"""GPTQModel: GPTQ and AWQ written in their native checkpoint formats (`quant_method: gptq`,
`quant_method: awq` GEMM), which vLLM loads with Marlin on a GPU and CPUWNA16 on a CPU, and
transformers loads through GPTQModel's kernels (with optimum for GPTQ).

Installed by the optional extra `.[gptqmodel]`; nothing of it is imported until a recipe with
`backend: gptqmodel` runs."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path
from typing import Any, TypedDict

from quantize.backends import QuantizeJob
from quantize.backends._native import (
    check_job,
    cpu_workers,
    engine_run,
    finish,
    keep_user_hf_cache,
    quiet_imports,
    source_dtype,
)
from quantize.errors import NotImplementedFeature
from quantize.model.config import ModelConfig
from quantize.recipe.options import GPTQOptions
from quantize.recipe.recipe import Recipe
from quantize.recipe.schemes import SCHEMES

# Fail at get_backend() (with "install with pip install -e .[gptqmodel]"), not mid-run.
for _mod in ("gptqmodel", "optimum"):
    if importlib.util.find_spec(_mod) is None:
        raise ModuleNotFoundError(f"No module named {_mod!r}", name=_mod)
keep_user_hf_cache()  # before anything imports gptqmodel

# llm-compressor's activation orderings -> GPTQModel's (desc_act, act_group_aware). `static`
# (and its alias `weight`) keeps groups contiguous without g_idx: GPTQModel's group-aware
# reordering (GAR) is its counterpart. `group` is desc_act, stored with g_idx.
_ACTORDER = {"static": (False, True), "weight": (False, True), "group": (True, False),
             None: (False, False)}


class _Common(TypedDict):
    """What GPTQModel's GPTQConfig and AWQConfig both take from the recipe."""

    bits: int
    group_size: int
    sym: bool
    offload_to_disk: bool


def quant_config(recipe: Recipe, group_size: int | None) -> Any:
    """GPTQModel's config for the recipe (the recipe validator allowed only what it does)."""
    from gptqmodel.quantization import AWQConfig, GPTQConfig

    info = SCHEMES[recipe.scheme]
    # offload_to_disk would record a temporary folder in config.json; the model is in
    # memory anyway, as it is with llm-compressor, so the memory comparison stays fair.
    common = _Common(bits=info.weight_bits, group_size=group_size or -1, sym=info.symmetric,
                     offload_to_disk=False)
    if recipe.method == "gptq":
        opts = recipe.gptq or GPTQOptions()
        desc_act, gar = _ACTORDER[opts.actorder]
        return GPTQConfig(**common, damp_percent=opts.dampening_frac, desc_act=desc_act,
                          act_group_aware=gar)
    return AWQConfig(**common)


def calibration_dtype(recipe: Recipe, device: str, src: Any) -> Any:
    """fp32 on CPU as with llm-compressor (16-bit CPU matmuls are slow and lossy), except
    AWQ: GPTQModel's AWQ packer (AwqTorchLinear) takes only fp16/bf16, so AWQ calibrates in
    bf16, GPTQModel's own CPU default. On a GPU, the checkpoint's 16-bit dtype."""
    import torch

    if device != "cpu":
        return src
    return torch.bfloat16 if recipe.method == "awq" else torch.float32


def _kernel(recipe: Recipe, device: str) -> Any:
    """The packing kernel: on CPU the portable torch ones (the default AWQ GEMM packer is
    CUDA-only); on a GPU GPTQModel's own choice."""
    from gptqmodel import BACKEND

    if device != "cpu":
        return BACKEND.AUTO
    return BACKEND.AWQ_TORCH if recipe.method == "awq" else BACKEND.GPTQ_TORCH


def _log_dir(logs: Path) -> None:
    """GPTQModel writes per-processor logs under a relative ./logs/; keep them in the run."""
    from gptqmodel.looper import loop_processor

    if hasattr(loop_processor, "_PROJECT_LOG_DIR"):
        loop_processor._PROJECT_LOG_DIR = logs / "gptqmodel"


# What GPTQModel 7.6.0 fails on, found by bench/moe_matrix.py on the tiny random MoE
# fixtures (tests/fixtures/moe.py), after its calibration had run: (method,
# model_type) -> what it said. Refused before any calibration instead.
FAILS: dict[tuple[str, str], str] = {
    ("awq", "deepseek_v3"): "its AWQ scale search multiplies the MLA projections with "
    "mismatched shapes ('mat1 and mat2 shapes cannot be multiplied (128x64 and 128x64)')",
    ("awq", "gpt_oss"): "its AWQ stops on gpt-oss's fused experts ('cannot reshape tensor of "
    "0 elements into shape [-1, 0]')",
}


def check_model(config: ModelConfig, recipe: Recipe) -> None:
    """Refuse before calibration what GPTQModel 7.6.0 is known to fail on (FAILS)."""
    why = FAILS.get((recipe.method, config.model_type or ""))
    if why:
        version = importlib.metadata.version("gptqmodel")
        raise NotImplementedFeature(
            problem=f"backend gptqmodel {version} cannot run {recipe.method.upper()} on "
                    f"model_type {config.model_type!r}: {why}",
            hint="use backend: llmcompressor (recipe awq-int4), which exports this model")


class GPTQModelBackend:
    name = "gptqmodel"

    def check_model(self, config: ModelConfig, recipe: Recipe) -> None:
        check_model(config, recipe)

    def quantize(self, job: QuantizeJob, out: Path) -> dict[str, Any]:
        check_job(job, self.name)
        cpu_workers()
        quiet_imports()
        logs = out.parent / "logs"
        src = source_dtype(job.model_path)
        dtype = calibration_dtype(job.recipe, job.device, src)
        log = logs / "gptqmodel.log"
        with engine_run("gptqmodel", log):
            from gptqmodel import GPTQModel

            _log_dir(logs)
            model = GPTQModel.load(str(job.model_path),
                                   quant_config(job.recipe, job.group_size),
                                   device=job.device, dtype=dtype,
                                   trust_remote_code=job.recipe.trust_remote_code)
            rows = [{"input_ids": s, "attention_mask": [1] * len(s)} for s in job.samples]
            # calibration_sort=None keeps the calibration stage's order
            model.quantize(rows, batch_size=job.batch_size, calibration_sort=None,
                           backend=_kernel(job.recipe, job.device))
            model.model.to(src)  # scales and unquantized tensors in the source's dtype
            model.save(str(out))
        qc = finish(out, job.model_path, logs, src)
        return {"engine": "gptqmodel", "engine_version": importlib.metadata.version("gptqmodel"),
                "batch_size": job.batch_size, "quant_method": qc.quant_method,
                "format": qc.format, "calibration_dtype": str(dtype).split(".")[-1],
                "export_dtype": str(src).split(".")[-1]}


BACKEND = GPTQModelBackend()
