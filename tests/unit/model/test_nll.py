"""quantize/model/nll.py: the batched, chunked perplexity loop equals the straightforward
full-logits NLL of each window on a tiny random model."""

from __future__ import annotations

from typing import Any

import pytest

from quantize.metrics import tail_windows, windows
from quantize.model import nll


@pytest.fixture(scope="module")
def model() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=503, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def ids() -> Any:
    import torch

    return torch.randint(0, 503, (700,), generator=torch.Generator().manual_seed(1))


def reference(model: Any, ids: Any, wins: list[tuple[int, int, int]]) -> list[float]:
    """One window at a time, full logits of the whole window, fp32 cross-entropy."""
    import torch

    out = []
    with torch.no_grad():
        for b, e, scored in wins:
            logits = model(input_ids=ids[b:e].unsqueeze(0)).logits[0].float()
            out.append(float(torch.nn.functional.cross_entropy(
                logits[e - b - 1 - scored: e - b - 1], ids[e - scored: e], reduction="sum")))
    return out


def close(got: list[float], want: list[float], rel: float = 1e-5) -> bool:
    return len(got) == len(want) and all(abs(g - w) <= rel * abs(w) for g, w in
                                         zip(got, want, strict=True))


# disjoint windows with a short last one (700 = 5 x 128 + 60), overlapping strided windows,
# and long_perplexity-style tail windows
WINDOWS = [windows(700, 128, 128), windows(700, 128, 48), tail_windows(700, 128, 64)]


@pytest.mark.parametrize("wins", WINDOWS, ids=["disjoint", "strided", "tail"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_window_nll_equals_full_logits(model: Any, ids: Any, wins: Any, batch: int) -> None:
    assert nll.split_head(model) is not None  # the decoder + chunked-head path
    assert close(nll.window_nll(model, ids, wins, batch), reference(model, ids, wins))


def test_short_last_window_is_padded_into_a_full_batch(model: Any, ids: Any) -> None:
    wins = windows(700, 128, 128)
    assert wins[-1] == (640, 700, 59)  # shorter than the rest, in the same batch of 8
    got = nll.window_nll(model, ids, wins, 8)
    assert close(got, reference(model, ids, wins))
    # the padded row scores like the window alone
    assert close(got[-1:], nll.window_nll(model, ids, wins[-1:], 1))


def test_head_chunks_cross_rows(model: Any, ids: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # 7 positions per chunk: chunks straddle windows, the sums still land per window
    monkeypatch.setitem(nll.HEAD_ELEMENTS, "cpu", 7 * 503)
    wins = windows(700, 100, 100)
    assert close(nll.window_nll(model, ids, wins, 4), reference(model, ids, wins))


@pytest.mark.parametrize("wins", WINDOWS, ids=["disjoint", "strided", "tail"])
def test_full_forward_fallback(model: Any, ids: Any, wins: Any,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    # architectures outside PLAIN_HEAD (e.g. logit soft-capping) take model(...).logits,
    # of the rows' tails only where that is all that is scored (logits_to_keep)
    monkeypatch.setattr(nll, "PLAIN_HEAD", frozenset())
    assert nll.split_head(model) is None
    assert close(nll.window_nll(model, ids, wins, 3), reference(model, ids, wins))


def test_half_precision_model_matches_its_own_logits(ids: Any) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(2)
    cfg = LlamaConfig(vocab_size=503, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256)
    m = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    wins = windows(512, 128, 128)
    # bf16 logits (as the model returns them) upcast to fp32 for the loss: the same numbers up
    # to the matmul's blocking, far below bf16's own rounding
    assert close(nll.window_nll(m, ids, wins, 4), reference(m, ids, wins), rel=2e-3)


@pytest.mark.parametrize("win", [(0, 10, 10), (0, 10, 0), (-1, 10, 2), (690, 710, 5)])
def test_windows_that_do_not_fit_are_refused(model: Any, ids: Any, win: Any) -> None:
    with pytest.raises(ValueError, match="does not fit"):
        nll.window_nll(model, ids, [win], 1)


def test_equals_lm_eval_rolling_loglikelihood_on_its_windows(tiny_model: Any) -> None:
    """On lm-eval's own rolling windows (prefix token, one token of overlap, every token
    scored) the loop gives lm-eval's number: bench/eval_vs_lmeval.py's like-for-like row."""
    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantize.metrics import BUILTIN_EVAL_TEXT

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = BUILTIN_EVAL_TEXT["wiki-eval"].read_text(encoding="utf-8")[:2500]
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=3, max_length=128, device="cpu")
    (ll,) = lm.loglikelihood_rolling(
        [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=0)],
        disable_tqdm=True)
    ids: list[int] = []
    wins = []
    for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
            token_list=lm.tok_encode(text), prefix_token=lm.prefix_token_id,
            max_seq_len=128, context_len=1)):
        wins.append((len(ids), len(ids) + len(ctx) + len(cont), len(cont)))
        ids += ctx + cont
    # full windows of 128 inputs; the last one scores only the tokens left, after a context
    assert len(wins) > 3 and wins[1][2] == 128 and 0 < wins[-1][2] < 128
    assert {e - b for b, e, _ in wins} == {129}
    got = nll.window_nll(model, torch.tensor(ids), wins, 3)
    assert sum(s for *_, s in wins) == len(lm.tok_encode(text))
    assert -sum(got) == pytest.approx(ll, rel=1e-5)


def test_compiled_layers_are_used_for_the_call_then_put_back(
        model: Any, ids: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """compile_layers swaps each decoder layer for torch.compile's wrapper during the call
    only (a counting stand-in here: inductor's compilation is the GPU bench's to time)."""
    import torch

    calls: list[int] = []

    class Wrapper(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return self.inner(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", lambda m, **kw: Wrapper(m))
    layers = list(model.get_decoder().layers)
    wins = windows(700, 128, 128)
    got = nll.window_nll(model, ids, wins, 4, compile_layers=True)
    assert len(calls) == 2 * len(layers)  # two batches through every layer
    assert list(model.get_decoder().layers) == layers
    assert close(got, reference(model, ids, wins))
    with pytest.raises(ValueError, match="PLAIN_HEAD"):
        monkeypatch.setattr(nll, "PLAIN_HEAD", frozenset())
        nll.window_nll(model, ids, wins, 4, compile_layers=True)
