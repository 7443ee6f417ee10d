"""Per-unit sensitivity, measured on the calibration data: the KL divergence of the model's
next-token distribution when only that unit's weights are quantized (round-to-nearest at the
candidate scheme and group size, by compressed-tensors' own qparams and fake-quantize), the
rest kept at full precision.

Why this measure: the quantity the gate judges is perplexity recovery, ppl_fp / ppl_q =
exp(-(CE_q - CE_fp)), and the expected CE increase of a small perturbation of a model that
fits its data is its KL from the unperturbed model. KL is non-negative and far less noisy
than the CE change itself on a few hundred tokens. Summing the units' KLs (the additivity
assumption every per-layer mixed-precision method makes, HAWQ-V3 included) gives the
predicted recovery exp(-sum KL). RTN stands in for GPTQ: GPTQ lowers every layer's error,
and the knapsack needs the ranking, which RTN's error preserves (HAWQ's perturbation is RTN
too). The result is cached in the run folder (fit/sensitivity.json) under the calibration
fingerprint, the model fingerprint and the settings, and reused while they match.

With no weights (a built-in config for --dry-run) there is nothing to measure: `prior`
gives the data-free ranking llama.cpp's k-quant mixes use (src/llama-quant.cpp: more bits to
attn_v and ffn_down, most in the first and last eighth of the blocks), scaled by the
rate-distortion law (noise power x 4^-bits per weight). It is labelled a prior everywhere.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from quantize.fit.units import Units
from quantize.progress import info, step
from quantize.run.files import atomic_write_json

VERSION = 1


@dataclass(frozen=True)
class SensitivityKey:
    """What a sensitivity.json was measured on; it is reused only when all of it matches."""

    calibration: str  # the calibration stage's fingerprint
    model: str  # the model's fingerprint
    scheme: str
    group: int | None
    bits: list[int]
    tokens: int
    version: int
Costs = dict[str, dict[int, float]]


def _fake_quant(w: Any, scheme: str, group: int | None) -> Any:
    """RTN of one weight with compressed-tensors' qparams (min-max observer) and
    fake_quantize, grouped along the input dimension as the export stores it."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    from quantize.spec.schemes import SCHEMES

    info_ = SCHEMES[scheme]
    if group:
        args = QuantizationArgs(num_bits=info_.weight_bits, type="int",
                                symmetric=info_.symmetric, strategy="group", group_size=group)
        g = w.reshape(w.shape[0], -1, group)
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    else:
        args = QuantizationArgs(num_bits=info_.weight_bits, type="int",
                                symmetric=info_.symmetric, strategy="channel")
        lo, hi = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    zero = torch.zeros_like(lo)
    scale, zp = calculate_qparams(torch.minimum(lo, zero), torch.maximum(hi, zero), args)
    return fake_quantize(w, scale, zp, args)


def _kl(ref_logp: Any, logits: Any) -> float:
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    return float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean())


def measure(model_path: Path, units: Units, tokens: list[list[int]], n_tokens: int,
            cache: Path, key: SensitivityKey) -> Costs:
    """KL per unit and precision (16-bit: 0), from the cache when its key matches."""
    if cache.is_file():
        data = json.loads(cache.read_text())
        if data.get("key") == asdict(key):
            info(f"sensitivity: reused {cache} (same model, calibration and settings)")
            return {u: {int(b): float(v) for b, v in d.items()} for u, d in data["costs"].items()}
    import torch
    from transformers import AutoModelForCausalLM

    seq = max(len(t) for t in tokens)
    rows = max(1, min(len(tokens), -(-n_tokens // seq)))
    ids = torch.tensor([t[:seq] for t in tokens[:rows] if len(t) >= seq][:rows] or
                       [tokens[0]])
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.eval()
    modules = dict(model.named_modules())
    costs: Costs = {}
    todo = [(u, c) for u in units.units for c in u.choices if c.scheme is not None]
    with torch.inference_mode(), step(f"sensitivity: {len(todo)} quantized forward passes over "
                                      f"{ids.numel()} calibration tokens"):
        ref = torch.log_softmax(model(ids).logits.float(), dim=-1)
        for u in units.units:
            costs[u.name] = {}
            for c in u.choices:
                if c.scheme is None:
                    costs[u.name][c.bits] = 0.0
                    continue
                saved = {n: modules[n].weight.data.clone() for n in u.layers}
                for n in u.layers:
                    modules[n].weight.data = _fake_quant(saved[n], c.scheme, c.group_size)
                costs[u.name][c.bits] = max(0.0, _kl(ref, model(ids).logits))
                for n in u.layers:
                    modules[n].weight.data = saved[n]
    cache.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(cache, {"key": asdict(key), "version": VERSION, "tokens": int(ids.numel()),
                              "measure": "KL(fp || unit quantized RTN), nats/token",
                              "costs": costs})
    return costs


_BLOCK = re.compile(r"\.(\d+)\.")


def prior(units: Units, n_blocks: int) -> Costs:
    """The data-free ranking (no weights): llama.cpp's k-quant emphasis, rate-distortion
    scaled. Units of arbitrary scale: no recovery is predicted from it."""
    out: Costs = {}
    for u in units.units:
        m = _BLOCK.search(u.name)
        i = int(m.group(1)) if m else 0
        edge = i < n_blocks / 8 or i >= 7 * n_blocks / 8
        weight = (2.0 if ("v_proj" in u.name or "down_proj" in u.name) else 1.0) * (
            2.0 if edge else 1.0)
        out[u.name] = {c.bits: 0.0 if c.scheme is None else weight * u.params * 4.0 ** -c.bits
                       for c in u.choices}
    return out
