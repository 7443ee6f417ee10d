"""verify: prove that an export loads in vLLM and computes what transformers computes.

Two levels, and verify.json says which one a checkpoint got:

- `vllm` (full): vLLM, in its own environment and a fresh subprocess, loads the checkpoint
  and decodes greedily from fixed prompts, returning each chosen token's log-probability and
  the top-k. transformers (+ compressed-tensors, which fake-quantizes activations the way the
  scheme says) then scores the same token sequences in fp32. Compared: greedy agreement (the
  fraction of steps where transformers' argmax is vLLM's token; the first disagreement is
  where free-running greedy decoding would part) and |Δ log-prob| of vLLM's tokens.
- `decode` (fallback, when this host's vLLM cannot run the format): the export is
  decompressed by transformers + compressed-tensors and compared with a reference this module
  rebuilds on its own from the raw safetensors (bit-unpacking, W = (q - zp) * scale per
  group or channel, the scheme's activation quantization re-implemented as hooks) in a plain
  dense model. Both are the same fp32 arithmetic over the same integers and scales, so they
  must agree to float tolerance. This checks the stored integers, scales, zero points and
  packing layout, not the quantization quality (the gate does that). Native GPTQ/AWQ exports
  (backend gptqmodel/autoawq) get the same check against GPTQModel's kernels, which is what
  transformers loads them with, decoded here from their own layouts (GPTQ v1/v2, AWQ GEMM).
  It is preferred to comparing with the dense model's logits under a scheme-derived
  tolerance, because that tolerance must be loose enough for 2-bit recipes (RTN INT2 of the
  default model agrees with it on 0.4% of next tokens) and so would pass a corrupt 8-bit
  export. The source model is still compared, weight by weight (column cosine, floor by
  bits), to catch a decode that is consistent but wrong: both sides misreading a layout the
  same way.
"""

from __future__ import annotations

import json
import math
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantize.errors import VerifyError, first_line
from quantize.model.source import load_dequantized
from quantize.run.files import atomic_dir, atomic_write_json, atomic_write_text, sha256_file
from quantize.vllm import support as capabilities

if TYPE_CHECKING:
    import torch

NAME = "verify"

# Fixed prompts: prose, code, a list, a question, a chat-like turn, digits. Short, so that a
# CPU run stays cheap; the tokens are scored in both engines from the same ids.
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Here are three tips for staying healthy:\n1.",
    "Q: Why is the sky blue?\nA:",
    "User: Write a haiku about the sea.\nAssistant:",
    "1, 2, 3, 5, 8, 13,",
)
MAX_TOKENS = 16
TOP_K = 5


@dataclass(frozen=True)
class Thresholds:
    """vLLM vs transformers on the same checkpoint. Not quantization error: both run the same
    quantized weights; what differs is arithmetic (vLLM's bf16/int8/fp8 kernels vs fp32
    fake-quantization). Measured on the default model with vLLM 0.32 CPU (bf16) against
    transformers (fp32): agreement 0.93-0.99 and mean |Δ| 0.025 (dense, INT4) to 0.14 nats
    (INT8 W8A8, FP8, FP8 KV cache), every disagreement a near-tie. A checkpoint that vLLM
    misreads (wrong scales, layout) shows agreement near 0 and mean |Δ| of several nats.
    """

    min_agreement: float = 0.80  # fraction of steps where both pick the same token
    max_mean_abs_dlogprob: float = 0.25  # nats
    tie_margin: float = 2.5  # a disagreement is tolerated only if transformers rates vLLM's
    # token within this many nats of its own top choice (a near-tie, not a different model);
    # the widest gap measured on a sound export was 1.1 nats (RTN INT8 W8A8, int8 GEMM vs
    # fp32 fake-quantization); a misread layer gives gaps of many nats at most steps


@dataclass(frozen=True)
class DecodeTolerance:
    """Fallback: our decode vs compressed-tensors' decode, both fp32 on the same numbers."""

    weight_rel: float = 2e-3  # max |ΔW| / max |W| per layer (fp16 scales: ~1 ulp)
    # |Δ log-prob| over the whole vocabulary at every position of real text: the mean over
    # positions of the per-position max, and the max. Weight-only schemes give exactly 0;
    # activation quantization may round an element differently at a boundary.
    mean_abs_dlogprob: float = 5e-3
    max_abs_dlogprob: float = 5e-2
    # Resemblance to the source model, per layer: the cosine of each input column of the
    # decoded weights with the source's, combined weighted by column energy (per column, so
    # AWQ/SmoothQuant's per-input-channel rescaling is no difference). The worst layer must
    # reach a floor set by the weight bits. Measured worst layers on the default model:
    # SmoothQuant+GPTQ INT8 0.9996, FP8 0.9997, RTN INT4 0.992, GPTQ INT4 0.951, RTN INT2
    # 0.848; a misread layout (bit order, rows, transposition, zero points) falls near 0.
    cosine_floor: tuple[tuple[int, float], ...] = ((8, 0.98), (4, 0.9), (3, 0.8), (2, 0.7))


# --- where things are -------------------------------------------------------------------
def resolve_target(path: Path) -> tuple[Path, Path | None]:
    """A run folder (uses <run>/export, writes <run>/verify) or a checkpoint folder."""
    path = Path(path)
    if (path / "export" / "config.json").is_file():
        return path / "export", path
    if (path / "config.json").is_file():
        return path, None
    raise VerifyError(f"{path} is neither a run folder (with export/) nor a checkpoint folder "
                      "(with config.json); give `runs/<name>` or an export folder")


def read_config(ckpt: Path) -> dict[str, Any]:
    if not list(ckpt.glob("*.safetensors")):
        raise VerifyError(f"{ckpt} has no *.safetensors weights; re-run the export")
    try:
        config: dict[str, Any] = json.loads((ckpt / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise VerifyError(f"{ckpt}/config.json cannot be read ({exc}); re-run the export") \
            from None
    return config


def source_model(ckpt: Path) -> Path | None:
    """The unquantized model the export came from, from the export's manifest."""
    try:
        meta = json.loads((ckpt / "manifest.json").read_text())
        p = Path(meta["model"]["path"])
    except (OSError, KeyError, TypeError, json.JSONDecodeError):
        return None
    return p if (p / "config.json").is_file() else None


def prompt_ids(ckpt: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    return [list(tok(p)["input_ids"]) for p in PROMPTS]


# --- transformers side --------------------------------------------------------------------
def load_hf(ckpt: Path) -> Any:
    """The checkpoint in transformers, decompressed to fp32 by compressed-tensors (which also
    applies the scheme's activation quantization in forward); a native GPTQ/AWQ checkpoint
    runs on GPTQModel's kernels in fp32."""
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM

    from quantize.backends._native import NATIVE_METHODS, native_load

    kwargs: dict[str, Any] = {"dtype": torch.float32}
    qc = json.loads((ckpt / "config.json").read_text()).get("quantization_config") or {}
    loading: Any = contextlib.nullcontext()
    native = qc.get("quant_method") in NATIVE_METHODS
    if native:
        loading = native_load(qc["quant_method"])
    try:
        with loading:
            model = load_dequantized(ckpt, **kwargs) if qc and not native else \
                AutoModelForCausalLM.from_pretrained(ckpt, **kwargs)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:  # incl. NotImplementedError
        first = first_line(exc)
        raise VerifyError(f"transformers cannot load {ckpt}: {type(exc).__name__}: {first}") \
            from exc
    unfuse_native_kernels(model)
    return model.eval()


def unfuse_native_kernels(model: Any) -> int:
    """GPTQModel's CPU kernels (TorchAtenLinear, TorchAtenAwqLinear) switch on their first
    forward to a fused int4 matmul in bf16, with the scales rounded to bf16: 0.55% per weight
    and 0.17 nats (mean per-position max |Δlog-prob|) on the default model's logits. Set before
    any forward, `linear_mode = "train"` keeps them on their own path: GPTQModel's dequantize,
    then a matmul in the model's dtype (fp32 here), the same arithmetic as compressed-tensors'
    dequantize=True. Returns the number of layers switched."""
    import torch

    n = 0
    for mod in model.modules():
        if getattr(mod, "linear_mode", "absent") is None:
            mod.linear_mode = "train"
            scales = getattr(mod, "scales", None)
            if isinstance(scales, torch.Tensor) and scales.is_floating_point():
                mod.scales = scales.float()  # its dequantize computes in the scales' dtype
            n += 1
    return n


def score(model: Any, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Log-softmax rows predicting each of `tokens` after `prompt` (teacher forcing)."""
    import torch

    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1: len(prompt) + len(tokens) - 1]
    return torch.log_softmax(logits.float(), dim=-1)


def eval_text_ids(ckpt: Path, n: int = 4, length: int = 64) -> torch.Tensor:
    """[n, length] token ids of real text (the shipped wiki eval passages) for the decode
    level's teacher-forced comparisons: one batched forward per model, no generation."""
    import torch
    from transformers import AutoTokenizer

    from quantize.stages.calibrate import BUILTIN_TEXT

    tok = AutoTokenizer.from_pretrained(ckpt)
    rows = []
    for line in BUILTIN_TEXT["wiki-eval"].read_text(encoding="utf-8").splitlines():
        ids = tok(line.strip())["input_ids"]
        if len(ids) >= length:
            rows.append(ids[:length])
        if len(rows) == n:
            break
    return torch.tensor(rows)


def log_probs(model: Any, ids: torch.Tensor) -> torch.Tensor:
    import torch

    with torch.no_grad():
        return torch.log_softmax(model(ids).logits.float(), dim=-1)


# --- comparing ----------------------------------------------------------------------------
def compare(vllm_outputs: list[dict[str, Any]], hf_rows: list[torch.Tensor],
            th: Thresholds) -> dict[str, Any]:
    """Per-step agreement and log-prob differences, pooled over prompts."""
    steps = agree = 0
    dlp: list[float] = []
    first_div: list[int] = []
    bad_ties: list[dict[str, Any]] = []
    for p, (out, rows) in enumerate(zip(vllm_outputs, hf_rows, strict=True)):
        div = len(out["steps"])
        for i, st in enumerate(out["steps"]):
            tok = st["token"]
            row = rows[i]
            hf_top = int(row.argmax())
            lp_hf = float(row[tok])
            steps += 1
            dlp.append(abs(st["logprob"] - lp_hf))
            if hf_top == tok:
                agree += 1
                continue
            div = min(div, i)
            gap = float(row[hf_top]) - lp_hf
            if gap > th.tie_margin:
                bad_ties.append({"prompt": p, "step": i, "vllm_token": tok,
                                 "hf_token": hf_top, "gap_nats": round(gap, 3)})
        first_div.append(div)
    mean_d = sum(dlp) / max(len(dlp), 1)
    agreement = round(agree / max(steps, 1), 4)
    metrics: dict[str, Any] = {
        "steps": steps, "agreement": agreement,
        "mean_abs_dlogprob": round(mean_d, 4), "max_abs_dlogprob": round(max(dlp, default=0), 4),
        "greedy_prefix_match": first_div, "prompts_fully_matching":
            sum(d == len(o["steps"]) for d, o in zip(first_div, vllm_outputs, strict=True)),
        "non_tie_disagreements": bad_ties[:10],
    }
    failures = []
    if agreement < th.min_agreement:
        failures.append(f"greedy agreement {agreement:.2%} < "
                        f"{th.min_agreement:.0%}")
    if mean_d > th.max_mean_abs_dlogprob:
        failures.append(f"mean |Δlogprob| {mean_d:.3f} > {th.max_mean_abs_dlogprob} nats")
    if bad_ties:
        failures.append(f"{len(bad_ties)} disagreement(s) are not near-ties (e.g. prompt "
                        f"{bad_ties[0]['prompt']} step {bad_ties[0]['step']}: transformers "
                        f"rates vLLM's token {bad_ties[0]['gap_nats']} nats below its own)")
    metrics["failures"] = failures
    return metrics


# --- full level: vLLM -----------------------------------------------------------------------
def engine_request(ckpt: Path, prompts: list[list[int]], host: capabilities.Host, tp: int,
                   kv_cache_dtype: str) -> dict[str, Any]:
    req: dict[str, Any] = {"op": "generate", "model": str(ckpt.resolve()), "prompts": prompts,
                           "max_tokens": MAX_TOKENS, "logprobs": TOP_K, "tp": tp,
                           "kv_cache_dtype": kv_cache_dtype, "max_model_len": 512,
                           "enforce_eager": True}
    if host.device == "cpu":
        # fp16 has no fast CPU GEMM (vLLM falls back to a slow torch path); bf16 is what the
        # CPU backend serves with.
        req["dtype"] = "bfloat16"
        req["kv_cache_space_gib"] = 1
    return req


def serve_command(ckpt: Path, req: dict[str, Any], host: capabilities.Host) -> str:
    env = f"VLLM_CPU_KVCACHE_SPACE={req.get('kv_cache_space_gib', 1)} " \
        if host.device == "cpu" else ""
    args = [f"vllm serve {shlex.quote(str(ckpt.resolve()))}"]
    if req.get("dtype"):
        args.append(f"--dtype {req['dtype']}")
    if req["tp"] > 1:
        args.append(f"--tensor-parallel-size {req['tp']}")
    if req["kv_cache_dtype"] != "auto":
        args.append(f"--kv-cache-dtype {req['kv_cache_dtype']}")
    args.append(f"--max-model-len {req['max_model_len']}")
    if host.device == "cpu":
        args.append("--enforce-eager")
    return env + " ".join(args)


def verify_vllm(ckpt: Path, out: Path, host: capabilities.Host, *, tp: int,
                kv_cache_dtype: str, timeout_s: float, th: Thresholds) -> dict[str, Any]:
    assert host.vllm_python is not None
    prompts = prompt_ids(ckpt)
    req = engine_request(ckpt, prompts, host, tp, kv_cache_dtype)
    res = capabilities.run_worker(Path(host.vllm_python), req, out / "logs", "vllm", timeout_s)
    result: dict[str, Any] = {"serve_command": serve_command(ckpt, req, host)}
    if not res.get("ok"):
        result.update({"verdict": "fail", "error": f"vLLM could not load the checkpoint: "
                       f"{res.get('error')}", "vllm_log": _rel(res.get("log"), out)})
        return result
    t0 = time.perf_counter()
    try:
        model = load_hf(ckpt)
    except VerifyError as exc:  # vLLM loaded what transformers cannot: no reference
        result.update({"verdict": "fail", "error": f"vLLM loaded it, but {exc}",
                       "vllm_log": _rel(res.get("log"), out)})
        return result
    rows = [score(model, p, o["token_ids"]) for p, o in zip(prompts, res["outputs"],
                                                            strict=True)]
    metrics = compare(res["outputs"], rows, th)
    result.update({
        "verdict": "fail" if metrics["failures"] else "pass",
        "vllm": {k: res.get(k) for k in ("vllm_version", "quantization", "dtype", "layers",
                                         "load_s", "generate_s", "engine_args")},
        "vllm_log": _rel(res.get("log"), out),
        "metrics": metrics, "thresholds": th.__dict__,
        "reference_s": round(time.perf_counter() - t0, 2),
        "samples": _samples(ckpt, prompts, res["outputs"]),
    })
    if metrics["failures"]:
        result["error"] = "vLLM disagrees with transformers: " + "; ".join(metrics["failures"])
    return result


def _samples(ckpt: Path, prompts: list[list[int]], outputs: list[dict[str, Any]]) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    return [str(tok.decode(p)) + "⟨" + str(tok.decode(o["token_ids"])) + "⟩"
            for p, o in zip(prompts[:3], outputs[:3], strict=False)]


def _rel(path: str | None, base: Path) -> str | None:
    if not path:
        return None
    try:
        return str(Path(path).relative_to(base))
    except ValueError:
        return path


# --- fallback level: independent decode ---------------------------------------------------
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


def decode_weight(t: dict[str, torch.Tensor], wargs: dict[str, Any]) -> torch.Tensor:
    """Dense fp32 weight from one layer's stored tensors (compressed-tensors layouts)."""
    import torch

    scale = t["weight_scale"].float()
    if "weight_packed" in t:
        bits = int(wargs["num_bits"])
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
    if scale.numel() == 1:
        return (q - (zp.float() if zp is not None else 0)) * scale.reshape(())
    if scale.shape[1] == 1:  # per channel
        return (q - (zp.float() if zp is not None else 0)) * scale
    if wargs.get("strategy") == "block":
        bh, bw = wargs["block_structure"]
        s = scale.repeat_interleave(bh, 0)[:out_f].repeat_interleave(bw, 1)[:, :in_f]
        return q * s
    gs = int(wargs["group_size"])
    g_idx = t.get("weight_g_idx")
    cols = g_idx.long() if g_idx is not None else torch.arange(in_f) // gs
    z = zp.float()[:, cols] if zp is not None else 0
    return (q - z) * scale[:, cols]


# Native AWQ GEMM packs 8 output columns per int32 in the order 0,2,4,6,1,3,5,7 (AutoAWQ's
# WQLinear_GEMM.from_linear); natural column c sits at nibble position _AWQ_POSITION[c].
_AWQ_POSITION = (0, 4, 1, 5, 2, 6, 3, 7)


def native_args(qc: dict[str, Any]) -> dict[str, Any]:
    """The numbers a native GPTQ/AWQ quantization_config gives (GPTQModel and AutoAWQ keys)."""
    method = qc["quant_method"]
    bits = int(qc.get("bits") or qc.get("w_bit") or 0)
    gs = int(qc.get("group_size") or qc.get("q_group_size") or -1)
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or qc.get("version") or "")
    if method == "gptq" and fmt not in ("gptq", "gptq_v2"):
        raise VerifyError(f"native GPTQ checkpoint_format {fmt!r} has no reference decode; "
                          "verify handles gptq and gptq_v2")
    if method == "awq" and (fmt.lower() != "gemm" or bits != 4):
        raise VerifyError(f"native AWQ {fmt!r} {bits}-bit has no reference decode; verify "
                          "handles 4-bit GEMM")
    # GPTQ v1 ("gptq") stores each zero point minus one; v2 and AWQ store it as is
    return {"method": method, "bits": bits, "group_size": gs,
            "zero_offset": 1 if (method, fmt) == ("gptq", "gptq") else 0}


def decode_native(t: dict[str, torch.Tensor], nargs: dict[str, Any]) -> torch.Tensor:
    """Dense fp32 weight [out, in] from one layer's native GPTQ or AWQ GEMM tensors:
    W = (q - zero) * scale per group, decoded from the bits here, not by the engine."""
    import torch

    bits, scale = nargs["bits"], t["scales"].float()  # [groups, out]
    qw, qz = t["qweight"], t["qzeros"]
    if nargs["method"] == "gptq":  # qweight [in*bits/32, out], standard bit order
        in_f, out_f = qw.shape[0] * 32 // bits, qw.shape[1]
        q = _unpack(qw, bits, in_f, 0)  # [in, out]
        z = _unpack(qz, bits, out_f, 1) + nargs["zero_offset"]  # [groups, out]
    else:  # AWQ GEMM: qweight [in, out*bits/32], packed along the output in AWQ order
        in_f, out_f = qw.shape[0], qw.shape[1] * 32 // bits
        order = torch.tensor(_AWQ_POSITION)
        q = _unpack(qw, bits, out_f, 1).reshape(in_f, -1, 8)[:, :, order].reshape(in_f, out_f)
        z = _unpack(qz, bits, out_f, 1).reshape(qz.shape[0], -1, 8)[:, :, order].reshape(
            qz.shape[0], out_f)
    gs = nargs["group_size"] if nargs["group_size"] > 0 else in_f
    g_idx = t.get("g_idx")
    rows = g_idx.long() if g_idx is not None else torch.arange(in_f) // gs
    return ((q.float() - z.float()[rows]) * scale[rows]).T.contiguous()


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


def _fake_quant_hook(aargs: dict[str, Any], input_scale: torch.Tensor | None) -> Any:
    """Forward pre-hook quantizing a Linear's input as the scheme says (our own version)."""
    import torch

    bits, kind = int(aargs["num_bits"]), aargs.get("type", "int")
    # compressed-tensors' symmetric scale is amax / ((q_max - q_min) / 2): 448 for FP8, 127.5
    # for INT8 (vLLM's int8 kernel divides by 127: one source of engine difference).
    qmax = 448.0 if kind == "float" else ((1 << bits) - 1) / 2
    lo, hi = (-qmax, qmax) if kind == "float" else (-(1 << (bits - 1)), (1 << (bits - 1)) - 1)

    def hook(_mod: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        if aargs.get("dynamic") and aargs.get("strategy") == "token":
            s = x.abs().amax(dim=-1, keepdim=True) / qmax
        elif aargs.get("dynamic"):
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


def layer_groups(model: Any, qc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Which config group quantizes each layer; later groups win, as compressed-tensors
    applies them in order."""
    from compressed_tensors.utils import match_named_modules

    out: dict[str, dict[str, Any]] = {}
    for group in (qc.get("config_groups") or {}).values():
        for name, _ in match_named_modules(model, group["targets"], qc.get("ignore") or []):
            out[name] = group
    return out


def build_reference(ckpt: Path, config: dict[str, Any]) -> tuple[Any, dict[str, torch.Tensor]]:
    """A plain dense transformers model holding our own decode of the checkpoint, with our
    own activation-quantization hooks. Returns (model, decoded weights by layer name)."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    qc = config["quantization_config"]
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    cfg = AutoConfig.for_model(plain.pop("model_type"), **plain)
    from transformers.initialization import no_init_weights

    with no_init_weights():  # every weight is loaded below; random init would be wasted
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    raw: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            raw.update({k: fh.get_tensor(k) for k in fh.keys()})  # noqa: SIM118
    state: dict[str, torch.Tensor] = {}
    decoded: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    from quantize.backends._native import NATIVE_METHODS

    if qc.get("quant_method") in NATIVE_METHODS:  # GPTQ/AWQ: every layer with a qweight
        nargs = native_args(qc)
        for name in sorted(k[: -len(".qweight")] for k in raw if k.endswith(".qweight")):
            t = {k[len(name) + 1:]: v for k, v in raw.items() if k.startswith(name + ".")}
            decoded[name] = state[name + ".weight"] = decode_native(t, nargs)
            if t.get("bias") is not None:
                state[name + ".bias"] = t["bias"].float()
    for name, group in layer_groups(model, qc).items():
        mod = modules[name]
        if not isinstance(mod, torch.nn.Linear):
            continue
        t = {k[len(name) + 1:]: v for k, v in raw.items() if k.startswith(name + ".")}
        w = decode_weight(t, group["weights"])
        decoded[name] = w
        state[name + ".weight"] = w
        if t.get("bias") is not None:
            state[name + ".bias"] = t["bias"].float()
        acts = group.get("input_activations")
        if acts:
            mod.register_forward_pre_hook(_fake_quant_hook(acts, t.get("input_scale")))
    quant_prefixes = tuple(n + "." for n in decoded)
    for k, v in raw.items():
        if not k.startswith(quant_prefixes) and v.is_floating_point():
            state[k] = v.float()
    missing, _unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing:
        raise VerifyError(f"{ckpt}: the reference decode found no tensor for {missing[:3]}; "
                          "the checkpoint is incomplete - re-run the export")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model, decoded


def _weight_bits(config: dict[str, Any]) -> int:
    qc = config.get("quantization_config") or {}
    native = qc.get("bits") or qc.get("w_bit")  # native GPTQ/AWQ
    if native:
        return int(native)
    groups = qc.get("config_groups") or {}
    return min((int(g["weights"]["num_bits"]) for g in groups.values()), default=16)


def _column_cosine(w: torch.Tensor, d: torch.Tensor) -> float:
    """Cosine of each input column of `w` with `d`'s, combined weighted by the column's energy
    in `w`: invariant to per-input-channel rescaling (AWQ, SmoothQuant), and columns such
    rescaling shrank to nearly nothing (coarsely quantized, harmless) barely count."""
    import torch

    cos = torch.nn.functional.cosine_similarity(w, d, dim=0).clamp(min=0)
    energy = (w * w).sum(dim=0)
    return float(torch.sqrt((energy * cos * cos).sum() / energy.sum().clamp_min(1e-30)))


def weight_similarity(decoded: dict[str, torch.Tensor], src: Path) -> tuple[float, str]:
    """(the worst layer's energy-weighted column cosine with the source weights, that layer)."""
    from safetensors import safe_open

    worst = (1.0, "")
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            keys = set(fh.keys())
            for name, w in decoded.items():
                if name + ".weight" not in keys:
                    continue
                d = fh.get_tensor(name + ".weight").float()
                c = _column_cosine(w, d) if d.shape == w.shape else 0.0
                if not c >= worst[0]:
                    worst = (c, name)
    return worst


def verify_decode(ckpt: Path, config: dict[str, Any], tol: DecodeTolerance) -> dict[str, Any]:
    """Fallback: compressed-tensors' (or, for native GPTQ/AWQ, GPTQModel's) decode vs ours,
    plus the weights against the source."""

    t0 = time.perf_counter()
    cand = load_hf(ckpt)
    ref, decoded = build_reference(ckpt, config)
    worst = ("", 0.0)
    modules = dict(cand.named_modules())
    for name, w in decoded.items():
        cw = effective_weight(modules[name])
        rel = float((cw - w).abs().max() / w.abs().max().clamp_min(1e-12))
        if rel > worst[1] or not math.isfinite(rel):
            worst = (name, rel)
    ids = eval_text_ids(ckpt)
    lc, lr = log_probs(cand, ids), log_probs(ref, ids)
    dl = (lc - lr).abs().amax(dim=-1).flatten().tolist()  # whole distributions, every step
    src = source_model(ckpt)
    cos, cos_layer = weight_similarity(decoded, src) if src is not None else (None, "")
    bits = _weight_bits(config)
    floor = next((f for b, f in tol.cosine_floor if bits >= b), tol.cosine_floor[-1][1])
    metrics: dict[str, Any] = {
        "layers_decoded": len(decoded), "worst_weight_rel_diff": round(worst[1], 7),
        "worst_weight_layer": worst[0],
        "mean_abs_dlogprob": round(sum(dl) / max(len(dl), 1), 6),
        "max_abs_dlogprob": round(max(dl, default=0.0), 6),
        "source_model": str(src) if src else None,
        "source_cosine_min": round(cos, 4) if cos is not None else None,
        "source_cosine_layer": cos_layer, "source_cosine_floor": floor, "weight_bits": bits,
    }
    failures = []
    if not decoded:
        failures.append("no quantized layer found to decode")
    if not worst[1] <= tol.weight_rel:
        failures.append(f"layer {worst[0]}: the loader's weights differ from the stored "
                        f"integers × scales by {worst[1]:.2e} (relative)")
    if metrics["mean_abs_dlogprob"] > tol.mean_abs_dlogprob or \
            metrics["max_abs_dlogprob"] > tol.max_abs_dlogprob:
        failures.append(f"logits differ: mean |Δlogprob| {metrics['mean_abs_dlogprob']:.2e}, "
                        f"max {metrics['max_abs_dlogprob']:.2e}")
    if cos is not None and not cos >= floor:
        failures.append(f"layer {cos_layer}: decoded weights have cosine {cos:.3f} with the "
                        f"source model's (< {floor} expected for {bits}-bit weights): the "
                        "stored weights look corrupt")
    metrics["failures"] = failures
    return {"verdict": "fail" if failures else "pass", "metrics": metrics,
            "tolerance": {k: v for k, v in tol.__dict__.items()},
            "reference_s": round(time.perf_counter() - t0, 2),
            **({"error": "decode check failed: " + "; ".join(failures)} if failures else {})}


# --- the stage ------------------------------------------------------------------------------
def run(checkpoint: Path, out: Path, *, tp: int = 1, kv_cache_dtype: str = "auto",
        vllm_python: str | Path | None = None, level: str = "auto", timeout_s: float = 900,
        thresholds: Thresholds | None = None,
        tolerance: DecodeTolerance | None = None) -> dict[str, Any]:
    """Verify `checkpoint` (an export folder), writing verify.json/verify.md and logs into
    `out`. Returns the summary; `verdict` is pass or fail, `level` vllm or decode."""
    if level not in ("auto", "vllm", "decode"):
        raise VerifyError(f"unknown level {level!r}; use auto, vllm or decode")
    if tp < 1:
        raise VerifyError(f"--tp {tp}: tensor parallelism needs a positive integer")
    t0 = time.perf_counter()
    config = read_config(checkpoint)
    fmt = capabilities.checkpoint_format(config)
    host = capabilities.detect(vllm_python) if level != "decode" else \
        capabilities.Host(None, problem="the decode level was asked for (--level decode)")
    support = capabilities.supported(fmt, host, kv_cache_dtype)
    if host.device == "cpu" and tp > 1 and support.ok:
        support = capabilities.Support(False, f"not verifiable on this host: --tp {tp} on the "
                                       "CPU backend needs a core set per rank; use a GPU host "
                                       "or --level vllm to try anyway")
    if level == "vllm" and (host.vllm_python is None or host.problem):
        raise VerifyError(f"--level vllm: {host.problem}")
    use_vllm = support.ok or level == "vllm"
    summary: dict[str, Any] = {
        "checkpoint": str(checkpoint.resolve()), "format": fmt.label,
        "host": host.describe(), "tp": tp, "kv_cache_dtype": kv_cache_dtype,
        # which export this is about: its manifest lists the sha256 of every file
        "export_manifest_sha256": sha256_file(checkpoint / "manifest.json")
        if (checkpoint / "manifest.json").is_file() else None,
    }
    if use_vllm:
        summary["level"] = "vllm"
        if not support.ok:  # --level vllm: the rules may be stale, the load is the proof
            summary["rules_said"] = support.reason
        summary.update(verify_vllm(checkpoint, out, host, tp=tp, kv_cache_dtype=kv_cache_dtype,
                                   timeout_s=timeout_s, th=thresholds or Thresholds()))
    else:
        summary["level"] = "decode"
        summary["why_not_vllm"] = support.reason
        summary.update(verify_decode(checkpoint, config, tolerance or DecodeTolerance()))
    summary["passed"] = summary["verdict"] == "pass"  # what publish and the model card read
    summary["result"] = one_line(summary)
    summary["duration_s"] = round(time.perf_counter() - t0, 2)
    atomic_write_json(out / "verify.json", summary)
    atomic_write_text(out / "verify.md", render(summary))
    return summary


def verify(checkpoint: Path, **kwargs: Any) -> dict[str, Any]:
    """Library entry: a run folder gets <run>/verify/ (complete or absent); a bare checkpoint
    gets `out=` or <checkpoint>/../<name>-verify/."""
    ckpt, run_dir = resolve_target(Path(checkpoint))
    out = kwargs.pop("out", None)
    final = Path(out) if out else (run_dir / NAME if run_dir else
                                   ckpt.parent / f"{ckpt.name}-verify")
    with atomic_dir(final) as tmp:
        summary = run(ckpt, tmp, **kwargs)
    summary["out"] = str(final)
    return summary


def one_line(s: dict[str, Any]) -> str:
    """The result in one sentence (the model card shows it)."""
    m = s.get("metrics") or {}
    if s.get("error"):
        return str(s["error"])
    if s["level"] == "vllm":
        v = s.get("vllm") or {}
        return (f"vLLM {v.get('vllm_version')} loaded it ({v.get('quantization')}, "
                f"{v.get('dtype')}); greedy agreement with transformers "
                f"{m.get('agreement', 0):.1%} over {m.get('steps')} steps, mean |Δlogprob| "
                f"{m.get('mean_abs_dlogprob')} nats")
    return (f"not loadable in this host's vLLM; decoded independently of the loader: "
            f"max weight difference {m.get('worst_weight_rel_diff')} (relative), max "
            f"|Δlogprob| {m.get('max_abs_dlogprob')}; worst layer's cosine with the source "
            f"weights {m.get('source_cosine_min')}")


def render(s: dict[str, Any]) -> str:
    """verify.md: the verdict, the level and why, the numbers, how to serve it."""
    lines = [f"# verify: {s['verdict'].upper()} ({s['level']} level)", "",
             f"- checkpoint: `{s['checkpoint']}`", f"- format: {s['format']}",
             f"- host: {s['host']}"]
    if s.get("why_not_vllm"):
        lines.append(f"- vLLM check skipped: {s['why_not_vllm']}")
    if s.get("error"):
        lines.append(f"- error: {s['error']}")
    v = s.get("vllm") or {}
    if v:
        lines.append(f"- vLLM {v.get('vllm_version')}: quantization `{v.get('quantization')}`, "
                     f"dtype {v.get('dtype')}, load {v.get('load_s')} s, "
                     f"generate {v.get('generate_s')} s")
        for kind in ("linear", "attention"):
            for key, e in ((v.get("layers") or {}).get(kind) or {}).items():
                if isinstance(e, dict):
                    lines.append(f"  - {kind}: `{key}` × {e['count']} (e.g. {e['example']})")
    m = s.get("metrics") or {}
    if m:
        lines += ["", "| metric | value |", "| --- | --- |"]
        lines += [f"| {k} | {val} |" for k, val in m.items()
                  if k not in ("failures", "non_tie_disagreements")]
    if s.get("serve_command"):
        lines += ["", "Reproduce the load:", "", "```", s["serve_command"], "```"]
    return "\n".join(lines) + "\n"
