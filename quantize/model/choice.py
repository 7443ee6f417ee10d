"""Log-likelihoods of multiple-choice continuations, each context read once: the scoring loop
behind `quantize eval`'s multiple-choice metrics on the hf engine (quantize/metrics/ wraps it
in lm-eval's HFLM, which builds the requests and aggregates the accuracy).

lm-eval's HFLM scores every (context, choice) request as its own sequence: a question with
eight choices reads its context eight times and computes full-vocabulary logits, and a
log-softmax over them, at every position of every sequence. Here the requests that share a
context (all choices of one question: lm-eval encodes the context alone, so its tokens are
the same for each) become one packed row, the context followed by every choice:

    ctx ctx ctx | a1 a2 | b1 | c1 c2 c3

Each choice token attends to the context and to the earlier tokens of its own choice (a
block-causal mask), and takes the position it has in its own sequence (position ids restart
after the context for every choice), so each choice sees exactly the tokens it sees in
lm-eval's sequence. The LM head and the log-softmax run on the scored positions only (the
last context token predicts every choice's first token). The arithmetic is the same; only
floating-point rounding differs (attention over a different key length, matrix products of
another shape), as it already does between lm-eval's batch compositions.
`tests/unit/model/test_choice.py` checks it against HFLM's own log-likelihoods on a tiny
model, and bench/mc_check.py on the real default model (docs/speed.md: the bound met).

Used only where it is known to hold (`packable`): a model whose logits are lm_head(decoder)
(quantize/model/nll.py PLAIN_HEAD: RoPE from position ids, no soft-capping), attention
through SDPA or eager (both take a custom 4-D mask), no sliding window shorter than a row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from quantize.model.nll import split_head

Request = tuple[Sequence[int], Sequence[int]]  # (context tokens, continuation tokens)
# a packed row is cut into several when longer than this (the mask is rows x len x len)
MAX_ROW_TOKENS = 2048


def packable(model: Any) -> bool:
    """Whether `packed_loglikelihoods` computes this model's lm-eval scores."""
    config = getattr(model, "config", None)
    if split_head(model) is None or config is None:
        return False
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False
    window = getattr(config, "sliding_window", None)
    return window is None or window >= MAX_ROW_TOKENS


def pack(requests: Sequence[Request], max_row: int = MAX_ROW_TOKENS
         ) -> list[tuple[list[int], list[tuple[int, int, int]]]]:
    """Rows of (tokens, [(request index, first token's offset, length)]): the requests that
    share a context in one row, context first, then each continuation; a row that would exceed
    `max_row` tokens is continued in another row with the context again."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (ctx, _) in enumerate(requests):
        groups.setdefault(tuple(ctx), []).append(i)
    rows: list[tuple[list[int], list[tuple[int, int, int]]]] = []
    for ctx, members in groups.items():
        tokens: list[int] = list(ctx)
        spans: list[tuple[int, int, int]] = []
        for i in members:
            cont = list(requests[i][1])
            if spans and len(tokens) + len(cont) > max_row:
                rows.append((tokens, spans))
                tokens, spans = list(ctx), []
            spans.append((i, len(tokens), len(cont)))
            tokens.extend(cont)
        rows.append((tokens, spans))
    return rows


def _row_layout(n_ctx: int, spans: list[tuple[int, int, int]], length: int
                ) -> tuple[list[int], list[int]]:
    """Per token of a row padded to `length`: its segment (0 context, k for the k-th
    continuation, -1 padding) and its position id."""
    seg = [0] * n_ctx
    pos = list(range(n_ctx))
    for k, (_, _, n) in enumerate(spans, 1):
        seg += [k] * n
        pos += range(n_ctx, n_ctx + n)
    pad = length - len(seg)
    return seg + [-1] * pad, pos + list(range(len(pos), len(pos) + pad))


def _mask(segments: Any, bool_mask: bool, dtype: Any) -> Any:
    """[rows, 1, len, len] block-causal mask: causal, and a continuation token sees the
    context and its own continuation only. Padding sees what precedes it (no empty row)."""
    import torch

    n = segments.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    q, k = segments[:, :, None], segments[:, None, :]
    allowed = causal & ((k == 0) | (k == q) | (q < 0))
    allowed = allowed[:, None]
    if bool_mask:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed,
                                                               torch.finfo(dtype).min)


def packed_loglikelihoods(model: Any, requests: Sequence[Request], rows_per_batch: int
                          ) -> list[tuple[float, bool]]:
    """(summed log-probability of the continuation, whether it is the greedy one) per
    request, as lm-eval's HFLM defines them; the model must be `packable`."""
    import torch

    split = split_head(model)
    assert split is not None, "packed_loglikelihoods needs a PLAIN_HEAD model (packable)"
    decoder, head = split
    device = next(model.parameters()).device
    bool_mask = model.config._attn_implementation == "sdpa"
    rows = pack(requests)
    rows.sort(key=lambda r: -len(r[0]))  # similar lengths share a batch: little padding
    out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
    with torch.inference_mode():
        for b in range(0, len(rows), max(1, rows_per_batch)):
            batch = rows[b: b + rows_per_batch]
            length = len(batch[0][0])
            ids, segs, poss = [], [], []
            for tokens, spans in batch:
                n_ctx = spans[0][1]
                seg, pos = _row_layout(n_ctx, spans, length)
                ids.append(tokens + [tokens[0]] * (length - len(tokens)))
                segs.append(seg)
                poss.append(pos)
            seg_t = torch.tensor(segs)
            hidden = decoder(input_ids=torch.tensor(ids, device=device),
                             position_ids=torch.tensor(poss, device=device),
                             attention_mask=_mask(seg_t, bool_mask, model.dtype).to(device),
                             use_cache=False).last_hidden_state
            # for each continuation token: the row position whose output predicts it (the
            # previous token of its own sequence: the last context token for the first)
            where: list[int] = []
            targets: list[int] = []
            for r, (tokens, spans) in enumerate(batch):
                n_ctx = spans[0][1]
                for _, first, n in spans:
                    prev = [r * length + n_ctx - 1] + [r * length + first + j
                                                       for j in range(n - 1)]
                    where += prev
                    targets += tokens[first: first + n]
            logits = head(hidden.reshape(-1, hidden.shape[-1])[torch.tensor(where, device=device)])
            logp = torch.log_softmax(logits, dim=-1)
            tgt = torch.tensor(targets, device=device)
            picked = logp.gather(1, tgt[:, None])[:, 0]
            greedy = logp.argmax(dim=-1) == tgt
            start = 0
            for _, spans in batch:
                for i, _, n in spans:
                    out[i] = (float(picked[start: start + n].sum()),
                              bool(greedy[start: start + n].all()))
                    start += n
    return out
