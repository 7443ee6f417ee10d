"""Consumer agreement: the export loaded the way each consumer loads it (plain transformers
`from_pretrained`, lm-eval's `hf` model, transformers plus the card's transform snippet),
its next-token distributions compared with the project's reference decode on the same token
windows. The consumers and the agreement they must show: quantize/recipe/consumers.py.

The reference is the model the eval scores (quantize.model.decode's dequantized load, online
transforms attached): its top-k log-probabilities at each position are kept, each consumer's
KL from them is the coarsened KL of the `kl_divergence` metric (a lower bound of the full KL,
quantize/metrics/divergence.py), and top-1 agreement compares the most likely tokens.
A consumer that cannot load the export at all fails with the loader's own first line.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from quantize.errors import first_line
from quantize.metrics.divergence import coarse_kl
from quantize.recipe.consumers import CONSUMERS, MAX_KL, row_name
from quantize.recipe.texts import BUILTIN_EVAL_TEXT
from quantize.run.results import MetricRow

# Two windows of 512 tokens of the eval text: 1,022 scored positions, a few seconds a consumer
# on the default model's CPU path.
WINDOWS = 2
SEQ_LEN = 512
TOP_K = 64


def _ids(tokenizer: Any) -> Any:
    import torch

    text = BUILTIN_EVAL_TEXT["wiki-eval"].read_text(encoding="utf-8")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: WINDOWS * SEQ_LEN]
    return torch.tensor(ids, dtype=torch.long).view(-1, SEQ_LEN)


def _logprobs(forward: Callable[[Any], Any], ids: Any) -> Any:
    """fp32 log-probabilities [positions, vocab] of every window's positions but the last."""
    import torch

    with torch.inference_mode():
        out = [torch.log_softmax(forward(row.unsqueeze(0))[0, :-1].float(), dim=-1)
               for row in ids]
    return torch.cat(out)


class ReferenceLogits:
    """The reference decode's top-k next-token log-probabilities and its NLL on the windows."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        import torch

        self.ids = _ids(tokenizer)
        lp = _logprobs(_hf_forward(model), self.ids)
        self.top_lp, self.top_ids = lp.topk(TOP_K, dim=-1)
        self.nll = _nll(lp, self.ids)
        self.positions = lp.shape[0]
        del lp
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def compare(self, name: str, lp: Any, seconds: float) -> MetricRow:
        kl = float(coarse_kl(self.top_ids, self.top_lp, lp).mean())
        top1 = float((lp.argmax(dim=-1) == self.top_ids[:, 0]).float().mean())
        nll = _nll(lp, self.ids)
        return _row(name, kl, seconds, self.positions, {
            "kl": round(kl, 6), "top1_agreement": round(top1, 4),
            "ppl": round(math.exp(nll), 4), "reference_ppl": round(math.exp(self.nll), 4)})


def _nll(lp: Any, ids: Any) -> float:
    targets = ids[:, 1:].reshape(-1)
    return float(-lp.gather(1, targets.unsqueeze(1)).mean())


def _row(name: str, kl: float, seconds: float, n: int,
         settings: dict[str, Any]) -> MetricRow:
    agreement = math.exp(-kl) if math.isfinite(kl) else 0.0
    return MetricRow(name=row_name(name), kind="consumer_agreement",
                     direction="higher_is_better", baseline=1.0, candidate=agreement,
                     recovery=agreement, threshold=math.exp(-MAX_KL), on_fail="block", n=n,
                     seconds=round(seconds, 2), settings=settings)


def problem(row: MetricRow) -> str:
    """One line: what the consumer computes against the reference, and why when known."""
    consumer = row.name.split(":", 1)[1]
    s = row.settings
    if "load_error" in s:
        return f"{CONSUMERS[consumer].label} cannot load the export: {s['load_error']}"
    return (f"{CONSUMERS[consumer].label} computes another model than the export's reference "
            f"(KL {s['kl']:.3g} nats, top-1 agreement {s['top1_agreement']:.1%}, perplexity "
            f"{s['ppl']:.4g} vs {s['reference_ppl']:.4g} on {row.n:,} eval tokens)")


def _hf_forward(model: Any) -> Callable[[Any], Any]:
    device = next(model.parameters()).device
    return lambda ids: model(ids.to(device), use_cache=False).logits


def _dtype(device: str) -> Any:
    import torch

    return torch.float32 if device == "cpu" else "auto"


def _from_pretrained(path: Path, device: str, trust: bool) -> Any:
    """The plain transformers load a user makes (fp32 on a CPU, for comparing numbers)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=_dtype(device), device_map=device,
                                                trust_remote_code=trust)


def _transformers(path: Path, device: str, trust: bool) -> Callable[[Any], Any]:
    return _hf_forward(_from_pretrained(path, device, trust).eval())


def _with_transforms(path: Path, device: str, trust: bool) -> Callable[[Any], Any]:
    from quantize.recipe.consumers import ATTACH_TRANSFORMS

    model = _from_pretrained(path, device, trust)
    exec(ATTACH_TRANSFORMS, {"repo": str(path), "model": model})  # the card's own lines
    return _hf_forward(model.eval())


def _lm_eval_hf(path: Path, device: str, trust: bool) -> Callable[[Any], Any]:
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=str(path), device=device, batch_size=1,
              dtype="float32" if device == "cpu" else "auto", trust_remote_code=trust)
    return lambda ids: lm._model_call(ids.to(lm.device))


LOADERS: dict[str, Callable[[Path, str, bool], Callable[[Any], Any]]] = {
    "transformers": _transformers,
    "lm-eval-hf": _lm_eval_hf,
    "transformers+transforms": _with_transforms,
}


def measured_here(online_transforms: bool) -> list[str]:
    """The consumers the eval stage loads the export in: every local one; the transforms
    snippet only where the export has online transforms (elsewhere it is plain transformers)."""
    return [c for c in LOADERS if online_transforms or not CONSUMERS[c].online_transforms]


def check(path: Path, reference: ReferenceLogits, consumers: list[str], device: str,
          trust_remote_code: bool = False) -> list[MetricRow]:
    """One agreement row per consumer, each loaded on its own and freed before the next."""
    import logging
    import warnings

    logging.getLogger("transformers").setLevel(logging.ERROR)
    rows = []
    for name in consumers:
        t0 = time.perf_counter()
        forward: Callable[[Any], Any] | None = None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                forward = LOADERS[name](path, device, trust_remote_code)
                lp = _logprobs(forward, reference.ids)
        except Exception as exc:  # any failure of the consumer's own loader
            rows.append(_row(name, math.inf, time.perf_counter() - t0,
                             reference.positions, {"load_error": first_line(exc)}))
            continue
        finally:
            forward = None
            gc.collect()
        rows.append(reference.compare(name, lp, time.perf_counter() - t0))
        del lp
    return rows
