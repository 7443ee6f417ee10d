"""What a plan row is and which row `quantize plan` recommends: whether a recipe's kernels run
on the GPU, whether the model shards over the GPUs, and the accuracy to expect when no gate
has measured it."""

from __future__ import annotations

from dataclasses import dataclass, field

from quantize.model.config import Shape
from quantize.planner.gpus import Gpu
from quantize.planner.memory import Memory
from quantize.recipe.methods import METHODS
from quantize.recipe.recipe import Recipe
from quantize.recipe.schemes import (
    KERNELS,
    SCHEMES,
    gpu_fallback,
    gpu_problem,
    gpu_support_level,
    rotation_problem,
)

MIN_ACCURACY = 0.9  # never recommend a recipe expected (or measured) below 90% recovery
# At equal fit, a format that computes natively in low precision on the GPU (FP4/FP8/INT8
# tensor cores: activations quantized too) is preferred over a more accurate one when it is
# within this many points of recovery of it (1 point).
NATIVE_BAND = 0.01

# FP4 priors (documented ordering, not measurements): NVFP4's FP8 scales per 16 weights are
# finer than INT4's 16-bit scales per 64-128 (NVIDIA reports <= 1% loss for NVFP4 W4A4 on
# DeepSeek-R1; "Introducing NVFP4", NVIDIA technical blog, 2025); MXFP4's power-of-two scales
# per 32 lose more, with FP4 activations most (Egiazarian et al., "Bridging the Gap Between
# Promise and Performance for Microscaling FP4 Quantization", arXiv:2509.23202).
FP4_PRIORS = {"NVFP4": 0.97, "NVFP4A16": 0.975, "MXFP4A16": 0.96, "MXFP4": 0.94}


# Expected accuracy when no gate result exists: a documented ordering, not a measurement.
# FP8 W8A8 is near-lossless, INT8 W8A8 close behind, 4-bit GPTQ/AWQ a little lower and RTN
# lower still (Kurtic et al., "Give Me BF16 or Give Me Death?", arXiv:2411.02355).
def prior_recovery(recipe: Recipe | None) -> float:
    if recipe is None:
        return 1.0
    info = SCHEMES[recipe.scheme]
    if recipe.scheme in FP4_PRIORS:
        base = FP4_PRIORS[recipe.scheme]
    elif info.weight_bits >= 8:
        base = 0.995 if info.weight_type == "float" or info.activations == "none" else 0.99
    else:
        calibrated = METHODS[recipe.method].calibrated
        base = {4: 0.975 if calibrated else 0.95, 3: 0.92 if calibrated else 0.85}.get(
            info.weight_bits, 0.5)
    return round(base - (0.003 if recipe.kv_cache == "fp8" else 0.0), 4)


def gpu_support(recipe: Recipe | None, gpu: Gpu, experts: bool) -> tuple[bool, str]:
    """(runs at all, note) for this recipe's kernels on this card. The capability rules are
    the scheme table's (quantize.recipe.schemes.KERNELS); the notes are the planner's."""
    if recipe is None:
        return True, ""
    scheme = SCHEMES[recipe.scheme]
    family = scheme.kernel
    major, minor = gpu.capability
    cc = major * 10 + minor
    rule = KERNELS[family]
    problem = gpu_problem(family, scheme.weight_bits, cc) or \
        (rotation_problem(cc) if recipe.rotation is not None else None)
    # the capability rule, and the weight-bits rule: no CUDA kernel for 2/3-bit codes (vLLM
    # 0.26 refused a W2A16 export on an H200, bench/results/2026-12-04-vllm-gpu.json)
    if problem:
        return False, problem
    if family in ("nvfp4", "nvfp4-weight-only", "mxfp4", "mxfp4-weight-only"):
        if gpu_support_level(family, cc, moe=experts) == "fallback":
            return True, (f"not native on {gpu.name} (sm_{cc}; native from "
                          f"sm_{rule.gpu_native_cc}): vLLM runs it through {rule.fallback}")
        return True, ""
    if family.startswith("fp8"):
        if not gpu_fallback(family, cc):
            return True, ""
        if experts:
            return False, ("FP8 MoE needs FP8 hardware (capability >= "
                           f"{(rule.gpu_native_cc or 0) / 10:.1f}) in the vLLM releases this was "
                           f"checked against; verify before using {gpu.name}")
        return True, ("no FP8 hardware: vLLM runs it weight-only (W8A16, FP8 Marlin): same "
                      "memory, no FP8 activation speed-up")
    if family == "int8-w8a8":
        if gpu.int8 is None:
            return True, f"INT8 W8A8 kernels on {gpu.name} are unverified; check vLLM's support"
        return (True, "") if gpu.int8 else (False, f"no INT8 W8A8 kernels on {gpu.name}")
    if cc < 80:
        return True, "no Marlin kernels below capability 8.0: slower fallback kernels"
    note = ""
    if recipe.kv_cache == "fp8" and not gpu.fp8:
        note = "FP8 KV cache without FP8 hardware depends on the attention backend"
    return True, note


def support_level(recipe: Recipe | None, gpu: Gpu, experts: bool) -> str:
    """native | fallback | unsupported: how vLLM runs the recipe's format on this card (the
    scheme table's rule; the baseline is native)."""
    if recipe is None:
        return "native"
    ok, _ = gpu_support(recipe, gpu, experts)
    if not ok:
        return "unsupported"
    major, minor = gpu.capability
    return gpu_support_level(SCHEMES[recipe.scheme].kernel, major * 10 + minor, moe=experts)


def tp_problem(shape: Shape, tp: int, fmt_group: int | None) -> str | None:
    """Why vLLM cannot shard this model `tp` ways, or None. The attention-head rule is
    pre-flight's (MLA caches one latent, so only its query heads split); the group-size rule
    is the planner's, on the row-parallel input widths (pre-flight checks it per layer)."""
    from quantize.vllm.layers import heads_problem

    kv_heads = shape.heads if shape.mla_latent else shape.kv_heads
    problem = heads_problem(shape.heads, kv_heads, tp)
    if problem:
        return problem
    if fmt_group:
        row_inputs = [shape.intermediate, shape.heads * shape.head_dim, shape.moe_intermediate]
        for width in row_inputs:
            if width and (width % tp or (width // tp) % fmt_group):
                return (f"group size {fmt_group} does not divide the per-GPU input "
                        f"({width}/{tp}) of the row-parallel layers")
    return None


@dataclass
class Row:
    """One recipe (or the baseline) planned on the requested GPUs."""

    recipe: str
    scheme: str
    kv_dtype: str
    weights_total: int
    weights_source: str
    accuracy: float
    accuracy_source: str
    status: str  # "fits" | "partial" | "no-kv" | "no-fit" | "unsupported" | "n/a"
    reason: str
    memory: Memory | None
    min_tp: int | None
    min_tp_sequences: int | None
    gpu_note: str
    gate_verdict: str | None
    serve: str | None
    kv_bytes_per_token_by_dtype: dict[str, int] = field(default_factory=dict)
    support: str = "native"  # native | fallback | unsupported on the chosen GPU
    native_compute: bool = False  # native, and its activations are quantized too

    @property
    def fits(self) -> bool:
        return self.status == "fits"


def recommendable(row: Row) -> bool:
    return row.gate_verdict != "fail" and row.accuracy >= MIN_ACCURACY


def _native_first(rows: list[Row]) -> dict[int, bool]:
    """Which rows a native low-precision format wins for at equal fit: native compute, within
    NATIVE_BAND of the most accurate row of the same fit."""
    best = max((r.accuracy for r in rows), default=0.0)
    return {id(r): r.native_compute and r.accuracy >= best - NATIVE_BAND for r in rows}


def recommend(rows: list[Row]) -> tuple[Row | None, str]:
    """The most accurate recipe that serves every sequence (ties: more room). When none does,
    the one that serves the most sequences (ties: more accurate): "partial". At equal fit a
    format the GPU computes natively in low precision (NVFP4 on Blackwell, FP8 from sm_89)
    comes first when within NATIVE_BAND of the most accurate."""
    ok = [r for r in rows if r.status == "fits" and recommendable(r)]
    if ok:
        first = _native_first(ok)
        return max(ok, key=lambda r: (first[id(r)], r.accuracy,
                                      r.memory.max_concurrency if r.memory else 0)), "fits"
    part = [r for r in rows if r.status == "partial" and recommendable(r) and r.memory]
    if part:
        most = max(r.memory.max_sequences for r in part if r.memory)
        same = [r for r in part if r.memory and r.memory.max_sequences == most]
        first = _native_first(same)
        return max(same, key=lambda r: (first[id(r)], r.accuracy,
                                        r.memory.max_concurrency if r.memory else 0)), \
            "partial"
    return None, "none"
