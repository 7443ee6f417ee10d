"""Each llm-compressor workaround is still needed; when one of these fails, upstream fixed
the problem: delete the workaround in quantize/backends/_llmc_compat.py and this test."""

from __future__ import annotations

import pytest
import torch

from quantize.backends import _llmc_compat


@pytest.mark.skipif(torch.accelerator.is_available(), reason="the bug only shows without one")
def test_cpu_pin_memory_still_raises_upstream() -> None:
    from llmcompressor.pipelines.cache import IntermediatesCache

    assert _llmc_compat.cpu_pin_memory_is_broken()
    cache = IntermediatesCache.from_dataloader([{"x": torch.zeros(2)}], torch.device("cpu"))
    original = IntermediatesCache.__dict__["pin_memory"]
    if getattr(IntermediatesCache, "_quantize_patched", 0):
        pytest.skip("already patched in this process; the check above still holds")
    with pytest.raises(RuntimeError, match="accelerator"):
        original(cache, 0)
