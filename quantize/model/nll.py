"""Summed next-token NLL of a causal LM over windows of a token sequence: the perplexity loop
behind `quantize eval` (quantize/metrics/) and bench/eval_vs_lmeval.py.

A window is (begin, end, n_scored) over `ids`: the model reads ids[begin:end - 1] and the
window's last n_scored tokens are scored, each predicted from the tokens before it inside the
window. How it differs from `model(ids).logits` + a log-softmax over them, and why:

- **No [batch, seq, vocab] logits.** A 128k vocabulary makes them the largest tensor of the
  step (8 × 1024 × 128256 in fp32 is 4.2 GB): little GPU time (memory-bound passes, about
  2% of an 8B forward on an H200 by bandwidth), but memory a larger batch or window can use
  and, on the CPU, passes over memory that does not fit any cache. For the architectures
  in PLAIN_HEAD, whose logits are exactly `lm_head(decoder(ids))`, the decoder runs alone
  and the head is applied to the scored positions only, HEAD_ELEMENTS logits at a time;
  each chunk's logits come out of the head in the model's dtype (the same numbers as
  `model(...).logits`) and are upcast to fp32 for the cross-entropy, as before. Other
  architectures (logit soft-capping or scaling, e.g. Gemma 2, Cohere, Granite) take the
  full forward and the same chunked loss.
- **No host sync per window.** Each window's NLL is added into a float64 tensor on the
  model's device; one transfer at the end. Index tensors for all batches are built on the
  host up front and copied once (pinned, non-blocking), so the host keeps queueing the next
  batch's kernels while the device computes.
- **No attention mask, no KV cache.** Rows are right-padded: in a causal model a position
  never attends to later ones, so padding at the end cannot change the scored positions, and
  equal-length rows (every batch but maybe the last) take the attention's plain causal path
  (SDPA's fused kernel) as lm-eval's loglikelihood does. `use_cache=False`: the forward does
  not keep every layer's keys and values.
- **The window's last token is not fed.** Its logits predict nothing inside the window.

`compile_layers=True` (opt-in, measured by bench/eval_vs_lmeval.py's `quantize_compiled`
row, not used by the pipeline): each decoder layer runs through torch.compile for the call
(one graph per batch shape, shared by all layers), fusing what eager mode runs as separate
memory-bound kernels (RMSNorm's fp32 steps, rotary embedding, SiLU x up, residual adds:
about a fifth of an 8B forward's time on an H200, estimated from their bytes). It costs a
compilation on the first call of each shape and changes the rounding of the fused steps, so
CPU results would move.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

Window = tuple[int, int, int]  # (begin, end, n_scored)

# config.model_type of causal LMs whose logits are lm_head(last hidden state), nothing more
PLAIN_HEAD = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3",
                        "qwen3_moe", "phi3"})
# logits per chunk of the head (fp32: 1 GiB on an accelerator, 256 MiB on the CPU, where
# smaller chunks stay in cache and the machine's memory is shared)
HEAD_ELEMENTS = {"cuda": 1 << 28, "cpu": 1 << 26}


def split_head(model: Any) -> tuple[Any, Any] | None:
    """(decoder, lm_head) when the model's logits are exactly lm_head(decoder output)."""
    import torch

    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in PLAIN_HEAD:
        return None
    head = model.get_output_embeddings()
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if not isinstance(head, torch.nn.Linear) or decoder is None or decoder is model:
        return None
    return decoder, head


@contextmanager
def compiled_layers(decoder: Any) -> Iterator[None]:
    """The decoder's layers swapped for torch.compile wrappers while the block runs, then
    put back (the model itself is left as it was: other users of it run eager)."""
    import torch

    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(decoder).__name__} has no `layers` list to compile")
    orig = list(layers)
    try:
        for i, layer in enumerate(orig):
            layers[i] = torch.compile(layer, dynamic=False)  # type: ignore[assignment]
        yield
    finally:
        for i, layer in enumerate(orig):
            layers[i] = layer


def _plan(wins: list[Window], batch_size: int) -> tuple[list[list[int]], list[int]]:
    """Per batch, the host-side index vectors (flattened input gather, scored positions in
    the flattened [rows, keep] output, target token indices, window numbers) and each
    batch's (rows, longest, keep) shape: `keep` is how many of the padded rows' last
    positions hold every scored one (the whole row for disjoint windows, the tail for
    long_perplexity's). All in lists for a single host-to-device copy."""
    parts: list[list[int]] = []
    shapes: list[int] = []
    for i in range(0, len(wins), batch_size):
        batch = wins[i: i + batch_size]
        longest = max(e - b - 1 for b, e, _ in batch)
        keep = max(longest - (e - b - 1) + scored for b, e, scored in batch)
        gather: list[int] = []
        pos: list[int] = []
        tgt: list[int] = []
        row: list[int] = []
        for j, (b, e, scored) in enumerate(batch):
            n = e - b - 1  # tokens fed
            # right padding with the row's own first token (any id works: never attended to)
            gather.extend(list(range(b, b + n)) + [b] * (longest - n))
            first = j * keep + n - scored - (longest - keep)
            pos.extend(range(first, first + scored))
            tgt.extend(range(e - scored, e))
            row.extend([i + j] * scored)
        parts += [gather, pos, tgt, row]
        shapes += [len(batch), longest, keep]
    return parts, shapes


def window_nll(model: Any, ids: Any, wins: list[Window], batch_size: int,
               compile_layers: bool = False) -> list[float]:
    """Each window's summed NLL (nats) over its scored tokens; `ids` a 1-D CPU LongTensor."""
    from contextlib import nullcontext

    import torch
    import torch.nn.functional as F

    for b, e, scored in wins:
        if not 0 < scored <= e - b - 1 or b < 0 or e > len(ids):
            raise ValueError(f"window {(b, e, scored)} does not fit {len(ids)} tokens")
    device = next(model.parameters()).device
    parts, shapes = _plan(wins, batch_size)
    sizes = [len(p) for p in parts]
    host = torch.tensor([x for p in parts for x in p] + list(ids.tolist()), dtype=torch.long)
    if device.type == "cuda":
        host = host.pin_memory()
    flat = host.to(device, non_blocking=True)
    idx = list(torch.split(flat, [*sizes, len(ids)]))
    ids_dev = idx.pop()
    split = split_head(model)
    chunk = max(1, HEAD_ELEMENTS.get(device.type, 1 << 28) // model.config.vocab_size)
    sums = torch.zeros(len(wins), dtype=torch.float64, device=device)
    if compile_layers and split is None:
        raise ValueError(f"compile_layers: {type(model).__name__} is not in PLAIN_HEAD")
    compiled = compiled_layers(split[0]) if compile_layers and split else nullcontext()
    with torch.inference_mode(), compiled:
        for k in range(len(shapes) // 3):
            gather, pos, tgt, row = idx[4 * k: 4 * k + 4]
            rows, longest, keep = shapes[3 * k: 3 * k + 3]
            inp = ids_dev[gather].view(rows, longest)
            if split is not None:
                decoder, head = split
                out = decoder(input_ids=inp, use_cache=False).last_hidden_state[:, -keep:]
            else:  # logits of the kept tail only (a 16k window's full logits: GBs)
                head = None
                kw = {"logits_to_keep": keep} if keep < longest else {}
                out = model(input_ids=inp, use_cache=False, **kw).logits
            out = out.reshape(rows * keep, -1)
            for c in range(0, len(pos), chunk):
                sel = out[pos[c: c + chunk]]
                logits = head(sel) if head is not None else sel
                nll = F.cross_entropy(logits.float(), ids_dev[tgt[c: c + chunk]],
                                      reduction="none")
                sums.index_add_(0, row[c: c + chunk], nll.double())
            del out
    return sums.tolist()
