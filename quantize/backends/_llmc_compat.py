"""Workarounds for llmcompressor 0.14.0.1, each small and tested.

tests/unit/backends/test_llmc_compat.py asserts that each problem still exists upstream, so the test
fails (and tells us to delete the workaround) when a new release fixes it.
"""

from __future__ import annotations

import torch


def cpu_pin_memory_is_broken() -> bool:
    """AWQ calls IntermediatesCache.pin_memory, and pinning memory raises
    `RuntimeError: Cannot access accelerator device when none is available` on a machine
    without an accelerator (llmcompressor 0.14.0.1, llmcompressor/pipelines/cache.py)."""
    if torch.accelerator.is_available():
        return False
    try:
        torch.zeros(1).pin_memory()
    except RuntimeError:
        return True
    return False


def apply() -> None:
    """Skip pinning where it cannot work: pinning only speeds host-to-GPU copies, so on a
    machine with no accelerator it has nothing to do."""
    from llmcompressor.pipelines.cache import IntermediatesCache

    if cpu_pin_memory_is_broken() and not getattr(IntermediatesCache, "_quantize_patched", 0):
        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None  # type: ignore[method-assign]
        IntermediatesCache._quantize_patched = 1  # type: ignore[attr-defined]


# --- distributed (torchrun) only ---------------------------------------------------------
_QPARAM_USERS = ("llmcompressor.modifiers.gptq.base",
                 "llmcompressor.modifiers.quantization.quantization.base")


def cpu_qparams_unsynchronised() -> bool:
    """llmcompressor 0.14.0.1 utils/dist.py broadcast_qparams_and_cleanup, called after each
    rank quantizes the modules it owns, skips modules that execute on the CPU (skip_cpu: their
    weights sit in memory shared by the ranks) and returns without synchronising, so a rank
    can run the next layer with another rank's modules not yet written. Seen here: 2 CPU ranks
    gave a different layer 1 than one process; with a barrier added, bit-identical."""
    import importlib
    import inspect

    fn = importlib.import_module("llmcompressor.utils.dist").broadcast_qparams_and_cleanup
    source = inspect.getsource(fn)
    return "skip_cpu" in source and "barrier" not in source


def apply_distributed() -> None:
    """Under torchrun: a barrier after broadcast_qparams_and_cleanup, where both modifiers
    that use it look it up. One barrier per layer; on GPUs the broadcasts already wait."""
    import importlib

    import torch.distributed as dist

    if not cpu_qparams_unsynchronised():
        return
    original = importlib.import_module("llmcompressor.utils.dist").broadcast_qparams_and_cleanup

    def synchronised(*args: object, **kwargs: object) -> None:
        original(*args, **kwargs)
        if dist.is_initialized():
            dist.barrier()

    for name in _QPARAM_USERS:
        module = importlib.import_module(name)
        if getattr(module, "broadcast_qparams_and_cleanup", None) is original:
            setattr(module, "broadcast_qparams_and_cleanup", synchronised)  # noqa: B010


# --- AWQ on DeepSeek-V3 -----------------------------------------------------------------
_ROUTER = "re:.*mlp.gate$"


def awq_mappings(model: object) -> list[object] | None:
    """llm-compressor 0.14.0.1 maps DeepseekV3ForCausalLM to AWQ mappings that balance the
    router (`mlp.gate`) with the experts after `post_attention_layernorm`. DeepSeek-V3's
    first `first_k_dense_replace` layers (3 in the real model) are dense and have no router,
    and its matcher then groups every layer's norm into one set: AWQ stops with "AWQ needs to
    match a single smoothlayer for each mapping". (For DeepSeek-V2 the library drops the
    router from the mapping instead; but the router reads the smoothed norm, so leaving it
    out of the balance would change its inputs and so the routing.) Here the one mapping is
    split in two: the dense layers' norms balance their MLP, the MoE layers' norms balance
    router and experts as the library intends. None: the library's own mappings fit."""
    from llmcompressor.modifiers.transform.awq.mappings import AWQ_MAPPING_REGISTRY, AWQMapping

    config = getattr(model, "config", None)
    dense = int(getattr(config, "first_k_dense_replace", 0) or 0)
    name = type(model).__name__
    if name not in AWQ_MAPPING_REGISTRY or name != "DeepseekV3ForCausalLM" or dense <= 0:
        return None
    indices = "|".join(str(i) for i in range(dense))
    dense_layers, moe_layers = rf"layers\.({indices})\.", rf"layers\.(?!({indices})\.)\d+\."

    def within(layers: str, pattern: str) -> str:  # "re:.*gate_proj$" in those layers only
        return f"re:.*{layers}.*{pattern.removeprefix('re:.*')}"

    out: list[object] = []
    for m in AWQ_MAPPING_REGISTRY[name]:
        if _ROUTER not in m.balance_layers:
            out.append(m)
            continue
        out.append(AWQMapping(within(dense_layers, m.smooth_layer),
                              [within(dense_layers, b) for b in m.balance_layers if b != _ROUTER]))
        out.append(AWQMapping(within(moe_layers, m.smooth_layer),
                              [within(moe_layers, b) for b in m.balance_layers]))
    return out
