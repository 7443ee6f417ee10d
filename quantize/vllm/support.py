"""Which quantized checkpoints this host's vLLM can load, at which dtype, and why not.

A checkpoint's format is its `QuantConfig` (quantize.model.qconfig): each config group's
kernel family (`Group.kernel`). Where vLLM 0.32 runs each family on a GPU, and which op, ISA
and weight bits its CPU kernel needs, is the `KERNELS` table in quantize.recipe.schemes (each
rule citing the vLLM file it restates); this module applies that table to the host a probe
found (quantize.vllm.host) and adds the rules the table does not hold, each naming its file
under `vllm/model_executor/`:

- Native GPTQ / AWQ checkpoints (backend gptqmodel/autoawq): layers/quantization/
  auto_gptq.py takes symmetric 4/8-bit GPTQ only, auto_awq.py 4-bit AWQ only; both then run
  the same WNA16 kernels as compressed-tensors INT weight-only.
- FP8 W8A8 on CPU: static activation scales need the `static_scaled_fp8_quant` op (absent
  from the AVX2 build); block-scaled FP8 needs AMX (kernels/linear/scaled_mm/cpu.py).
- FP8 KV cache: CPU needs AVX-512 or AMX and head_size divisible by 32
  (v1/attention/backends/cpu_attn.py `_get_attn_isa`); GPU >= 80.
- dtype on CPU: the INT8 GEMM (oneDNN, csrc/cpu) aborts at float16 ("scale_C: scalar path not
  implemented!"). vLLM's `--dtype auto` serves a float16 checkpoint in float16 and a float32
  one in the platform's preferred 16-bit dtype (config/model.py `_resolve_auto_dtype`; float16
  on CPUs without bf16), so an INT8 W8A8 export that does not declare bfloat16 needs
  `--dtype bfloat16` (`serving_dtype`). INT weight-only (CPUWNA16) and FP8 dynamic
  (ChannelWiseTorchFP8ScaledMMLinearKernel) were measured to run at float16 (AVX-512 host).

Whatever these rules say, the load itself is the proof: a format they admit still fails the
verify stage if vLLM refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantize.errors import VerifyError
from quantize.model.config import ModelConfig, config_dtype, head_dim
from quantize.model.formats import Format
from quantize.model.qconfig import (
    NATIVE_METHODS,
    Group,
    QuantConfig,
    method_is,
    read_quant_config,
)
from quantize.recipe.schemes import KERNELS, gpu_problem, rotation_problem
from quantize.vllm.host import Host

# what the export stage writes
VERIFIED_METHODS = (Format.COMPRESSED_TENSORS.value, *NATIVE_METHODS)



# --- the checkpoint's format -----------------------------------------------------------
def group_label(group: Group, quant: QuantConfig) -> str:
    """A config group in a few words (the verify report's `format`)."""
    w, a, family = group.weights, group.activations, group.kernel
    if w is None:
        return "dense"
    strategy = w.strategy
    if family == "fp8-weight-only":
        return f"FP8 {strategy} weight-only"
    if family in ("fp8-w8a8", "int8-w8a8"):
        assert a is not None
        kind = "FP8" if family == "fp8-w8a8" else "INT8"
        how = "dynamic" if a.dynamic else "static"
        return f"{kind} {strategy} weights, {how} {kind} activations"
    if family == "int-weight-only":
        sym = "" if w.symmetric else " asymmetric"
        where = f"group {w.group_size}" if strategy == "group" else str(strategy)
        native = f"native {quant.method.upper()} " if quant.native else ""
        return f"{native}INT{w.num_bits}{sym} weight-only ({where})"
    if a is None:
        return f"{w.type}{w.num_bits} weight-only"
    return f"{w.type}{w.num_bits} weights + {a.type}{a.num_bits} activations"


@dataclass(frozen=True)
class CheckpointFormat:
    """What the support rules need of a checkpoint: its quantization, head size and dtype."""

    quant: QuantConfig | None  # None: an unquantized (dense) checkpoint
    head_dim: int | None
    dtype: str | None = None  # the dtype config.json declares

    @property
    def groups(self) -> tuple[Group, ...]:
        return self.quant.groups if self.quant else ()

    @property
    def kv_cache_fp8(self) -> bool:
        return bool(self.quant and self.quant.kv_cache_fp8)

    @property
    def label(self) -> str:
        parts = sorted({group_label(g, self.quant) for g in self.groups if self.quant})
        return " + ".join(parts or ["dense"]) + (" + fp8 KV cache" if self.kv_cache_fp8 else "")


def checkpoint_format(config: ModelConfig) -> CheckpointFormat:
    """A checkpoint's config.json as verify sees it; refuses quantization methods the export
    stage does not write."""
    quant = read_quant_config(config)
    if quant is not None and quant.method not in VERIFIED_METHODS:
        raise VerifyError(problem=method_is(quant.method),
                          hint="verify handles compressed-tensors and native gptq/awq "
                               "checkpoints (the export formats)")
    return CheckpointFormat(quant, head_dim(config), config_dtype(config))


# --- the verdict ------------------------------------------------------------------------
@dataclass(frozen=True)
class Support:
    ok: bool
    reason: str  # empty when ok


def _native_rule(quant: QuantConfig | None, group: Group) -> str | None:
    """What vLLM 0.32's native loaders refuse on any device: GPTQ other than symmetric 4/8-bit
    (layers/quantization/auto_gptq.py TYPE_MAP), AWQ other than 4-bit (auto_awq.py)."""
    w = group.weights
    if quant is None or not quant.native or w is None:
        return None
    if quant.method == "gptq" and (w.num_bits not in (4, 8) or not w.symmetric):
        return "vLLM loads native GPTQ only symmetric with 4 or 8 bits (auto_gptq.py)"
    if quant.method == "awq" and w.num_bits != 4:
        return "vLLM loads native AWQ only with 4 bits (auto_awq.py)"
    return None


def _cpu_group(group: Group, label: str, host: Host) -> str | None:
    """Why vLLM's CPU backend cannot run this group on this host, or None."""
    isa, ops, family, w, a = host.isa, host.ops, group.kernel, group.weights, group.activations
    rule = KERNELS.get(family)
    need_avx512 = "needs AVX-512 or a GPU"
    if family == "dense":
        return None
    if rule is None or w is None:
        return f"format {label} has no vLLM CPU kernel"
    if rule.cpu_none:  # the scheme table says vLLM's CPU build has no kernel at all
        return rule.cpu_none
    if rule.cpu_bits and w.num_bits not in rule.cpu_bits:
        gpu_bits = rule.gpu_bits or ()
        where = "needs a GPU" if w.num_bits in gpu_bits else \
            f"vLLM's built-in GPU kernels take only {' and '.join(map(str, gpu_bits))} bits too"
        took = " and ".join(map(str, rule.cpu_bits))
        return (f"vLLM's CPU kernel takes {took}-bit integer weights only (this is "
                f"{w.num_bits}-bit); {where}")
    if rule.cpu_op and not ops.get(rule.cpu_op):
        if family == "int-weight-only":  # absent from the AVX2 build
            return f"{need_avx512} (the CPU build lacks {rule.cpu_op})"
        return f"the CPU build lacks {rule.cpu_op}"
    if family == "fp8-w8a8":
        if w.strategy == "block":
            return None if isa.get("amx_tile") else "block FP8 needs AMX or a GPU"
        if (slow := fp8_gemm_emulated(host)) is not None:
            return slow
        if a is not None and not a.dynamic and not ops.get("static_scaled_fp8_quant"):
            return f"static FP8 activations {need_avx512} (no static_scaled_fp8_quant)"
    if rule.cpu_amx and not isa.get("amx_tile"):
        return f"{rule.label or family} needs AMX or a GPU"
    return None


# vLLM's CPU FP8 W8A8 kernel (ChannelWiseTorchFP8ScaledMMLinearKernel) calls
# torch._scaled_mm; on some CPUs torch runs it emulated: on an AMX host with torch 2.13 one
# 512x576x1536 product took 18 s against 38 ms in bf16, so scoring the default model's
# fp8-dynamic export did not end in 15 minutes. Beyond this ratio it is not a kernel to wait for.
FP8_EMULATED_RATIO = 20.0


def fp8_gemm_emulated(host: Host) -> str | None:
    """Why this CPU's FP8 GEMM is too slow to verify or score with, or None (fast, or not
    measured: then the load itself decides)."""
    ms = host.fp8_gemm_ms
    fp8, bf16 = ms.get("fp8"), ms.get("bf16")
    if not fp8 or not bf16 or fp8 / bf16 < FP8_EMULATED_RATIO:
        return None
    return (f"this CPU runs vLLM's FP8 GEMM (torch._scaled_mm) emulated: {fp8:.0f} ms for a "
            f"128x512x512 product against {bf16:.2f} ms in bf16 ({fp8 / bf16:.0f}x; "
            "model_executor/kernels/linear/scaled_mm/pytorch.py)")


def _gpu_group(group: Group, label: str, cap: int) -> str | None:
    if group.kernel not in KERNELS:
        return f"format {label} is not known to run in vLLM"
    return gpu_problem(group.kernel, group.weights.num_bits if group.weights else None, cap)


def supported(ckpt: CheckpointFormat, host: Host, kv_cache_dtype: str = "auto") -> Support:
    """Can this host's vLLM load and run the checkpoint with this KV-cache dtype?"""
    if host.vllm_python is None or host.problem:
        return Support(False, f"not verifiable on this host: {host.problem}")
    kv_fp8 = kv_cache_dtype.startswith("fp8") or (kv_cache_dtype == "auto" and ckpt.kv_cache_fp8)
    reasons: list[str] = []
    for g in ckpt.groups:
        label = group_label(g, ckpt.quant) if ckpt.quant else "dense"
        if (r := _native_rule(ckpt.quant, g)) is None:
            r = _gpu_group(g, label, min(host.gpus)) if host.device == "cuda" else \
                _cpu_group(g, label, host)
        if r:
            reasons.append(r)
    if ckpt.quant and "hadamard" in ckpt.quant.online_transforms:
        if host.device == "cuda":
            why = rotation_problem(min(host.gpus))
        else:  # a CPU build that gains the op passes its probe
            why = None if host.ops.get("hadacore_transform") else rotation_problem(None)
        if why:
            reasons.append(f"{why}: verify it on a GPU of capability >= 8.0")
    if host.device == "cuda":
        cap = min(host.gpus)
        if kv_fp8 and cap < 80:
            reasons.append(f"FP8 KV cache needs compute capability >= 8.0 (GPU is sm_{cap})")
    elif kv_fp8:
        if not (host.isa.get("avx512") or host.isa.get("amx_tile")):
            reasons.append("FP8 KV cache needs AVX-512 or AMX or a GPU (load with "
                           "--kv-cache-dtype bfloat16 to verify the weights alone)")
        elif ckpt.head_dim and ckpt.head_dim % 32:
            reasons.append(f"FP8 KV cache on CPU needs head_dim divisible by 32 "
                           f"(model has {ckpt.head_dim})")
    if reasons:
        uniq = list(dict.fromkeys(reasons))
        return Support(False, "not verifiable on this host: " + "; ".join(uniq))
    return Support(True, "")


# --- the dtype to serve at ------------------------------------------------------------------
@dataclass(frozen=True)
class DtypeNeed:
    """A `--dtype` the checkpoint must be served with on this host, and why."""

    dtype: str
    reason: str

    @property
    def flag(self) -> str:
        return f"--dtype {self.dtype}"


def serving_dtype(ckpt: CheckpointFormat, device: str) -> DtypeNeed | None:
    """The `--dtype` vLLM needs on `device` (cpu | cuda) because `--dtype auto` would serve
    the checkpoint in a dtype one of its kernels cannot compute in; None when auto runs it."""
    if device != "cpu":
        return None
    for g in ckpt.groups:
        rule = KERNELS.get(g.kernel)
        need = rule.cpu_dtype if rule else None
        if rule and need and ckpt.dtype != need:
            declared = f"declares {ckpt.dtype}" if ckpt.dtype else "declares no dtype"
            return DtypeNeed(need, f"vLLM CPU runs {rule.label} only at --dtype "
                                   f"{need}; this export {declared}")
    return None
