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

from quantize.fit.units import Choice, Unit, Units
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
    low_only: bool = False  # only the lowest precision measured, the rest by the 4^-bits law
    samples: int = 1  # the tokens spread over this many calibration samples (their starts)
    observer: str = "minmax"  # the weight observer whose ranges the rounding uses


Costs = dict[str, dict[int, float]]


def _args(scheme: str, group: int | None, observer: str | None = None) -> Any:
    """The compressed-tensors QuantizationArgs of a scheme's weights at `group`."""
    from compressed_tensors.quantization import QuantizationArgs

    from quantize.recipe.schemes import SCHEMES

    info_ = SCHEMES[scheme]
    strategy = {"strategy": "group", "group_size": group} if group else {"strategy": "channel"}
    return QuantizationArgs(num_bits=info_.weight_bits, type="int", symmetric=info_.symmetric,
                            observer=observer, **strategy)


def _fake_quant(w: Any, scheme: str, group: int | None, observer: Any = None) -> Any:
    """RTN of one weight with compressed-tensors' qparams and fake_quantize, grouped along
    the input dimension as the export stores it: min-max ranges, or the ranges `observer`
    (an llm-compressor observer of the recipe's kind) chooses."""
    import torch
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    if observer is not None:
        observer(w)
        qp = observer.get_qparams()
        return fake_quantize(w, qp["scale"], qp["zero_point"], observer.args)
    args = _args(scheme, group)
    if group:
        g = w.reshape(w.shape[0], -1, group)
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    else:
        lo, hi = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    zero = torch.zeros_like(lo)
    scale, zp = calculate_qparams(torch.minimum(lo, zero), torch.maximum(hi, zero), args)
    return fake_quantize(w, scale, zp, args)


# the recipe's weight observer -> the llm-compressor observer that stands in for it here (the
# names llm-compressor's calibration maps weights to); min-max is the plain path above
_OBSERVERS = {"mse": "memoryless_mse", "imatrix_mse": "imatrix_mse"}


def _observers(modules: dict[str, Any], todo: list[tuple[Unit, Choice]],
               observer: str | None) -> dict[tuple[str, str], Any]:
    """One llm-compressor weight observer per measured (layer, scheme), attached to its layer
    so that an importance-weighted one (imatrix_mse) collects E[x^2] on the reference pass."""
    name = _OBSERVERS.get(observer or "")
    if name is None:
        return {}
    from llmcompressor.observers import Observer

    out: dict[tuple[str, str], Any] = {}
    for u, c in todo:
        assert c.scheme is not None
        for n in u.layers:
            obs = Observer.load_from_registry(name, base_name="weight",
                                              args=_args(c.scheme, c.group_size, observer))
            obs.attach(modules[n])
            out[(n, c.scheme)] = obs
    return out


def _kl(ref_logp: Any, logits: Any) -> float:
    logp = Replay._logp(logits)
    return float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean())


def measure(model_path: Path, units: Units, tokens: list[list[int]], n_tokens: int,
            cache: Path, key: SensitivityKey, device: str = "cpu") -> Costs:
    """KL per unit and precision (16-bit: 0), from the cache when its key matches. The key
    also says how: the tokens from `key.samples` samples, rounded with `key.observer`'s ranges.

    With `key.low_only`, only each unit's lowest precision is measured and a higher one costs
    that times 4^-(extra bits): the rate-distortion law `prior` uses, which the measured
    8-bit costs follow on the default model (8-bit/4-bit median 1/213 against the law's 1/256,
    range 1/316 to 1/88 over its 120 units), so the knapsack's gains (cost at 4 bits minus
    cost at 8) stay within 1 % while half the forward passes are left out."""
    if cache.is_file():
        data = json.loads(cache.read_text())
        if data.get("key") == asdict(key):
            info(f"sensitivity: reused {cache} (same model, calibration and settings)")
            return {u: {int(b): float(v) for b, v in d.items()} for u, d in data["costs"].items()}
    import torch
    from transformers import AutoModelForCausalLM

    samples = key.samples
    observer = None if key.observer == "minmax" else key.observer
    seq = max(len(t) for t in tokens)
    if samples > 1:  # the first n_tokens/samples of each of the first `samples` samples
        per = min(seq, max(1, n_tokens // samples))
        rows_ = [t[:per] for t in tokens if len(t) >= per][:samples]
        ids = torch.tensor(rows_ or [tokens[0][:n_tokens]])
    elif n_tokens < seq:  # less than one sample: its first n_tokens
        ids = torch.tensor([tokens[0][:n_tokens]])
    else:
        rows = max(1, min(len(tokens), -(-n_tokens // seq)))
        ids = torch.tensor([t[:seq] for t in tokens[:rows] if len(t) >= seq][:rows] or
                           [tokens[0]])
    # fp32 on the CPU (the pipeline's CPU numerics), the model's 16-bit dtype on a GPU
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model = model.to(device)
    model.eval()
    ids = ids.to(device)
    modules = dict(model.named_modules())
    costs: Costs = {}
    todo = [(u, c) for u in units.units for c in _measured(u, key.low_only)]
    with torch.inference_mode(), step(f"sensitivity: {len(todo)} quantized forward passes over "
                                      f"{ids.numel()} calibration tokens"):
        observers = _observers(modules, todo, observer)
        try:
            replay = Replay(model, ids)
        finally:
            for (n, _), obs in observers.items():
                obs.detach(modules[n])
        for u in units.units:
            costs[u.name] = {}
            measured = _measured(u, key.low_only)
            for c in u.choices:
                if c.scheme is None:
                    costs[u.name][c.bits] = 0.0
                    continue
                if c not in measured:
                    low = measured[0]
                    costs[u.name][c.bits] = costs[u.name][low.bits] * 4.0 ** (low.bits - c.bits)
                    continue
                saved = {n: modules[n].weight.data.clone() for n in u.layers}
                for n in u.layers:
                    modules[n].weight.data = _fake_quant(saved[n], c.scheme, c.group_size,
                                                         observers.get((n, c.scheme)))
                costs[u.name][c.bits] = max(0.0, _kl(replay.ref, replay.logits(u.layers)))
                for n in u.layers:
                    modules[n].weight.data = saved[n]
    del model, replay
    if device != "cpu":
        torch.cuda.empty_cache()
    cache.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(cache, {"key": asdict(key), "version": VERSION, "tokens": int(ids.numel()),
                              "measure": "KL(fp || unit quantized RTN), nats/token",
                              "costs": costs})
    return costs


class Replay:
    """The model's logits on `ids` with some weights changed, recomputed from the first
    decoder layer the change touches: the reference pass keeps each decoder layer's input
    (hidden states and keyword arguments, no KV cache), so a unit in layer i runs layers i..n,
    the final norm and the head, not the whole model (half of the decoder on average). A
    model without the usual `model.layers` / `model.norm` / output-embedding layout runs whole
    forwards instead. tests/unit/fit/test_sensitivity.py checks both give the same logits."""

    def __init__(self, model: Any, ids: Any) -> None:
        self.model, self.ids = model, ids
        inner = getattr(model, "model", None)
        self.layers: Any = getattr(inner, "layers", None)
        self.norm: Any = getattr(inner, "norm", None)
        self.head: Any = model.get_output_embeddings()
        self.inputs: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        if self.layers is None or self.norm is None or self.head is None:
            self.layers = None
            self.ref = self._logp(model(ids, use_cache=False).logits)
            return

        def keep(_mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self.inputs.append((args, kwargs))

        hooks = [layer.register_forward_pre_hook(keep, with_kwargs=True)
                 for layer in self.layers]
        try:
            self.ref = self._logp(model(ids, use_cache=False).logits)
        finally:
            for h in hooks:
                h.remove()
        if len(self.inputs) != len(self.layers):  # a layer ran twice or not at all
            self.layers = None

    @staticmethod
    def _logp(logits: Any) -> Any:
        import torch

        return torch.log_softmax(logits.float(), dim=-1)

    def logits(self, changed: tuple[str, ...]) -> Any:
        blocks = [_block(n) for n in changed]
        if self.layers is None or not blocks or None in blocks:
            return self.model(self.ids, use_cache=False).logits
        first = min(b for b in blocks if b is not None)
        args, kwargs = self.inputs[first]
        hidden = args[0] if args else kwargs["hidden_states"]
        for layer, (a, kw) in zip(self.layers[first:], self.inputs[first:], strict=True):
            out = layer(hidden, *a[1:], **{k: v for k, v in kw.items() if k != "hidden_states"})
            hidden = out[0] if isinstance(out, tuple) else out
        return self.head(self.norm(hidden))


def _block(name: str) -> int | None:
    """The decoder layer a module is in (`model.layers.<i>.`), None outside one."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def _measured(unit: Unit, low_only: bool) -> list[Choice]:
    """The choices whose cost a forward pass measures (lowest precision first)."""
    quantized = [c for c in unit.choices if c.scheme is not None]
    return quantized[:1] if low_only else quantized


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
