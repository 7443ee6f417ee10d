"""The divergence kinds: KL divergence against the baseline's stored top-k reference, and
answer flips from the multiple-choice items."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from quantize.errors import EvalError
from quantize.metrics.divergence import coarse_kl, divergence, flips, reference
from quantize.recipe.recipe import MetricSpec, parse_metric
from quantize.run.results import Score


def _full_kl(p_lp: Any, q_lp: Any) -> Any:
    return (p_lp.exp() * (p_lp - q_lp)).sum(dim=1)


def test_coarse_kl_is_a_lower_bound_that_meets_the_full_kl() -> None:
    import torch

    torch.manual_seed(0)
    p = torch.log_softmax(torch.randn(50, 300) * 3, dim=-1)
    q = torch.log_softmax(p + 0.3 * torch.randn(50, 300), dim=-1)
    full = _full_kl(p, q)
    last = torch.zeros(50)
    for k in (1, 8, 64, 300):
        lp, ids = p.topk(k, dim=-1)
        kl = coarse_kl(ids, lp, q)
        assert bool((kl <= full + 1e-5).all())  # grouping never adds divergence
        assert float(kl.mean()) >= float(last.mean()) - 1e-6  # finer lists see more of it
        last = kl
    assert torch.allclose(last, full, atol=1e-5)  # every token listed: the exact KL
    same = p.topk(16, dim=-1)
    assert float(coarse_kl(same[1], same[0], p).abs().max()) < 1e-6  # no divergence from itself


def _spec(**kw: Any) -> MetricSpec:
    base = {"name": "kld", "kind": "kl_divergence", "direction": "lower_is_better",
            "builtin": "wiki-eval", "max_tokens": 200, "seq_len": 64, "threshold": 0.9}
    return parse_metric({**base, **kw})


def test_kl_divergence_of_a_tiny_model_against_itself_and_a_perturbed_copy(
        tiny_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    spec = _spec(top_k=8)
    ref = reference(model, tok, spec)
    assert ref.value == 0.0 and ref.reference is not None
    assert ref.n == len(ref.reference.ids) == 199 - 3  # 200 tokens, 4 windows of 64
    assert all(len(row) == 8 for row in ref.reference.ids)
    same = divergence(model, tok, spec, ref)
    assert same.value < 1e-4 and same.settings["top1_agreement"] == 1.0
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    moved = divergence(model, tok, spec, ref)
    assert moved.value > 1000 * same.value + 1e-5
    assert moved.per_window is not None and len(moved.per_window) == 4
    assert 0.0 <= float(moved.settings["top1_agreement"]) <= 1.0
    # more tokens listed: closer to the exact KL over the whole vocabulary, never above it
    from quantize.metrics import token_windows
    from quantize.metrics.divergence import _window_logprobs

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    wide = divergence(model, tok, _spec(top_k=1024), reference(base, tok, _spec(top_k=1024)))
    ids, wins = token_windows(tok, spec)
    t = torch.tensor(ids)
    exact = torch.cat([_full_kl(_window_logprobs(base, t, w), _window_logprobs(model, t, w))
                       for w in wins]).mean()
    assert moved.value <= wide.value <= float(exact) + 1e-6


def test_kl_divergence_refuses_a_missing_or_stale_reference(tiny_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with pytest.raises(EvalError) as err:
        divergence(model, tok, _spec(), Score(value=0.0, n=1, seconds=0.0))
    assert err.value.problem is not None and err.value.problem.startswith(
        f"metric {_spec().name}: the baseline's reference distribution is missing")
    assert err.value.hint is not None and "baseline cache" in err.value.hint
    ref = reference(model, tok, _spec(top_k=4))
    with pytest.raises(EvalError) as err:
        divergence(model, tok, _spec(top_k=4, max_tokens=100), ref)
    assert err.value.problem == (f"metric {_spec().name}: the baseline's reference covers 196 "
                                 "positions, these windows 98")
    assert err.value.hint is not None and err.value.hint.startswith("rerun eval")


def _mc(choices: list[int], right: list[float]) -> Score:
    return Score(value=sum(right) / len(right), n=len(right), seconds=0.0,
                 per_example=right, per_example_choice=choices)


def test_answer_flips_count_changed_answers_and_their_direction() -> None:
    base = {"a": _mc([0, 1, 2, 0], [1, 0, 1, 0]), "b": _mc([1, 1], [1, 1])}
    cand = {"a": _mc([0, 2, 1, 0], [1, 1, 0, 0]), "b": _mc([1, 0], [1, 0])}
    rate, items, settings = flips(["a", "b"], base, cand)
    assert items == [0, 1, 1, 0, 0, 1] and rate == 0.5
    assert settings == {"of": "a, b", "items": 6, "right_to_wrong": 2, "wrong_to_right": 1}
    old = {"a": Score(value=0.5, n=4, seconds=0.0, per_example=[1, 0, 1, 0])}
    with pytest.raises(EvalError) as err:
        flips(["a"], old, cand)
    assert err.value.problem is not None and err.value.problem.startswith(
        "answer_flips: metric a has no per-item answers")
    assert err.value.hint == "rerun eval"
