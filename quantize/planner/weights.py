"""Weight memory from config.json alone: every tensor of a meta-device model, sized in the
format the export stage writes.

Quantized Linear weights are counted as compressed-tensors stores them (packed int32 codes,
scales and zero points per group; fp8/int8 weights with per-channel or per-tensor scales;
block-fp8 with fp32 block scales for published DeepSeek-style checkpoints), everything else
at the model dtype, tied embeddings once. vLLM keeps the same tensors on the GPU (repacked,
not resized), so the sum is what a rank holds after splitting what tensor parallelism splits.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Any

from quantize.errors import PlanError, QuantizeError
from quantize.model.config import ModelConfig
from quantize.model.formats import Format
from quantize.model.moe import expert_linears
from quantize.model.qconfig import (
    Args,
    QuantConfig,
    quant_method,
    read_quant_config,
)
from quantize.recipe.recipe import Recipe
from quantize.recipe.schemes import SCHEMES

SIZED_METHODS = ("fp8", Format.COMPRESSED_TENSORS.value)  # published formats the planner can size


@dataclass(frozen=True)
class WeightFormat:
    """How one Linear weight is stored (compressed-tensors formats, or fp8 block scales)."""

    kind: str  # "pack" (int, packed into int32) | "int8" | "fp8" | "fp8-block" | "fp4"
    bits: int
    group: int | None = None  # group size along the input dim; None = per channel/tensor
    symmetric: bool = True
    per_tensor: bool = False
    g_idx: bool = False  # actorder="group" stores a per-input-channel group index
    block: tuple[int, int] | None = None
    scale_bytes: int | None = None  # bytes per group/block scale; None: the model dtype
    global_scales: int = 0  # per-tensor scales beside them (NVFP4: weight [+ input] global)

    @property
    def label(self) -> str:
        if self.kind == "fp8-block":
            return f"fp8 block {self.block}"
        if self.kind == "fp4":
            return f"fp4 g{self.group}"
        g = f" g{self.group}" if self.group else ""
        return f"{self.kind} {self.bits}-bit{g}{'' if self.symmetric else ' asym'}"


def format_for(scheme: str, group: int | None, actorder: str | None = None) -> WeightFormat:
    """The on-disk format of a scheme-table entry at a resolved group size."""
    info = SCHEMES[scheme]
    if info.block is not None:  # compressed-tensors writes the block scales in the model dtype
        return WeightFormat("fp8-block", 8, block=info.block)
    if info.fixed_group is not None:
        return WeightFormat("fp4", info.weight_bits, info.fixed_group,
                            scale_bytes=info.scale_bytes, global_scales=info.global_scales)
    if info.weight_type == "float":
        return WeightFormat("fp8", 8, per_tensor=info.per_tensor)
    if info.packed:  # weight-only int schemes are written pack-quantized (8-bit too)
        return WeightFormat("pack", info.weight_bits, group, info.symmetric,
                            g_idx=actorder == "group")
    return WeightFormat("int8", 8, symmetric=info.symmetric)


def linear_bytes(out: int, inp: int, fmt: WeightFormat, dtype_bytes: int) -> int:
    """Bytes of one quantized Linear weight and its scale/zero-point tensors on disk (the
    same tensors vLLM keeps on the GPU, repacked but not resized)."""
    if fmt.kind == "fp8-block":  # published (fp32 scale_inv) or ours (model dtype)
        bn, bk = fmt.block or (128, 128)
        return out * inp + math.ceil(out / bn) * math.ceil(inp / bk) * (fmt.scale_bytes or 4)
    if fmt.kind == "fp4":  # two E2M1 codes per byte, one FP8/E8M0 scale per group
        group = fmt.group or 16
        scales = out * math.ceil(inp / group) * (fmt.scale_bytes or 1)
        return out * math.ceil(inp / 2) + scales + fmt.global_scales * dtype_bytes
    if fmt.kind in ("fp8", "int8"):
        scales = 2 if fmt.per_tensor else out  # weight_scale (+ input_scale when static)
        zero = 0 if fmt.symmetric else out
        return out * inp + (scales + zero) * dtype_bytes
    groups = math.ceil(inp / fmt.group) if fmt.group else 1
    packed = out * math.ceil(inp * fmt.bits / 32) * 4  # weight_packed int32
    scale = out * groups * dtype_bytes  # weight_scale in the model dtype
    zero = 0 if fmt.symmetric else math.ceil(out * fmt.bits / 32) * groups * 4  # packed on dim 0
    gidx = inp * 4 if fmt.g_idx else 0
    return packed + scale + zero + gidx + 16  # + weight_shape (2 x int64)


@dataclass(frozen=True)
class LayerPlan:
    """Which Linear layers get which format; experts_fmt for fused MoE expert tensors."""

    formats: dict[str, WeightFormat]
    experts_fmt: WeightFormat | None  # every fused expert projection's, when not by name
    kv_scales: bool = False
    # fused expert projections are in `formats` under expert 0's name (`...experts.0.down_proj`,
    # as pre-flight names them): absent means left 16-bit
    experts_by_name: bool = False
    # a recipe's mixed_precision: the export may take this multiple of the bytes above (which
    # layers get 8 bits is measured at quantize time), so sizes count the whole budget
    budget: float = 1.0


@dataclass(frozen=True)
class WeightEstimate:
    total: int
    replicated: int  # bytes every tensor-parallel rank holds in full
    quantized: int  # bytes of the quantized tensors (for checks against exports)
    # zero points of asymmetric packed int weights in dense Linears (count; stored packed at
    # `zero_point_bits` each): vLLM's Machete kernel holds them at 16 bits (memory.py)
    zero_points: int = 0
    zero_point_bits: int = 0

    def per_rank(self, tp: int) -> int:
        return self.replicated + math.ceil((self.total - self.replicated) / tp)


# vLLM keeps these whole on every rank: norms and biases (1-D), MoE routers and the MLA
# down-projections (ReplicatedLinear in vllm/model_executor/models/deepseek_v2.py)
_REPLICATED = re.compile(r"(mlp\.gate\.weight|kv_a_proj_with_mqa|q_a_proj|e_score_correction)")


def estimate_weights(model: Any, dtype_bytes: int, plan: LayerPlan) -> WeightEstimate:
    total = replicated = quantized = zero_points = zp_bits = 0
    modules = dict(model.named_modules())
    attention_layers = 0
    for name, param in model.named_parameters():  # tied weights are listed once
        owner, _, pname = name.rpartition(".")
        fmt = plan.formats.get(owner)
        if fmt is not None and pname == "weight" and param.ndim == 2:
            size = linear_bytes(param.shape[0], param.shape[1], fmt, dtype_bytes)
            quantized += size
            if fmt.kind == "pack" and not fmt.symmetric:
                groups = math.ceil(param.shape[1] / fmt.group) if fmt.group else 1
                zero_points += param.shape[0] * groups
                zp_bits = fmt.bits
        elif param.ndim == 3 and _is_experts(modules[owner]) and (
                plan.experts_fmt is not None or plan.experts_by_name):
            size = 0  # exported as one Linear per expert projection
            for proj, in_f, out_f, e in expert_linears(modules[owner], pname,
                                                       tuple(param.shape)):
                pfmt = plan.formats.get(f"{owner}.0.{proj}") if plan.experts_by_name \
                    else plan.experts_fmt
                if pfmt is None:
                    size += e * in_f * out_f * _stored_bytes(model, name, dtype_bytes)
                else:
                    part = e * linear_bytes(out_f, in_f, pfmt, dtype_bytes)
                    quantized += part
                    size += part
        else:
            size = param.numel() * _stored_bytes(model, name, dtype_bytes)
        if param.ndim == 1 or _REPLICATED.search(name):
            replicated += size
        total += size
        if pname == "weight" and owner.endswith(("k_proj", "kv_b_proj")):
            attention_layers += 1
    for _name, size in _persistent_buffers(model, dtype_bytes):  # e.g. DeepSeek's router bias
        total += size
        replicated += size
    if plan.budget > 1.0:  # mixed precision: up to the budget, spent on quantized layers
        extra = int(total * (plan.budget - 1.0))
        total += extra
        quantized += extra
    if plan.kv_scales:  # k_scale and v_scale per attention layer, model dtype
        total += 2 * attention_layers * dtype_bytes
        replicated += 2 * attention_layers * dtype_bytes
    return WeightEstimate(total, replicated, quantized, zero_points, zp_bits)


def _stored_bytes(model: Any, name: str, dtype_bytes: int) -> int:
    """Bytes per element of a tensor in the checkpoint: fp32 for what the model class keeps
    in fp32 whatever the dtype (transformers' `_keep_in_fp32_modules_strict`, matched on name
    components: DeepSeek-V3's `e_score_correction_bias`), else the model's dtype. The
    non-strict list (gpt-oss's norms) is cast with the model: its exports store them in
    bf16 (measured on the tiny fixtures, bench/moe_matrix.py)."""
    keep = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    return 4 if keep & set(name.split(".")) else dtype_bytes


def _persistent_buffers(model: Any, dtype_bytes: int) -> list[tuple[str, int]]:
    """(name, bytes) of the buffers a checkpoint stores (persistent ones: the state dict's;
    rotary tables are not)."""
    out = []
    for mod_name, mod in model.named_modules():
        skip: set[str] = getattr(mod, "_non_persistent_buffers_set", set())
        for bname, buf in mod.named_buffers(recurse=False):
            if buf is not None and bname not in skip:
                name = f"{mod_name}.{bname}" if mod_name else bname
                out.append((name, buf.numel() * _stored_bytes(model, name, dtype_bytes)))
    return out


def _is_experts(module: Any) -> bool:
    return type(module).__name__.endswith("Experts")


@functools.lru_cache(maxsize=8)
def _meta(config_json: str) -> Any:
    from quantize.model.layers import meta_model
    from quantize.model.source import check_architecture

    config = ModelConfig.from_json_text(config_json)
    try:
        check_architecture(config, trust_remote_code=False)
        return meta_model(config)
    except QuantizeError:
        raise
    except Exception as exc:
        raise PlanError(problem=f"transformers cannot build model_type {config.model_type!r} "
                                f"from this config ({type(exc).__name__}: {exc})",
                        hint="check config.json or upgrade transformers") from None


def meta(config: ModelConfig) -> Any:
    """The meta-device model of `config` (pre-flight's builder), cached: a plan sizes every
    recipe on the same model."""
    return _meta(config.cache_key())


def _sized(fmt: WeightFormat, dtype_bytes: int) -> WeightFormat:
    """Our block-FP8 exports hold their block scales in the model dtype (llm-compressor casts
    the model back to it before compressing); published ones hold fp32."""
    if fmt.kind == "fp8-block" and fmt.scale_bytes is None:
        return WeightFormat("fp8-block", 8, block=fmt.block, scale_bytes=dtype_bytes)
    return fmt


def recipe_layers(model: Any, recipe: Recipe, group: int | None,
                  dtype_bytes: int = 2) -> LayerPlan:
    """The recipe's per-layer formats, matched exactly as compressed-tensors matches them."""

    from quantize.model.layers import override_group_size, targeted_layers

    actorder = recipe.gptq.actorder if recipe.gptq else None
    main = _sized(format_for(recipe.scheme, group, actorder), dtype_bytes)
    formats = {lay.name: main for lay in targeted_layers(model, recipe.targets, recipe.ignore)}
    for ov in recipe.overrides:
        sub = targeted_layers(model, ov.targets, recipe.ignore)
        ov_group = override_group_size(ov, group)  # the rule pre-flight and the engine use
        for lay in sub:
            formats[lay.name] = _sized(format_for(ov.scheme, ov_group, actorder), dtype_bytes)
    # fused expert projections are among targeted_layers' names (expert 0's), overrides and
    # ignore entries matching them as the engine matches the unfused Linears
    mixed = recipe.mixed_precision
    return LayerPlan(formats, None, kv_scales=recipe.kv_cache == "fp8", experts_by_name=True,
                     budget=mixed.budget if mixed is not None else 1.0)


def published_quant(config: ModelConfig) -> QuantConfig | None:
    """The checkpoint's quantization block, typed, when the planner can size it
    (compressed-tensors or block fp8); None for an unquantized config."""
    try:
        qc = read_quant_config(config)
    except PlanError:  # a method the reader does not know
        raise _unsized(quant_method(config)) from None
    if qc is not None and qc.method not in SIZED_METHODS:
        raise _unsized(qc.method)
    return qc


def _unsized(method: str | None) -> PlanError:
    """The planner's refusal of a quantization method it cannot size."""
    return PlanError(problem=f"cannot size quantization_config quant_method {method!r}",
                     hint="plan from the unquantized base model's config.json instead")


def published_layers(model: Any, qc: QuantConfig) -> tuple[LayerPlan, str]:
    """The format of a pre-quantized checkpoint's quantization block (compressed-tensors or
    fp8 block), so its baseline row shows the weights as published."""
    from quantize.model.layers import targeted_layers

    group = qc.groups[0] if qc.groups else None
    w = (group.weights if group else None) or Args(8)
    if qc.method == "fp8":
        block = w.block_structure or (128, 128)
        fmt = WeightFormat("fp8-block", 8, block=(int(block[0]), int(block[1])))
    else:
        packing = group.format if group else qc.format
        kind = "fp8" if w.type == "float" else "pack" if packing == "pack-quantized" else "int8"
        fmt = WeightFormat(kind, w.num_bits or 8, w.group_size, w.symmetric,
                           per_tensor=w.strategy == "tensor", g_idx=w.actorder == "group")
        if w.type == "float" and w.num_bits == 4:  # NVFP4 (global scales) / MXFP4
            nv = w.strategy == "tensor_group"
            a = group.activations if group else None
            fmt = WeightFormat("fp4", 4, w.group_size or (16 if nv else 32), scale_bytes=1,
                               global_scales=(1 + (a is not None)) if nv else 0)
        elif w.strategy == "block":
            block = w.block_structure or (128, 128)
            fmt = WeightFormat("fp8-block", 8, block=(int(block[0]), int(block[1])))
    targets = list(group.targets) if group else ["Linear"]
    formats = {lay.name: fmt for lay in targeted_layers(model, targets, list(qc.ignore))}
    experts = fmt if any(_is_experts(m) for m in model.modules()) else None
    return LayerPlan(formats, experts), f"as published ({qc.method}: {fmt.label})"
