"""The card's memory facts: weights on disk and KV-cache bytes per token, before and after.

KV bytes come from the planner's KV model (quantize.planner.kv) over quantize.model.config's
model shape, so MLA latents, sliding windows and multimodal text configs count as `quantize
plan` counts them; a config transformers cannot build (remote-code architectures) falls back
to 2 × layers × KV heads × head dim × bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantize.errors import QuantizeError
from quantize.model.config import ModelConfig, config_dtype, dtype_bytes, kv_dims, model_shape
from quantize.planner import kv
from quantize.report.card.inputs import CardInputs
from quantize.textfmt import human_bytes as _human_bytes


def human_bytes(n: float) -> str:
    """Sizes on the card stop at GiB, as they always have."""
    return _human_bytes(n, top="GiB")


def _counted(n: int | None) -> str:
    return f"{n:,} B" if n is not None else "unknown"


def _raw_kv(config: ModelConfig, element_bytes: int) -> tuple[int | None, str]:
    """The plain count from config.json's sizes, for configs transformers cannot build."""
    dims = kv_dims(config)
    if dims is None:
        return None, "not computable from config.json"
    layers, kv_heads, dim = dims
    return (2 * layers * kv_heads * dim * element_bytes,
            f"2 (K, V) x {layers} layers x {kv_heads} KV heads x head_dim {dim} x "
            f"{element_bytes} bytes per element")


def kv_per_token(config: ModelConfig, element_bytes: int) -> tuple[int | None, str]:
    """(bytes, how they were counted) of the KV cache per token, all layers, one GPU."""
    try:
        shape = model_shape(config)
    except (QuantizeError, AttributeError, TypeError, ValueError, KeyError):
        return _raw_kv(config, element_bytes)  # e.g. a config transformers cannot build
    return (kv.kv_bytes_per_token(shape, 1, element_bytes),
            kv.kv_description(shape, 1, f"{element_bytes} bytes per element"))


def kv_bytes_per_token(config: ModelConfig, element_bytes: int) -> int | None:
    """2 (K and V) × layers × KV heads × head dim × bytes per element (the latent size for
    MLA); None if the config lacks the sizes."""
    return kv_per_token(config, element_bytes)[0]


@dataclass(frozen=True)
class MemoryView:
    """The Memory section's cells."""

    base_dtype: str
    weights_before: str
    weights_after: str  # with the ratio when the base size is known
    kv_before: str
    kv_after: str
    kv_how: str


def memory(inputs: CardInputs) -> MemoryView:
    b = inputs.base
    before_dtype = b.dtype or config_dtype(inputs.config)
    elem_before = dtype_bytes(before_dtype)
    kv_bits = inputs.kv_cache_bits
    elem_after = kv_bits // 8 if kv_bits else elem_before
    kv_before, _ = kv_per_token(inputs.config, elem_before) if elem_before else (None, "")
    kv_after, how = kv_per_token(inputs.config, elem_after) if elem_after else (None, "")
    ratio = (f" ({b.weights_bytes / inputs.weights_bytes:.2f}× smaller)"
             if b.weights_bytes else "")
    return MemoryView(before_dtype or "?",
                      human_bytes(b.weights_bytes) if b.weights_bytes else "unknown",
                      human_bytes(inputs.weights_bytes) + ratio, _counted(kv_before),
                      _counted(kv_after), how or "unknown")
