"""Workarounds for llmcompressor 0.14.0.1, each small and tested.

tests/unit/test_llmc_compat.py asserts that each problem still exists upstream, so the test
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
