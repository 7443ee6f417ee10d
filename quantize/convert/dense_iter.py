"""Any safetensors checkpoint read as (hf_name, float32 tensor) pairs, one group at a time:
the feed for writers that take dense weights (the GGUF writer, quantize.convert.gguf_out),
so quantized HF inputs (FP8-block, compressed-tensors, GPTQ, AWQ) reach them dequantized
without the whole model in memory."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from quantize.convert.shards import SourceShards
from quantize.model.formats import DENSE, Detected, Format


def _converter(detected: Detected) -> Any:
    if detected.format is Format.FP8_BLOCK:
        from quantize.convert.fp8_block import Fp8BlockToDense

        return Fp8BlockToDense(detected, "float32")
    if detected.format is Format.COMPRESSED_TENSORS:
        from quantize.convert.ct_bf16 import CompressedToDense

        return CompressedToDense(detected, "float32")
    from quantize.convert.gptq_awq import NativeToDense

    return NativeToDense(detected, "float32")


def dense_tensors(detected: Detected) -> Callable[[], Iterator[tuple[str, torch.Tensor]]]:
    """A zero-argument callable (it may be called more than once, e.g. a writer's two
    passes) yielding every weight of `detected` in HF naming as float32."""
    src = SourceShards(detected.path, detected.tensors)
    conv = None if detected.format in DENSE else _converter(detected)
    groups = src.groups(conv.deps if conv is not None else (lambda _n: set()))

    def iterate() -> Iterator[tuple[str, torch.Tensor]]:
        for group in groups:
            tensors = src.load(group.names)
            out = tensors if conv is None else conv.convert(tensors).tensors
            for name, t in out.items():
                if t.is_floating_point():
                    yield name, t.to(torch.float32)

    return iterate
