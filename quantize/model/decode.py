"""Our own decode of a quantized checkpoint: stored integers, scales and zero points back to
dense fp32 weights, written from the formats' layouts, not by calling the loaders.

verify's decode level compares this with what transformers + compressed-tensors (or
GPTQModel, for native GPTQ/AWQ) load, and the weights with the source model's; eval uses
`build_reference` to run native exports on equal terms with compressed-tensors ones. Layouts
read here:

- compressed-tensors: `weight_packed` (int32 words, a little-endian bit stream of
  offset-binary codes), `weight` (int8 or fp8), `weight_scale` per tensor, channel, group or
  block, `weight_zero_point` (packed along the output), `weight_g_idx` (activation order);
- native GPTQ (v1: zero points stored minus one, v2: as is) and AWQ GEMM (8 output columns per
  word in the order 0,2,4,6,1,3,5,7).

The quantization block is read through quantize.model.qconfig, config.json through
quantize.model.config; this module imports no stage.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantize.errors import VerifyError
from quantize.model import kv_quant, moe, moe_load
from quantize.model.config import ModelConfig, hf_config, read_config
from quantize.model.qconfig import Args, Group, QuantConfig, require_quant_config
from quantize.model.transforms import apply_online_transforms

if TYPE_CHECKING:
    import torch


def _unpack(packed: torch.Tensor, bits: int, n: int, dim: int) -> torch.Tensor:
    """Unsigned `bits`-bit values stored as a little-endian bit stream in int32 words along
    `dim` (element i at bit i*bits), `n` values per row; returns int64."""
    import numpy as np
    import torch

    words = packed.transpose(0, 1) if dim == 0 else packed
    w = np.ascontiguousarray(words.numpy().astype("<i4")).view(np.uint8)
    bitstream = np.unpackbits(w, axis=1, bitorder="little")[:, : n * bits]
    vals = bitstream.reshape(words.shape[0], n, bits).astype(np.int64)
    out = torch.from_numpy((vals << np.arange(bits, dtype=np.int64)).sum(axis=2))
    return out.transpose(0, 1) if dim == 0 else out


def decode_weight(t: dict[str, torch.Tensor], wargs: Args | None) -> torch.Tensor:
    """Dense fp32 weight from one layer's stored tensors (compressed-tensors layouts);
    `wargs`: the layer's weight arguments (None only for unpacked per-tensor/channel)."""
    import torch

    if wargs is not None and wargs.type == "float" and wargs.num_bits == 4:
        return decode_fp4(t, wargs)
    scale = t["weight_scale"].float()
    if "weight_packed" in t:
        if wargs is None:
            raise VerifyError(problem="a packed weight without weight arguments cannot be "
                                      "decoded")
        bits = wargs.num_bits
        out_f, in_f = (int(x) for x in t["weight_shape"].tolist())
        q = _unpack(t["weight_packed"], bits, in_f, 1) - (1 << (bits - 1))
        zp = None
        if "weight_zero_point" in t:
            zp = _unpack(t["weight_zero_point"], bits, out_f, 0) - (1 << (bits - 1))
    else:
        q = t["weight"].float() if t["weight"].is_floating_point() else t["weight"].long()
        zp = t["weight_zero_point"].long() if "weight_zero_point" in t else None
        out_f, in_f = q.shape
    q = q.float()
    if wargs is not None and wargs.strategy == "block":  # before the shape rules: a (2, 1)
        bh, bw = wargs.block_structure or (0, 0)  # grid of blocks is not per channel
        s = scale.repeat_interleave(bh, 0)[:out_f].repeat_interleave(bw, 1)[:, :in_f]
        return q * s
    if scale.numel() == 1:
        return (q - (zp.float() if zp is not None else 0)) * scale.reshape(())
    if scale.shape[1] == 1:  # per channel
        return (q - (zp.float() if zp is not None else 0)) * scale
    if wargs is None:
        raise VerifyError(problem="a grouped or blocked weight without weight arguments cannot "
                                  "be decoded")
    gs = int(wargs.group_size or in_f)
    g_idx = t.get("weight_g_idx")
    cols = g_idx.long() if g_idx is not None else torch.arange(in_f) // gs
    z = zp.float()[:, cols] if zp is not None else 0
    return (q - z) * scale[:, cols]


# --- FP4 (NVFP4, MXFP4) ---------------------------------------------------------------------
# E2M1 magnitudes by the low three bits of a code; bit 3 is the sign (OCP MX spec, 5.3.3)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def fp4_values(packed: torch.Tensor) -> torch.Tensor:
    """[rows, 2*cols] fp32 E2M1 values from uint8 bytes holding two codes each, the element
    of the even column in the low nibble."""
    import torch

    b = packed.to(torch.int64)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(start_dim=-2)
    mag = torch.tensor(E2M1, dtype=torch.float32)[codes & 7]
    return torch.where(codes & 8 != 0, -mag, mag)


def fp4_scales(t: dict[str, torch.Tensor], wargs: Args) -> torch.Tensor:
    """The effective fp32 scale of each group: NVFP4 stores FP8 scales multiplied by a
    per-tensor global scale (`weight_global_scale`, a divisor); MXFP4 stores E8M0 exponents
    (uint8, bias 127)."""
    import torch

    s = t["weight_scale"]
    if s.dtype == torch.uint8:  # E8M0
        return torch.pow(2.0, s.to(torch.float32) - 127.0)
    scale = s.float()
    g = t.get("weight_global_scale")
    if g is not None and not bool(torch.isfinite(g.float()).all()):
        # 448 * 6 / amax overflows float16 (65504) when a tensor's amax is below 0.041: an
        # NVFP4 export of a float16 model must then be made from a bfloat16 copy
        raise VerifyError(problem=f"weight_global_scale is {g.float().flatten()[0].item()} "
                                  "(not finite): the NVFP4 scale overflowed the checkpoint's "
                                  "float16", hint="quantize a bfloat16 copy of the model")
    return scale / g.float().reshape(()) if g is not None else scale


def decode_fp4(t: dict[str, torch.Tensor], wargs: Args) -> torch.Tensor:
    """Dense weight (fp32 tensor) of an NVFP4/MXFP4 layer: E2M1 codes times their group's
    scale, computed in fp32 and rounded once to bfloat16 - the dense dtype of the format's
    reference decompression (compressed-tensors nvfp4/helpers.py unpack_fp4_from_uint8), so
    that the loader's weights can be compared bit for bit. MXFP4's power-of-two scales make
    the rounding exact; NVFP4's FP8 scale over the global scale does not."""
    import torch

    q = fp4_values(t["weight_packed"])
    gs = int(wargs.group_size or 16)
    scale = fp4_scales(t, wargs)
    w = (q.reshape(q.shape[0], -1, gs) * scale.unsqueeze(-1)).reshape(q.shape)
    return w.to(torch.bfloat16).float()


def round_fp4(x: torch.Tensor) -> torch.Tensor:
    """x (already clamped to [-6, 6]) rounded to the nearest E2M1 value, ties to the even
    code (as round-to-nearest-even casts do)."""
    import torch

    grid = torch.tensor(E2M1, dtype=x.dtype)
    mid = (grid[1:] + grid[:-1]) / 2
    a = x.abs()
    idx = torch.bucketize(a, mid)  # mid values go down (to the lower index)...
    tie = (idx < len(E2M1) - 1) & (a == mid[idx.clamp(max=len(mid) - 1)])
    idx = torch.where(tie & (idx % 2 == 1), idx + 1, idx)  # ...unless that code is odd
    return torch.sign(x) * grid[idx]


# --- native GPTQ / AWQ ----------------------------------------------------------------------
# Native AWQ GEMM packs 8 output columns per int32 in the order 0,2,4,6,1,3,5,7 (AutoAWQ's
# WQLinear_GEMM.from_linear); natural column c sits at nibble position _AWQ_POSITION[c].
_AWQ_POSITION = (0, 4, 1, 5, 2, 6, 3, 7)


@dataclass(frozen=True)
class NativeArgs:
    """What decoding a native GPTQ/AWQ layer needs."""

    method: str  # gptq | awq
    bits: int
    group_size: int  # -1: one group over the whole input (per channel)
    zero_offset: int  # GPTQ v1 ("gptq") stores each zero point minus one; v2 and AWQ as is


def native_args(qc: QuantConfig) -> NativeArgs:
    """The numbers of a native GPTQ/AWQ checkpoint, or why this module cannot decode it."""
    w = qc.groups[0].weights if qc.groups else None
    bits = w.num_bits if w else 0
    gs = int(w.group_size) if w and w.group_size else -1
    fmt = qc.native_version or ""
    if qc.method == "gptq" and fmt not in ("gptq", "gptq_v2"):
        raise VerifyError(problem=f"native GPTQ checkpoint_format {fmt!r} has no reference "
                                  "decode", hint="verify handles gptq and gptq_v2")
    if qc.method == "awq" and (fmt.lower() != "gemm" or bits != 4):
        raise VerifyError(problem=f"native AWQ {fmt!r} {bits}-bit has no reference decode",
                          hint="verify handles 4-bit GEMM")
    if qc.method not in ("gptq", "awq"):
        raise VerifyError(problem=f"quant_method {qc.method!r} is not a native GPTQ/AWQ "
                                  "checkpoint")
    return NativeArgs(qc.method, bits, gs, 1 if (qc.method, fmt) == ("gptq", "gptq") else 0)


def decode_native(t: dict[str, torch.Tensor], nargs: NativeArgs) -> torch.Tensor:
    """Dense fp32 weight [out, in] from one layer's native GPTQ or AWQ GEMM tensors:
    W = (q - zero) * scale per group, decoded from the bits here, not by the engine."""
    import torch

    bits, scale = nargs.bits, t["scales"].float()  # [groups, out]
    qw, qz = t["qweight"], t["qzeros"]
    if nargs.method == "gptq":  # qweight [in*bits/32, out], standard bit order
        in_f, out_f = qw.shape[0] * 32 // bits, qw.shape[1]
        q = _unpack(qw, bits, in_f, 0)  # [in, out]
        z = _unpack(qz, bits, out_f, 1) + nargs.zero_offset  # [groups, out]
    else:  # AWQ GEMM: qweight [in, out*bits/32], packed along the output in AWQ order
        in_f, out_f = qw.shape[0], qw.shape[1] * 32 // bits
        order = torch.tensor(_AWQ_POSITION)
        q = _unpack(qw, bits, out_f, 1).reshape(in_f, -1, 8)[:, :, order].reshape(in_f, out_f)
        z = _unpack(qz, bits, out_f, 1).reshape(qz.shape[0], -1, 8)[:, :, order].reshape(
            qz.shape[0], out_f)
    gs = nargs.group_size if nargs.group_size > 0 else in_f
    g_idx = t.get("g_idx")
    rows = g_idx.long() if g_idx is not None else torch.arange(in_f) // gs
    return ((q.float() - z.float()[rows]) * scale[rows]).T.contiguous()


# --- what a loaded model computes with ----------------------------------------------------
def effective_weight(mod: Any) -> torch.Tensor:
    """A layer's weight [out, in] as the loaded model uses it: its dense weight, or, for a
    quantized kernel module without one (GPTQModel's), what it does to the identity."""
    import torch

    w = getattr(mod, "weight", None)
    if isinstance(w, torch.Tensor) and w.is_floating_point():
        return w.detach().float()
    eye = torch.eye(int(mod.in_features), dtype=torch.float32)
    with torch.no_grad():
        y = mod(eye).float()
    bias = getattr(mod, "bias", None)
    if isinstance(bias, torch.Tensor):
        y = y - bias.float()
    return y.T


def _fake_quant_hook(aargs: Args, input_scale: torch.Tensor | None) -> Any:
    """Forward pre-hook quantizing a Linear's input as the scheme says (our own version)."""
    import torch

    bits, kind = aargs.num_bits, aargs.type
    # compressed-tensors' symmetric scale is amax / ((q_max - q_min) / 2): 448 for FP8, 127.5
    # for INT8 (vLLM's int8 kernel divides by 127: one source of engine difference).
    qmax = 448.0 if kind == "float" else ((1 << bits) - 1) / 2
    lo, hi = (-qmax, qmax) if kind == "float" else (-(1 << (bits - 1)), (1 << (bits - 1)) - 1)

    def hook(_mod: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        if kind == "float" and (bits == 4 or aargs.strategy in ("group", "tensor_group")):
            return (_group_fake_quant(x, aargs, input_scale), *args[1:])
        if aargs.dynamic and aargs.strategy == "token":
            s = x.abs().amax(dim=-1, keepdim=True) / qmax
        elif aargs.dynamic:
            s = x.abs().amax() / qmax
        else:
            assert input_scale is not None
            s = input_scale.float()
        s = s.clamp_min(1e-12)  # an all-zero row: any scale gives zeros
        y = x / s
        if kind == "float":
            y = y.clamp(lo, hi).to(torch.float8_e4m3fn).float()
        else:
            y = torch.round(y).clamp(lo, hi)
        return (y * s, *args[1:])

    return hook


def _group_fake_quant(x: torch.Tensor, aargs: Args, global_scale: torch.Tensor | None
                      ) -> torch.Tensor:
    """Activations quantized per group along the last dimension, scales computed at run time:
    FP8 groups of 128 (block FP8: amax / 448), NVFP4 groups of 16 (FP8 scale of amax / 6
    times the calibrated global scale, a divisor), MXFP4 groups of 32 (E8M0 scale: amax's
    power of two, rounded up from a mantissa of 1.75, over 2^2, E2M1's largest exponent;
    compressed-tensors' mxfp_utils.py generate_mx_scales)."""
    import torch

    gs = int(aargs.group_size or x.shape[-1])
    shape = x.shape
    g = x.float().unflatten(-1, (shape[-1] // gs, gs))
    amax = g.abs().amax(dim=-1, keepdim=True)
    if aargs.num_bits == 8:
        s = (amax / 448.0).clamp_min(1e-12)
        y = (g / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * s
        return y.flatten(start_dim=-2).to(x.dtype)
    if global_scale is not None:  # NVFP4
        gscale = global_scale.float().reshape(())
        s = (gscale * amax / 6.0).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() / gscale
    else:  # MXFP4: amax to a power of two (up when its mantissa is >= 1.75), minus 2
        m, e = torch.frexp(amax.clamp_min(2.0 ** -126))  # amax = m * 2^e, m in [0.5, 1)
        e = e.float() - 1.0 + (m >= 0.875).float()
        s = torch.pow(2.0, (e - 2.0).clamp(-127.0, 127.0))
    s = torch.where(s == 0, torch.ones_like(s), s)  # an all-zero group: any scale gives zeros
    y = round_fp4((g / s).clamp(-6.0, 6.0)) * s
    return y.flatten(start_dim=-2).to(x.dtype)


def layer_groups(model: Any, qc: QuantConfig) -> dict[str, Group]:
    """Which config group quantizes each layer, by compressed-tensors' own rule
    (`apply_quantization_config`): one target -> group map (a later group overrides an equal
    target), and for each layer the most specific matching target wins: exact name, then
    regex, then class name (`match_targets`), whatever the groups' order."""
    from compressed_tensors.utils import match_named_modules, match_targets

    by_target: dict[str, Group] = {}
    for group in qc.groups:
        for target in group.targets:
            by_target[target] = group
    out: dict[str, Group] = {}
    for name, module in match_named_modules(model, list(by_target), list(qc.ignore)):
        matched = match_targets(name, module, list(by_target))
        if matched:
            out[name] = by_target[matched[0]]
    return out


# --- the reference model ------------------------------------------------------------------
def _layer_tensors(raw: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    return {k[len(name) + 1:]: v for k, v in raw.items() if k.startswith(name + ".")}


def build_reference(ckpt: Path, config: ModelConfig) -> tuple[Any, dict[str, torch.Tensor]]:
    """A plain dense transformers model holding our own decode of the checkpoint, with our
    own activation-quantization hooks. Returns (model, decoded weights by layer name)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    cfg = copy.deepcopy(hf_config(config))  # from_config may set attributes on it
    with no_init_weights():  # every weight is loaded below; random init would be wasted
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    moe.linearize(model)  # MoE: one Linear per expert projection, as the export stores them
    rename = moe_load.model_namer(model)  # stored names -> the model's (Mixtral's differ)
    qc = require_quant_config(moe_load.in_model_terms(config, rename), ckpt,
                              "there is nothing to decode")
    raw = moe_load.stored_tensors(ckpt, rename)
    if (kv := qc.kv_cache) is not None:  # K/V quantized on their way into the cache, too
        kv_quant.quantize_kv_cache(model, raw, kv,
                                   lambda x, s: _fake_quant_hook(kv, s)(None, (x,))[0])
    state: dict[str, torch.Tensor] = {}
    decoded: dict[str, torch.Tensor] = {}
    if qc.native:  # GPTQ/AWQ: every layer with a qweight
        nargs = native_args(qc)
        for name in sorted(k[: -len(".qweight")] for k in raw if k.endswith(".qweight")):
            t = _layer_tensors(raw, name)
            decoded[name] = state[name + ".weight"] = decode_native(t, nargs)
            if t.get("bias") is not None:
                state[name + ".bias"] = t["bias"].float()
    else:
        modules = dict(model.named_modules())
        for name, group in layer_groups(model, qc).items():
            mod = modules[name]
            if not isinstance(mod, torch.nn.Linear):
                continue
            t = _layer_tensors(raw, name)
            decoded[name] = state[name + ".weight"] = decode_weight(t, group.weights)
            if t.get("bias") is not None:
                state[name + ".bias"] = t["bias"].float()
            if group.activations is not None:
                mod.register_forward_pre_hook(
                    _fake_quant_hook(group.activations,
                                     t.get("input_scale", t.get("input_global_scale"))))
    quant_prefixes = tuple(n + "." for n in decoded)
    for k, v in raw.items():
        if not k.startswith(quant_prefixes) and v.is_floating_point():
            state[k] = v.float()
    missing, _unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing:
        raise VerifyError(path=ckpt, problem=f"the reference decode found no tensor for "
                                             f"{missing[:3]}: the checkpoint is incomplete",
                          hint="re-run the export")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    apply_online_transforms(model, config.quantization_config)  # a rotated export
    return model, decoded


# --- resemblance to the source model ------------------------------------------------------
def _column_cosine(w: torch.Tensor, d: torch.Tensor) -> float:
    """Cosine of each input column of `w` with `d`'s, combined weighted by the column's energy
    in `w`: invariant to per-input-channel rescaling (AWQ, SmoothQuant), and columns such
    rescaling shrank to nearly nothing (coarsely quantized, harmless) barely count."""
    import torch

    cos = torch.nn.functional.cosine_similarity(w, d, dim=0).clamp(min=0)
    energy = (w * w).sum(dim=0)
    return float(torch.sqrt((energy * cos * cos).sum() / energy.sum().clamp_min(1e-30)))


def weight_similarity(decoded: dict[str, torch.Tensor], src: Path,
                      rename: Callable[[str], str] = str) -> tuple[float, str]:
    """(the worst layer's energy-weighted column cosine with the source weights, that layer).
    `rename`: a source key -> the decoded model's name for it (moe_load.model_namer: a Mixtral
    source stores `block_sparse_moe.experts.<i>.w1`, the model has `mlp.experts.<i>.gate_proj`)."""
    from safetensors import safe_open

    worst = (1.0, "")
    shapes: dict[str, Any] = {}  # every source tensor's shape, whichever shard holds it
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            shapes |= {rename(k): fh.get_slice(k).get_shape() for k in fh.keys()}  # noqa: SIM118
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            stored = {rename(k): k for k in fh.keys()}  # noqa: SIM118
            keys = set(stored)

            def get(key: str, fh: Any = fh, stored: dict[str, str] = stored) -> torch.Tensor:
                return fh.get_tensor(stored[key])

            for name, w in decoded.items():
                d: torch.Tensor | None = None
                if name + ".weight" in keys:
                    d = get(name + ".weight").float()
                else:  # an MoE expert: cut from the source's fused expert tensors
                    d = moe.fused_source_weight(get, shapes.__getitem__, keys, name,
                                                tuple(w.shape), set(shapes))
                if d is None:
                    continue
                c = _column_cosine(w, d) if d.shape == w.shape else 0.0
                if not c >= worst[0]:
                    worst = (c, name)
    return worst


def load_dequantized(path: Path, **kwargs: Any) -> Any:
    """A compressed-tensors checkpoint through transformers with its weights decompressed once
    at load: the numbers the packed kernels compute with, without unpacking every weight again
    on every forward. `dequantize=True` replaced `run_compressed=False` in transformers 5.17."""
    import inspect
    import warnings

    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    new_name = "dequantize" in inspect.signature(CompressedTensorsConfig).parameters
    override = CompressedTensorsConfig(dequantize=True) if new_name else \
        CompressedTensorsConfig(run_compressed=False)
    with warnings.catch_warnings():
        # transformers warns that the passed config overrides the checkpoint's: it is meant to
        warnings.filterwarnings("ignore", message="You passed `quantization_config`")
        model = AutoModelForCausalLM.from_pretrained(
            path, quantization_config=override, **kwargs)
    # compressed-tensors decompresses FP4 (NVFP4/MXFP4) weights into bfloat16 whatever dtype
    # was asked for (nvfp4/helpers.py unpack_fp4_from_uint8), and the forward then fails on
    # mixed dtypes: give those weights the model's dtype (their values are kept)
    want = kwargs.get("dtype")
    if want is not None and not isinstance(want, str):
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != want:
                p.data = p.data.to(want)
    apply_online_transforms(model, read_config(path).quantization_config)  # a rotated export
    return model
