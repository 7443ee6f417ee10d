"""KV-cache quantization in our own decode (quantize.model.decode.build_reference): the keys
(after RoPE) and values an attention layer hands its cache (DeepSeek MLA: its latent), quantized
with the export's static `k_scale` / `v_scale` before attention reads them back.

This is where compressed-tensors applies an export's `kv_cache_scheme` when it loads one
(compressed_tensors/modeling/kvcache.py: `QuantizedKVCache.forward` quantizes `key_states` and
`value_states` on their way into `past_key_values.update`, a pre-hook putting it in place of the
attention's `past_key_values`), and what vLLM's FP8 KV cache stores (K/V over k_scale/v_scale).
Without it the decode check compared a loader that quantizes the cache with a reference that
does not (0.23 nats mean on the tiny Qwen3-MoE fp8-kv export).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from quantize.errors import VerifyError
from quantize.model.qconfig import Args

if TYPE_CHECKING:
    import torch

    Quantize = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (values, scale) -> QDQ


def kv_scales(raw: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{attention module: (k_scale, v_scale)} from the stored tensors."""
    return {k[: -len(".k_scale")]: (v, raw[k[: -len("k_scale")] + "v_scale"])
            for k, v in raw.items()
            if k.endswith(".k_scale") and k[: -len("k_scale")] + "v_scale" in raw}


def quantize_kv_cache(model: Any, raw: dict[str, torch.Tensor], kv: Args,
                      quantize: Quantize) -> int:
    """Hook every attention module the export stores KV-cache scales for (`raw`: the stored
    tensors by the model's names) so that the keys and values it caches go through
    `quantize(values, scale)` first. Returns the number of modules hooked."""
    if kv.dynamic or kv.strategy != "tensor":
        raise VerifyError(problem=f"the reference decode has no KV-cache quantization for a "
                                  f"{'dynamic' if kv.dynamic else kv.strategy} scheme",
                          hint="it applies static per-tensor k_scale/v_scale (what vLLM reads)")
    scales = kv_scales(raw)
    if not scales:
        raise VerifyError(problem="the export declares a kv_cache_scheme but stores no "
                                  "k_scale/v_scale tensors: the export is incomplete",
                          hint="re-run it")
    modules = dict(model.named_modules())
    for name, (k_scale, v_scale) in scales.items():
        mod = modules.get(name)
        if mod is None or "past_key_values" not in inspect.signature(mod.forward).parameters:
            raise VerifyError(path=name, problem="the export stores KV-cache scales for a "
                              "module that is not an attention layer taking `past_key_values`, "
                              "so the reference decode cannot apply its KV-cache scheme")
        mod.register_forward_pre_hook(_hook(k_scale.float(), v_scale.float(), quantize),
                                      with_kwargs=True)
    return len(scales)


def _hook(k_scale: torch.Tensor, v_scale: torch.Tensor, quantize: Quantize) -> Any:
    def hook(_mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        kwargs["past_key_values"] = _QuantizedCache(kwargs.get("past_key_values"),
                                                    k_scale, v_scale, quantize)
        return args, kwargs

    return hook


class _QuantizedCache:
    """Stands for one forward's cache (or its absence): quantizes, then hands on."""

    def __init__(self, inner: Any, k_scale: torch.Tensor, v_scale: torch.Tensor,
                 quantize: Quantize) -> None:
        self._inner, self._k, self._v, self._quantize = inner, k_scale, v_scale, quantize

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._quantize(key_states, self._k), self._quantize(value_states, self._v)
        if self._inner is None:
            return k, v
        out: tuple[torch.Tensor, torch.Tensor] = self._inner.update(k, v, *args, **kwargs)
        return out

    def __getattr__(self, name: str) -> Any:  # the rest of the Cache API, as it was
        return getattr(self._inner, name)
