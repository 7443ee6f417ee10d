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


def test_distributed_qparam_broadcast_still_unsynchronised_upstream() -> None:
    assert _llmc_compat.cpu_qparams_unsynchronised()


def test_apply_distributed_wraps_both_users_once() -> None:
    import importlib

    names = _llmc_compat._QPARAM_USERS
    before = [importlib.import_module(n).broadcast_qparams_and_cleanup for n in names]
    original = importlib.import_module("llmcompressor.utils.dist").broadcast_qparams_and_cleanup
    try:
        _llmc_compat.apply_distributed()
        after = [importlib.import_module(n).broadcast_qparams_and_cleanup for n in names]
        assert all(a is not original for a in after) and after[0] is after[1]
        _llmc_compat.apply_distributed()  # idempotent
        assert [importlib.import_module(n).broadcast_qparams_and_cleanup
                for n in names] == after
    finally:
        for n, fn in zip(names, before, strict=True):
            importlib.import_module(n).broadcast_qparams_and_cleanup = fn
