"""How far the candidate's outputs moved from the baseline's, measured on the pair (the
divergence kinds of quantize/recipe/metric_kinds.py).

- **kl_divergence**: on the same token windows as perplexity, the baseline keeps its top_k
  next-token log-probabilities at each scored position (its `Reference`, stored with its
  cached scores); the candidate's KL from it is computed over those top_k tokens plus one
  bucket for the rest of the vocabulary. That coarsened KL is a lower bound of the full
  KL(baseline || candidate) (grouping outcomes never increases a divergence) and meets it as
  top_k grows; tests/unit/metrics/test_divergence.py compares the two on a tiny model, and
  eval/README.md states the gap on the default model. Storing the full distribution instead
  would cost vocabulary x tokens floats per baseline (49k x 4k = 800 MB on the default
  model). `top1_agreement` (the share of positions where both models' most likely token is
  the same) is reported beside it.
- **answer_flips**: from the multiple-choice metrics' per-item chosen answers: the share of
  items whose answer changed, also split into right-to-wrong and wrong-to-right.

Both give a per-item list whose baseline counterpart is all zeros, so the gate's paired noise
is the standard error of that list.
"""

from __future__ import annotations

import time
from typing import Any

from quantize.errors import EvalError
from quantize.recipe.metric_kinds import KLDivergenceSpec
from quantize.run.results import Reference, Score, Settings

Window = tuple[int, int, int]  # (begin, end, n_scored), as quantize.metrics.windows


def _window_logprobs(model: Any, ids: Any, window: Window) -> Any:
    """fp32 log-probabilities [n_scored, vocab] of the window's scored positions."""
    import torch

    begin, end, scored = window
    device = next(model.parameters()).device
    with torch.inference_mode():
        logits = model(ids[begin:end - 1].unsqueeze(0).to(device), use_cache=False).logits
    return torch.log_softmax(logits[0, -scored:].float(), dim=-1)


def reference(model: Any, tokenizer: Any, spec: KLDivergenceSpec) -> Score:
    """kl_divergence on the baseline: its reference distribution; KL 0 by definition."""
    import torch

    from quantize.metrics import token_windows

    ids, wins = token_windows(tokenizer, spec)
    all_ids = torch.tensor(ids, dtype=torch.long)
    t0 = time.perf_counter()
    top_ids: list[list[int]] = []
    top_lps: list[list[float]] = []
    for w in wins:
        lp = _window_logprobs(model, all_ids, w)
        values, index = lp.topk(spec.top_k, dim=-1)
        top_ids += index.cpu().tolist()
        top_lps += [[round(v, 6) for v in row] for row in values.cpu().tolist()]
    return _score(spec, wins, t0, 0.0, [0.0] * len(wins), {},
                  reference=Reference(ids=top_ids, logprobs=top_lps))


def coarse_kl(ref_ids: Any, ref_lp: Any, cand_lp: Any) -> Any:
    """Per-position KL(P || Q) over P's listed tokens plus one bucket for the rest.
    ref_ids, ref_lp: [n, k] (P's top tokens and log-probs); cand_lp: [n, vocab] (Q)."""
    import torch

    q_lp = cand_lp.gather(1, ref_ids)
    p = ref_lp.exp()
    listed = (p * (ref_lp - q_lp)).sum(dim=1)
    p_rest = (1.0 - p.sum(dim=1)).clamp(min=0.0)
    q_rest = (1.0 - q_lp.exp().sum(dim=1)).clamp(min=1e-12)
    rest = torch.where(p_rest > 0, p_rest * (p_rest.clamp(min=1e-12).log() - q_rest.log()),
                       torch.zeros_like(p_rest))
    return (listed + rest).clamp(min=0.0)


def divergence(model: Any, tokenizer: Any, spec: KLDivergenceSpec, ref: Score | None) -> Score:
    """kl_divergence on the candidate: mean KL per scored token from the baseline's
    reference, per window, and how often both pick the same most likely token."""
    import torch

    from quantize.metrics import token_windows

    if ref is None or ref.reference is None:
        raise EvalError(problem=f"metric {spec.name}: the baseline's reference distribution "
                                "is missing (scores cached before kl_divergence existed?)",
                        hint="clear the baseline cache entry or rerun eval")
    ids, wins = token_windows(tokenizer, spec)
    n = sum(s for _, _, s in wins)
    if n != len(ref.reference.ids) or len(ref.reference.ids[0]) != spec.top_k:
        raise EvalError(problem=f"metric {spec.name}: the baseline's reference covers "
                                f"{len(ref.reference.ids)} positions, these windows {n}",
                        hint="rerun eval (the suite changed since the baseline was scored)")
    all_ids = torch.tensor(ids, dtype=torch.long)
    t0 = time.perf_counter()
    per_window: list[float] = []
    same = 0
    at = 0
    for w in wins:
        lp = _window_logprobs(model, all_ids, w)
        r_ids = torch.tensor(ref.reference.ids[at:at + w[2]], device=lp.device)
        r_lp = torch.tensor(ref.reference.logprobs[at:at + w[2]], device=lp.device)
        kl = coarse_kl(r_ids, r_lp, lp)
        per_window.append(float(kl.mean()))
        same += int((lp.argmax(dim=1) == r_ids[:, 0]).sum())
        at += w[2]
    counts = [s for _, _, s in wins]
    mean = sum(k * c for k, c in zip(per_window, counts, strict=True)) / n
    return _score(spec, wins, t0, mean, per_window, {"top1_agreement": round(same / n, 4)},
                  window_tokens=counts)


def _score(spec: KLDivergenceSpec, wins: list[Window], t0: float, value: float,
           per_window: list[float], more: Settings, **fields: Any) -> Score:
    """The metric's result on one model, timed from t0 over its windows."""
    seconds = time.perf_counter() - t0
    scored = sum(s for _, _, s in wins)
    settings: Settings = {"seq_len": spec.seq_len, "tokens": scored, "stride": spec.seq_len,
                          "top_k": spec.top_k, **more}
    return Score(value=value, n=scored, seconds=round(seconds, 2), per_window=per_window,
                 settings=settings, tokens_per_s=round(sum(e - b for b, e, _ in wins) / seconds,
                                                       1), **fields)


def flips(names: list[str], base: dict[str, Score], cand: dict[str, Score]
          ) -> tuple[float, list[float], Settings]:
    """answer_flips over the items of the named multiple-choice metrics: (flip rate, per-item
    0/1 flips, settings with right-to-wrong and wrong-to-right counts)."""
    per_item: list[float] = []
    to_wrong = to_right = 0
    for name in names:
        b, c = base[name], cand[name]
        if b.per_example_choice is None or c.per_example_choice is None \
                or b.per_example is None or c.per_example is None:
            raise EvalError(problem=f"answer_flips: metric {name} has no per-item answers "
                                    "(scores cached before answer_flips existed?)",
                            hint="rerun eval")
        for bc, cc, bok, cok in zip(b.per_example_choice, c.per_example_choice,
                                    b.per_example, c.per_example, strict=True):
            per_item.append(float(bc != cc))
            to_wrong += int(bok > cok)
            to_right += int(cok > bok)
    if not per_item:
        raise EvalError(problem=f"answer_flips: no items in {names}")
    rate = sum(per_item) / len(per_item)
    return rate, per_item, {"of": ", ".join(names), "items": len(per_item),
                            "right_to_wrong": to_wrong, "wrong_to_right": to_right}

