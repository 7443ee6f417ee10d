"""The fallback level, for formats this host's vLLM cannot run: the loader's decode
(transformers + compressed-tensors, or GPTQModel for native GPTQ/AWQ) against our own
(quantize.model.decode), both fp32 on the same integers and scales, plus the decoded weights
against the source model's, to catch a decode that is consistent but wrong."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from quantize.errors import VerifyError
from quantize.model import decode, moe_load, transforms
from quantize.model.config import ModelConfig
from quantize.model.moe import config_is_moe
from quantize.model.qconfig import read_quant_config
from quantize.stages.verify.result import DecodeMetrics, LevelResult
from quantize.stages.verify.scoring import load_hf, log_probs
from quantize.stages.verify.target import source_model

if TYPE_CHECKING:
    import torch


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


def eval_text_ids(ckpt: Path, n: int = 4, length: int = 64) -> torch.Tensor:
    """[n, length] token ids of real text (the shipped wiki eval passages) for the decode
    level's teacher-forced comparisons: one batched forward per model, no generation."""
    import torch
    from transformers import AutoTokenizer

    from quantize.recipe.texts import BUILTIN_TEXT

    tok = AutoTokenizer.from_pretrained(ckpt)
    rows = []
    for line in BUILTIN_TEXT["wiki-eval"].read_text(encoding="utf-8").splitlines():
        ids = tok(line.strip())["input_ids"]
        if len(ids) >= length:
            rows.append(ids[:length])
        if len(rows) == n:
            break
    return torch.tensor(rows)


def verify_decode(ckpt: Path, config: ModelConfig, tol: DecodeTolerance) -> LevelResult:
    """Fallback: compressed-tensors' (or, for native GPTQ/AWQ, GPTQModel's) decode vs ours,
    plus the weights against the source."""
    t0 = time.perf_counter()
    quant = read_quant_config(config)
    if quant is not None and quant.native and config_is_moe(config):
        raise VerifyError(
            path=ckpt,
            problem=f"the exact decode has no loader for native {quant.method.upper()} "
            "mixture-of-experts checkpoints: transformers 5.17 fuses the experts into 3-D "
            "tensors its GPTQ/AWQ loader never fills (they stay at random init: cosine 0.002 "
            "with the stored weights on the tiny Qwen3-MoE), and GPTQModel's own loader rounds "
            "the scales to bf16 (2.8e-3 per weight, up to 1.19 nats)",
            hint="verify it in vLLM on a GPU, or use the compressed-tensors recipe (gptq-int4, "
                 "awq-int4), which this check covers")
    cand = load_hf(ckpt)
    ref, decoded = decode.build_reference(ckpt, config)
    worst = ("", 0.0)
    modules = dict(cand.named_modules())
    for name, w in decoded.items():
        cw = decode.effective_weight(modules[name])
        rel = float((cw - w).abs().max() / w.abs().max().clamp_min(1e-12))
        if rel > worst[1] or not math.isfinite(rel):
            worst = (name, rel)
    ids = eval_text_ids(ckpt)
    lc, lr = log_probs(cand, ids), log_probs(ref, ids)
    dl = (lc - lr).abs().amax(dim=-1).flatten().tolist()  # whole distributions, every step
    src = source_model(ckpt)
    rename = moe_load.model_namer(ref)  # the source's names, in the decoded model's terms
    cos, cos_layer = (decode.weight_similarity(transforms.unrotated(ref, decoded), src, rename)
                      if src is not None else (None, ""))
    bits = (quant.weight_bits if quant else None) or 16
    floor = next((f for b, f in tol.cosine_floor if bits >= b), tol.cosine_floor[-1][1])
    metrics = DecodeMetrics(
        layers_decoded=len(decoded), worst_weight_rel_diff=round(worst[1], 7),
        worst_weight_layer=worst[0],
        mean_abs_dlogprob=round(sum(dl) / max(len(dl), 1), 6),
        max_abs_dlogprob=round(max(dl, default=0.0), 6),
        source_model=str(src) if src else None,
        source_cosine_min=round(cos, 4) if cos is not None else None,
        source_cosine_layer=cos_layer, source_cosine_floor=floor, weight_bits=bits,
    )
    failures = []
    if not decoded:
        failures.append("no quantized layer found to decode")
    if not worst[1] <= tol.weight_rel:
        failures.append(f"layer {worst[0]}: the loader's weights differ from the stored "
                        f"integers × scales by {worst[1]:.2e} (relative)")
    if metrics.mean_abs_dlogprob > tol.mean_abs_dlogprob or \
            metrics.max_abs_dlogprob > tol.max_abs_dlogprob:
        failures.append(f"logits differ: mean |Δlogprob| {metrics.mean_abs_dlogprob:.2e}, "
                        f"max {metrics.max_abs_dlogprob:.2e}")
    if cos is not None and not cos >= floor:
        failures.append(f"layer {cos_layer}: decoded weights have cosine {cos:.3f} with the "
                        f"source model's (< {floor} expected for {bits}-bit weights): the "
                        "stored weights look corrupt")
    metrics.failures = failures
    result = LevelResult(verdict="fail" if failures else "pass", metrics=metrics,
                         tolerance=dict(tol.__dict__),
                         reference_s=round(time.perf_counter() - t0, 2))
    if failures:
        result.error = "decode check failed: " + "; ".join(failures)
    return result
