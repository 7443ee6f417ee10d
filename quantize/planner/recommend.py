"""What a plan row is and which row `quantize plan` recommends: whether a recipe's kernels run
on the GPU, whether the model shards over the GPUs, and the accuracy to expect when no gate
has measured it."""

from __future__ import annotations

from dataclasses import dataclass, field

from quantize.model.config import Shape
from quantize.planner.gpus import Gpu
from quantize.planner.memory import Memory
from quantize.spec.methods import METHODS
from quantize.spec.recipe import Recipe
from quantize.spec.schemes import KERNELS, SCHEMES, gpu_fallback, gpu_problem

MIN_ACCURACY = 0.9  # never recommend a recipe expected (or measured) below 90% recovery


# Expected accuracy when no gate result exists: a documented ordering, not a measurement.
# FP8 W8A8 is near-lossless, INT8 W8A8 close behind, 4-bit GPTQ/AWQ a little lower and RTN
# lower still (Kurtic et al., "Give Me BF16 or Give Me Death?", arXiv:2411.02355).
def prior_recovery(recipe: Recipe | None) -> float:
    if recipe is None:
        return 1.0
    info = SCHEMES[recipe.scheme]
    if info.weight_bits >= 8:
        base = 0.995 if info.weight_type == "float" or info.activations == "none" else 0.99
    else:
        calibrated = METHODS[recipe.method].calibrated
        base = {4: 0.975 if calibrated else 0.95, 3: 0.92 if calibrated else 0.85}.get(
            info.weight_bits, 0.5)
    return round(base - (0.003 if recipe.kv_cache == "fp8" else 0.0), 4)


def gpu_support(recipe: Recipe | None, gpu: Gpu, experts: bool) -> tuple[bool, str]:
    """(runs at all, note) for this recipe's kernels on this card. The capability rules are
    the scheme table's (quantize.spec.schemes.KERNELS); the notes are the planner's."""
    if recipe is None:
        return True, ""
    scheme = SCHEMES[recipe.scheme]
    family = scheme.kernel
    major, minor = gpu.capability
    cc = major * 10 + minor
    rule = KERNELS[family]
    problem = gpu_problem(family, scheme.weight_bits, cc)
    # The table's capability rule refuses the card here. Its weight-bits rule (no CUDA kernel
    # for 2/3-bit codes) is not applied on a capable card: `quantize plan` has always listed
    # W2A16/W3A16 rows as servable, and refusing them is a change users would see, so it is
    # left to a decision of its own rather than made in a refactor.
    if problem and cc < rule.gpu_min_cc:
        return False, problem
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


def tp_problem(shape: Shape, tp: int, fmt_group: int | None) -> str | None:
    """Why vLLM cannot shard this model `tp` ways, or None. The attention-head rule is
    pre-flight's (MLA caches one latent, so only its query heads split); the group-size rule
    is the planner's, on the row-parallel input widths (pre-flight checks it per layer)."""
    from quantize.checks.preflight import heads_problem

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

    @property
    def fits(self) -> bool:
        return self.status == "fits"


def recommendable(row: Row) -> bool:
    return row.gate_verdict != "fail" and row.accuracy >= MIN_ACCURACY


def recommend(rows: list[Row]) -> tuple[Row | None, str]:
    """The most accurate recipe that serves every sequence (ties: more room). When none does,
    the one that serves the most sequences (ties: more accurate): "partial"."""
    ok = [r for r in rows if r.status == "fits" and recommendable(r)]
    if ok:
        return max(ok, key=lambda r: (r.accuracy, r.memory.max_concurrency if r.memory else 0)), \
            "fits"
    part = [r for r in rows if r.status == "partial" and recommendable(r) and r.memory]
    if part:
        return max(part, key=lambda r: (r.memory.max_sequences, r.accuracy,
                                        r.memory.max_concurrency) if r.memory else (0, 0, 0)), \
            "partial"
    return None, "none"
