"""quantize/model/choice.py: the packed multiple-choice log-likelihoods equal lm-eval HFLM's
arithmetic (each request its own sequence, full logits, log-softmax, gather) on a tiny random
model, for both attention implementations that take the block-causal mask."""

from __future__ import annotations

import random
from typing import Any

import pytest

from quantize.model import choice

VOCAB = 211


def tiny(attn: str = "sdpa", **extra: Any) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=False,
                      attn_implementation=attn, **extra)
    return LlamaForCausalLM(cfg).eval()


def requests(seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Questions with 1-6 choices of 1-5 tokens, contexts of 1-40 tokens, one context
    repeated under another question (its choices join the same row)."""
    rng = random.Random(seed)
    out = []
    for _ in range(9):
        ctx = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
        for _ in range(rng.randint(1, 6)):
            out.append((ctx, [rng.randrange(VOCAB) for _ in range(rng.randint(1, 5))]))
    out.append((out[0][0], [5, 6, 7]))
    rng.shuffle(out)
    return out


def reference(model: Any, reqs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    """HFLM's _loglikelihood_tokens for one request at a time (no truncation needed)."""
    import torch

    out = []
    with torch.no_grad():
        for ctx, cont in reqs:
            inp = torch.tensor([(ctx + cont)[:-1]])
            logp = torch.log_softmax(model(inp).logits[0], dim=-1)[-len(cont):]
            tgt = torch.tensor(cont)
            out.append((float(logp.gather(1, tgt[:, None]).sum()),
                        bool((logp.argmax(-1) == tgt).all())))
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_packed_equals_one_sequence_per_request(attn: str, rows: int) -> None:
    model = tiny(attn)
    assert choice.packable(model)
    reqs = requests()
    got = choice.packed_loglikelihoods(model, reqs, rows)
    want = reference(model, reqs)
    for (g, gg), (w, wg) in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=1e-5, abs=1e-5)
        assert gg == wg


def test_long_rows_are_split_with_the_context_repeated(monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = [([1, 2, 3], [4, 5]), ([1, 2, 3], [6]), ([1, 2, 3], [7, 8, 9]), ([9], [1])]
    rows = choice.pack(reqs, max_row=6)
    assert rows == [([1, 2, 3, 4, 5, 6], [(0, 3, 2), (1, 5, 1)]),
                    ([1, 2, 3, 7, 8, 9], [(2, 3, 3)]),
                    ([9, 1], [(3, 1, 1)])]
    model = tiny()
    monkeypatch.setattr(choice, "MAX_ROW_TOKENS", 8)
    many = requests(1)
    got = choice.packed_loglikelihoods(model, many, 4)
    for (g, _), (w, _) in zip(got, reference(model, many), strict=True):
        assert g == pytest.approx(w, rel=1e-5, abs=1e-5)


def test_not_packable_where_the_mask_would_not_hold() -> None:
    import torch
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        MistralConfig,
        MistralForCausalLM,
    )

    torch.manual_seed(0)
    small = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}
    # logits soft-capped: not lm_head(decoder) (quantize/model/nll.py PLAIN_HEAD)
    assert not choice.packable(Gemma2ForCausalLM(Gemma2Config(**small, head_dim=16)))
    # a sliding window a packed row could outgrow: the custom mask would drop it
    assert not choice.packable(MistralForCausalLM(MistralConfig(**small, sliding_window=64)))
    assert choice.packable(MistralForCausalLM(MistralConfig(**small, sliding_window=None)))
    model = tiny()
    model.config._attn_implementation = "flex_attention"
    assert not choice.packable(model)
