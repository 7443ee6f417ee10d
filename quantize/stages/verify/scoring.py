"""The transformers side of verify: load the checkpoint as transformers runs it (fp32), score
token sequences teacher-forced, and compare vLLM's choices with transformers' scores."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantize.errors import VerifyError, first_line
from quantize.model.config import read_config
from quantize.model.decode import load_dequantized
from quantize.model.moe import config_is_moe, load_linearized
from quantize.model.moe_load import per_token_inputs
from quantize.model.qconfig import read_quant_config
from quantize.stages.verify.result import AgreementMetrics, Tie
from quantize.vllm.protocol import Generated

if TYPE_CHECKING:
    import torch


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


def load_hf(ckpt: Path) -> Any:
    """The checkpoint in transformers, decompressed to fp32 by compressed-tensors (which also
    applies the scheme's activation quantization in forward, per token where the scheme says
    so); a native GPTQ/AWQ checkpoint runs on GPTQModel's kernels in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    from quantize.backends._native import native_load

    quant = read_quant_config(read_config(ckpt))
    loading: Any = native_load(quant.method) if quant and quant.native else \
        contextlib.nullcontext()
    try:
        with loading:
            config = read_config(ckpt)
            if quant and not quant.native and config_is_moe(config):
                # one Linear per expert, as stored and as our decode builds it; transformers
                # re-fuses them (and drops asymmetric zero points): quantize/model/moe.py
                model = load_linearized(ckpt, config)
            elif quant and not quant.native:
                model = load_dequantized(ckpt, dtype=torch.float32)
                per_token_inputs(model)  # whatever the input's shape (MLA's 4-D latent)
            else:
                model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:  # incl. NotImplementedError
        first = first_line(exc)
        raise VerifyError(problem=f"transformers cannot load {ckpt}: {type(exc).__name__}: "
                                  f"{first}") from exc
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


def log_probs(model: Any, ids: torch.Tensor) -> torch.Tensor:
    import torch

    with torch.no_grad():
        return torch.log_softmax(model(ids).logits.float(), dim=-1)


def compare(vllm_outputs: list[Generated], hf_rows: list[torch.Tensor],
            th: Thresholds) -> AgreementMetrics:
    """Per-step agreement and log-prob differences, pooled over prompts."""
    outputs = [Generated.model_validate(o) for o in vllm_outputs]  # the worker's JSON, too
    steps = agree = 0
    dlp: list[float] = []
    first_div: list[int] = []
    bad_ties: list[Tie] = []
    for p, (out, rows) in enumerate(zip(outputs, hf_rows, strict=True)):
        div = len(out.steps)
        for i, st in enumerate(out.steps):
            tok = st.token
            row = rows[i]
            hf_top = int(row.argmax())
            lp_hf = float(row[tok])
            steps += 1
            dlp.append(abs(st.logprob - lp_hf))
            if hf_top == tok:
                agree += 1
                continue
            div = min(div, i)
            gap = float(row[hf_top]) - lp_hf
            if gap > th.tie_margin:
                bad_ties.append(Tie(prompt=p, step=i, vllm_token=tok, hf_token=hf_top,
                                    gap_nats=round(gap, 3)))
        first_div.append(div)
    mean_d = sum(dlp) / max(len(dlp), 1)
    agreement = round(agree / max(steps, 1), 4)
    metrics = AgreementMetrics(
        steps=steps, agreement=agreement,
        mean_abs_dlogprob=round(mean_d, 4), max_abs_dlogprob=round(max(dlp, default=0), 4),
        greedy_prefix_match=first_div, prompts_fully_matching=sum(
            d == len(o.steps) for d, o in zip(first_div, outputs, strict=True)),
        non_tie_disagreements=bad_ties[:10],
    )
    failures = []
    if agreement < th.min_agreement:
        failures.append(f"greedy agreement {agreement:.2%} < "
                        f"{th.min_agreement:.0%}")
    if mean_d > th.max_mean_abs_dlogprob:
        failures.append(f"mean |Δlogprob| {mean_d:.3f} > {th.max_mean_abs_dlogprob} nats")
    if bad_ties:
        failures.append(f"{len(bad_ties)} disagreement(s) are not near-ties (e.g. prompt "
                        f"{bad_ties[0].prompt} step {bad_ties[0].step}: transformers "
                        f"rates vLLM's token {bad_ties[0].gap_nats} nats below its own)")
    metrics.failures = failures
    return metrics
