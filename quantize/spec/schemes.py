"""The scheme table: every quantization scheme this project makes, described once.

Recipe validation, pre-flight, the planner, verify's support check and the model card all
read this table; adding a scheme is one `Scheme` entry (plus its tests). A scheme's `kernel`
names the vLLM kernel family that runs it; `KERNELS` says, once, where each family runs
(GPU compute capability, CPU ops and ISA, dense and MoE layers), each rule citing the vLLM
0.32 file it was read from (paths under vllm/model_executor/ unless said otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Activations = Literal["none", "int8-dynamic", "fp8-dynamic", "fp8-static"]
# what a checkpoint's weights look like to vLLM's kernels
KernelFamily = Literal["int-weight-only", "int8-w8a8", "fp8-w8a8", "fp8-weight-only", "dense",
                       "other"]


@dataclass(frozen=True)
class Scheme:
    """One compressed-tensors preset (the name a recipe's `scheme:` takes)."""

    name: str
    weight_bits: int
    weight_type: Literal["int", "float"]
    symmetric: bool
    group: bool  # quantized in groups along the input dimension (group_size applies)
    activations: Activations
    tag: str  # the repo-name tag users know from published checkpoints (card, repo name)
    per_tensor: bool = False  # one weight scale per tensor (static FP8)

    @property
    def kernel(self) -> KernelFamily:
        if self.weight_type == "float":
            return "fp8-weight-only" if self.activations == "none" else "fp8-w8a8"
        if self.activations == "none":
            return "int-weight-only"
        return "int8-w8a8"

    @property
    def packed(self) -> bool:
        """Written pack-quantized (int32 words holding several codes): every grouped integer
        weight-only scheme, 8-bit too."""
        return self.weight_type == "int" and self.group

    def describe(self, group_size: int | None) -> str:
        kind = "integer" if self.weight_type == "int" else "float"
        where = f"groups of {group_size}" if group_size else (
            "per tensor" if self.per_tensor else "per output channel")
        sym = "symmetric" if self.symmetric else "asymmetric"
        act = {"none": "16-bit activations",
               "int8-dynamic": "8-bit integer activations (dynamic, per token)",
               "fp8-dynamic": "8-bit float activations (dynamic, per token)",
               "fp8-static": "8-bit float activations (static, calibrated scales)"}
        return f"{self.weight_bits}-bit {kind} weights ({sym}, {where}), {act[self.activations]}"


def _int_wo(name: str, bits: int, *, symmetric: bool = True, tag: str | None = None) -> Scheme:
    return Scheme(name, bits, "int", symmetric, True, "none", tag or name)


SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    _int_wo("W4A16", 4),
    _int_wo("W4A16_ASYM", 4, symmetric=False, tag="W4A16-asym"),
    _int_wo("W3A16", 3),
    _int_wo("W2A16", 2),
    _int_wo("W8A16", 8),
    Scheme("W8A8", 8, "int", True, False, "int8-dynamic", "W8A8"),
    Scheme("FP8_DYNAMIC", 8, "float", True, False, "fp8-dynamic", "FP8-dynamic"),
    Scheme("FP8", 8, "float", True, False, "fp8-static", "FP8", per_tensor=True),
)}
SchemeName = Literal["W4A16", "W4A16_ASYM", "W3A16", "W2A16", "W8A16", "W8A8", "FP8_DYNAMIC",
                     "FP8"]


# --- where vLLM runs each kernel family ---------------------------------------------------
@dataclass(frozen=True)
class KernelRule:
    """What vLLM 0.32 needs to run one kernel family."""

    gpu_min_cc: int  # compute capability x10 (75 = sm_75)
    gpu_bits: tuple[int, ...] | None  # weight bits the built-in CUDA kernels take (None: any)
    gpu_source: str
    cpu_bits: tuple[int, ...] | None  # weight bits the CPU kernel takes
    cpu_op: str | None  # the custom op the CPU build must register
    cpu_amx: bool  # needs AMX on CPU
    cpu_source: str
    moe_cpu: bool  # vLLM's CPU build has a fused-MoE backend for it (on some CPUs: below)
    moe_source: str
    gpu_native_cc: int | None = None  # natively (else through a weight-only fallback)
    label: str = ""  # how messages name the family
    # the dtype its CPU kernel must compute in, where it cannot take the others: the INT8
    # GEMM (oneDNN, csrc/cpu) aborts at float16 ("scale_C: scalar path not implemented!")
    cpu_dtype: str | None = None
    # MoE layers on CPU (the fused-MoE experts classes of layers/fused_moe/experts/cpu_moe.py
    # and zentorch_moe.py, chosen by layers/fused_moe/oracle/*.py): the ISA flag the x86
    # kernel needs (every x86 one: `torch.cpu._is_amx_tile_supported()`), the custom op of an
    # alternative (AMD zentorch), the weight bits, symmetric only, the weight strategy, and
    # the routing and activation the kernels take (Default/Renormalize softmax top-k, SiLU:
    # not DeepSeek-V3's grouped top-k, not gpt-oss's clamped SwiGLU)
    moe_cpu_isa: str | None = None
    moe_cpu_alt_op: str | None = None
    moe_cpu_bits: tuple[int, ...] | None = None
    moe_cpu_symmetric: bool = True
    moe_cpu_strategy: str | None = None  # "block": block-scaled weights only
    moe_cpu_routing: tuple[str, ...] = ("softmax-topk",)
    moe_cpu_silu_only: bool = True


KERNELS: dict[str, KernelRule] = {
    # layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16.py
    # (get_min_capability 75); kernels/linear/mixed_precision/ (Marlin, Machete, Exllama: 4
    # and 8 bits); CPU: kernels/linear/mixed_precision/cpu.py CPUWNA16LinearKernel (4-bit,
    # op cpu_gemm_wna16, absent from the AVX2 build). MoE on CPU: symmetric only (below).
    "int-weight-only": KernelRule(
        75, (4, 8), "compressed_tensors_wNa16.py + kernels/linear/mixed_precision/",
        (4,), "cpu_gemm_wna16", False, "kernels/linear/mixed_precision/cpu.py",
        True, "layers/fused_moe/oracle/int_wna16.py (CPU: CPUExpertsInt4 in "
        "experts/cpu_moe.py, x86 + AMX, kInt4Static = symmetric 4-bit groups; or "
        "ZentorchExpertsInt4 in experts/zentorch_moe.py, no zero points); else 'No WNA16 MoE "
        "backend supports the deployment configuration'",
        label="INT weight-only", moe_cpu_isa="amx_tile", moe_cpu_alt_op="zentorch_fused_moe",
        moe_cpu_bits=(4,)),
    # compressed_tensors_w8a8_int8.py (min capability 75); CPU via oneDNN
    "int8-w8a8": KernelRule(
        75, None, "compressed_tensors_w8a8_int8.py", None, "onednn_scaled_mm", False,
        "kernels/linear/scaled_mm/cpu.py", True,
        "layers/fused_moe/oracle/int8.py (CPU: CPUExpertsInt8 in experts/cpu_moe.py, x86 + "
        "AMX, per-channel symmetric INT8 weights, dynamic per-token INT8 activations, hidden "
        "and expert intermediate sizes divisible by 32); else 'No Int8 MoE backend supports "
        "the deployment configuration'",
        label="INT8 W8A8", cpu_dtype="bfloat16", moe_cpu_isa="amx_tile", moe_cpu_bits=(8,)),
    # compressed_tensors_w8a8_fp8.py: 89 natively, 80 through FP8 Marlin (weight-only)
    "fp8-w8a8": KernelRule(
        80, None, "compressed_tensors_w8a8_fp8.py", None, None, False,
        "kernels/linear/scaled_mm/cpu.py", True,
        "layers/fused_moe/oracle/fp8.py (CPU: CPUExpertsFp8 in experts/cpu_moe.py, x86 + "
        "AMX, block-128 FP8 weights only; CPUExpertsFp8W8A8 needs AMX-FP8); per-channel FP8 "
        "has none: 'Unsupported FP8 MoE backend'", gpu_native_cc=89,
        label="FP8 W8A8", moe_cpu_isa="amx_tile", moe_cpu_bits=(8,), moe_cpu_strategy="block"),
    "fp8-weight-only": KernelRule(
        80, None, "compressed_tensors_w8a8_fp8.py", None, None, True,
        "kernels/linear/scaled_mm/cpu.py (AMX)", True,
        "layers/fused_moe/oracle/fp8.py (CPU: CPUExpertsFp8, x86 + AMX, block-128 only)",
        label="FP8 weight-only", moe_cpu_isa="amx_tile", moe_cpu_bits=(8,),
        moe_cpu_strategy="block"),
    # unquantized experts: CPUUnquantizedExperts (experts/cpu_moe.py) on every CPU
    "dense": KernelRule(0, None, "", None, None, False, "", True,
                        "layers/fused_moe/experts/cpu_moe.py CPUUnquantizedExperts",
                        moe_cpu_routing=("softmax-topk", "grouped-topk", "other"),
                        moe_cpu_silu_only=False),
}


def gpu_problem(family: str, bits: int | None, cc: int) -> str | None:
    """Why vLLM cannot run this kernel family on a GPU of capability `cc` (x10), or None."""
    rule = KERNELS.get(family)
    if rule is None:
        return f"format {family} is not known to run in vLLM"
    if rule.gpu_bits and bits not in rule.gpu_bits:
        return (f"{bits}-bit weights have no built-in vLLM CUDA kernel (Marlin/Machete/Exllama "
                "take 4 and 8 bits)")
    if cc < rule.gpu_min_cc:
        what = "FP8 needs" if family.startswith("fp8") else "needs"
        return f"{what} compute capability >= {rule.gpu_min_cc / 10:.1f} (GPU is sm_{cc})"
    return None


def gpu_fallback(family: str, cc: int) -> bool:
    """Whether a GPU of capability `cc` runs the family only through a weight-only fallback
    (FP8 without FP8 tensor cores: FP8 Marlin, W8A16)."""
    rule = KERNELS.get(family)
    return bool(rule and rule.gpu_native_cc and rule.gpu_min_cc <= cc < rule.gpu_native_cc)


def moe_cpu_problem(family: str, bits: int | None, symmetric: bool, strategy: str | None,
                    routing: str, silu: bool, isa: dict[str, bool], ops: dict[str, bool]
                    ) -> str | None:
    """Why vLLM's CPU build has no fused-MoE kernel for experts of this kernel family on a
    CPU with these ISA flags and custom ops (quantize.vllm.host), or None. `routing`:
    softmax-topk (Mixtral, Qwen-MoE) or grouped-topk (DeepSeek-V3); `silu`: the experts'
    activation is SiLU (not gpt-oss's clamped SwiGLU). The reason ends with the vLLM file."""
    rule = KERNELS.get(family)
    if rule is None:
        return f"format {family} is not known to run in vLLM"
    where = f"vLLM {rule.moe_source}"
    if not rule.moe_cpu:
        return f"no CPU fused-MoE kernel for {rule.label or family} ({where})"
    if rule.moe_cpu_bits and bits not in rule.moe_cpu_bits:
        took = "/".join(map(str, rule.moe_cpu_bits))
        return f"CPU fused-MoE kernels take {took}-bit {rule.label} experts only ({where})"
    if rule.moe_cpu_bits and not symmetric and rule.moe_cpu_symmetric:
        return f"CPU fused-MoE kernels take symmetric {rule.label} experts only, this export " \
               f"has zero points (asymmetric) ({where})"
    if rule.moe_cpu_strategy and strategy != rule.moe_cpu_strategy:
        return f"CPU fused-MoE kernels take {rule.moe_cpu_strategy}-scaled {rule.label} " \
               f"experts only, this export is {strategy}-scaled ({where})"
    if routing not in rule.moe_cpu_routing:
        return f"CPU fused-MoE kernels for {rule.label} take softmax top-k routing, not " \
               f"{routing} ({where})"
    if rule.moe_cpu_silu_only and not silu:
        return f"CPU fused-MoE kernels for {rule.label} take SiLU experts only ({where})"
    if rule.moe_cpu_isa and not isa.get(rule.moe_cpu_isa) and not (
            rule.moe_cpu_alt_op and ops.get(rule.moe_cpu_alt_op)):
        alt = f" or the {rule.moe_cpu_alt_op} op (AMD zentorch)" if rule.moe_cpu_alt_op else ""
        return f"CPU fused-MoE kernels for {rule.label} need AMX{alt}, this CPU has neither " \
               f"({where})"
    return None
