"""KV-cache bytes: per token, per request, and the one-line description `quantize plan` and the
model card print.

Per token, for GQA/MQA/MHA: 2 (K and V) x layers x KV heads per GPU x head_dim x bytes of the
KV dtype; vLLM splits KV heads over tensor-parallel ranks and replicates them when there are
fewer heads than ranks. For MLA one latent vector (kv_lora_rank + qk_rope_head_dim) per token
and layer, the same on every rank. Sliding-window layers hold at most
min(window - 1 + max_num_batched_tokens, max_model_len) tokens per request (vLLM's
SlidingWindowSpec). All of it is linear in the context: bytes = per-token bytes x tokens.
"""

from __future__ import annotations

import math

from quantize.model.config import Shape

BLOCK = 16  # vLLM's default KV block size (tokens)


def kv_bytes_per_token(shape: Shape, tp: int, kv_bytes: int) -> int:
    """Per GPU, all attention layers: what vLLM divides the KV budget by."""
    return sum(_layer_kv(shape, tp, kv_bytes) for _ in shape.layer_kinds)


def _layer_kv(shape: Shape, tp: int, kv_bytes: int) -> int:
    if shape.mla_latent:  # one latent vector per token, the same on every rank
        return shape.mla_latent * kv_bytes
    return 2 * shape.kv_heads_per_rank(tp) * shape.head_dim * kv_bytes


def request_bytes(shape: Shape, tp: int, kv_bytes: int, context: int, batched: int) -> int:
    """KV bytes one sequence of `context` tokens holds per GPU: linear in the context."""
    full = math.ceil(context / BLOCK) * BLOCK
    # vLLM's SlidingWindowSpec keeps window - 1 + max_num_batched_tokens tokens at most
    swa = min(full, math.ceil(((shape.sliding_window or 0) - 1 + batched) / BLOCK) * BLOCK)
    per = _layer_kv(shape, tp, kv_bytes)
    return sum(per * (swa if kind == "sliding" else full) for kind in shape.layer_kinds)


def kv_description(shape: Shape, tp: int, kv_dtype: str) -> str:
    """How the KV bytes were counted, in words (the `KV model:` line, the card's KV note)."""
    n_swa = shape.layer_kinds.count("sliding")
    if shape.mla_latent:
        what = (f"MLA latent KV: {shape.mla_latent} values/token/layer x {shape.layers} layers, "
                "replicated on every GPU (no K/V split, no factor 2)")
    else:
        split = shape.kv_heads_per_rank(tp)
        what = (f"{shape.attention}: 2 x {shape.layers} layers x {shape.kv_heads} KV heads "
                f"({split} per GPU at TP={tp}) x head_dim {shape.head_dim}")
        if shape.head_dim * shape.heads != shape.hidden:
            what += f" (head_dim != hidden/heads = {shape.hidden // shape.heads})"
    if n_swa:
        what += (f"; sliding window {shape.sliding_window} on {n_swa} of {shape.layers} layers "
                 "(counted at min(window-1+max_num_batched_tokens, context) tokens per request)")
    else:
        what += "; full attention on every layer"
    return f"{what}; KV dtype {kv_dtype}"
