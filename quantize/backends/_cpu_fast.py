"""A CPU-only speedup inside llm-compressor's GPTQ calibration that leaves the result
unchanged, bit for bit (measured on the default model in bench/RESULTS.md, "make quantize on
2 cores").

llm-compressor accumulates each hooked Linear's Hessian as `H += (√2·X)ᵀ(√2·X)`, once per
Linear. q/k/v (and gate/up) receive the same input tensor object, so `shared_hessian`
computes its product once, by the library's own steps, and adds it to each of their
Hessians: the same operations on the same values, the same Hessians, with 3 of a layer's 7
products (and their fp32 copies of the input) left out.

The GPU has its own variant (quantize/backends/_gpu_fast.py, 16-bit GEMMs with fp32 output).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

from quantize.backends._gpu_fast import _Shared


def make_shared_accumulate(orig: Any) -> Any:
    """llm-compressor's `accumulate_hessian` (llmcompressor/modifiers/gptq/helpers.py, 0.14)
    for a Linear on the CPU, its product shared by the Linears fed the same tensor; anything
    else (a Conv, a Hessian on another device) goes to `orig` unchanged."""
    import torch
    from llmcompressor.modifiers.gptq.helpers import GPTQ_PRECISION

    shared = _Shared()

    def accumulate_hessian(inp: Any, module: Any, hessian: Any,
                           num_samples: Any) -> tuple[Any, Any]:
        if not (isinstance(module, torch.nn.Linear) and hessian.device.type == "cpu"
                and inp.device.type == "cpu" and inp.dim() in (2, 3)):
            shared.clear()
            return orig(inp, module, hessian, num_samples)
        x = inp.unsqueeze(0) if inp.dim() == 2 else inp
        num_added = x.shape[0]
        prod = shared.get(inp, hessian.shape[0])
        if prod is None:
            # the library's steps, in its order: rows of tokens, transposed, √2 · fp32
            x = x.reshape((-1, x.shape[-1])).t()
            x = math.sqrt(2) * x.to(dtype=GPTQ_PRECISION)
            prod = x.matmul(x.t())
            shared.put(inp, prod)
        num_samples += num_added
        hessian += prod
        return hessian, num_samples

    accumulate_hessian.shared = shared  # type: ignore[attr-defined]
    return accumulate_hessian


@contextlib.contextmanager
def shared_hessian(enabled: bool) -> Iterator[None]:
    """Patch GPTQ's Hessian accumulation for one oneshot call on the CPU."""
    if not enabled:
        yield
        return
    from llmcompressor.modifiers.gptq import base

    orig = base.accumulate_hessian
    patched = make_shared_accumulate(orig)
    base.accumulate_hessian = patched
    try:
        yield
    finally:
        base.accumulate_hessian = orig
        patched.shared.clear()
