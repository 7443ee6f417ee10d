"""GPU-only speedups inside llm-compressor's GPTQ calibration (measured in bench/RESULTS.md).

llm-compressor accumulates each hooked Linear's Hessian as `H += (√2·X)(√2·X)ᵀ` with X
upcast to fp32 (an fp32 copy of every input, a scaled copy, then a TF32 matmul at half the
bf16 rate), once per Linear. On a GPU this module swaps in, for the duration of one
`oneshot`:

1. the 16-bit input straight into a bf16/fp16 GEMM that accumulates and returns fp32
   (`torch.mm(..., out_dtype=torch.float32)`): bf16 values are exact in TF32 and the
   products are summed in fp32 either way, so this is the TF32 path's sum at the bf16 matrix
   rate, without the fp32 copies; the factor 2 is applied to the fp32 result;
2. one product per input tensor: q/k/v (and gate/up) receive the same tensor object, so its
   XᵀX is computed once and added to each of their Hessians.

The CPU keeps llm-compressor's own function: `fast_hessian(False)` changes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

# a product is kept for the next Linear only up to this size (4096² fp32 = 64 MiB; a
# 14336-wide down_proj input is never shared in the models seen, and keeping its 0.8 GiB
# product through the GPTQ solve would only raise the GPU peak)
SHARE_MAX_BYTES = 256 * 2**20


class _Shared:
    """The last input tensor and its product (holding the tensor keeps its identity valid)."""

    def __init__(self) -> None:
        self.inp: Any = None
        self.version = -1
        self.prod: Any = None

    def get(self, inp: Any, width: int) -> Any:
        if self.inp is inp and self.version == inp._version and self.prod.shape[0] == width:
            return self.prod
        return None

    def put(self, inp: Any, prod: Any) -> None:
        if prod.numel() * prod.element_size() > SHARE_MAX_BYTES:
            self.clear()
            return
        self.inp, self.version, self.prod = inp, inp._version, prod

    def clear(self) -> None:
        self.inp = self.prod = None


def out_dtype_supported() -> bool:
    """Whether this torch build does a 16-bit GEMM with an fp32 result on the GPU."""
    import torch

    try:
        a = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, AssertionError):  # no out_dtype, no GPU, CPU build
        return False


def gemm_fp32(a: Any, b: Any) -> Any:
    """a @ b of 16-bit GPU tensors, accumulated and returned in fp32."""
    import torch

    return torch.mm(a, b, out_dtype=torch.float32)


def make_accumulate(orig: Any, mm: Any, on_device: str = "cuda") -> Any:
    """llm-compressor's `accumulate_hessian` with the two changes above; anything else (a
    Conv, an fp32 input, a Hessian on another device) goes to `orig` unchanged."""
    import torch

    shared = _Shared()

    def accumulate_hessian(inp: Any, module: Any, hessian: Any,
                           num_samples: Any) -> tuple[Any, Any]:
        if not (isinstance(module, torch.nn.Linear) and hessian.device.type == on_device
                and inp.dtype in (torch.bfloat16, torch.float16)
                and hessian.dtype == torch.float32):
            return orig(inp, module, hessian, num_samples)
        x = inp.to(device=hessian.device)
        num_added = 1 if x.dim() == 2 else x.shape[0]
        x = x.reshape(-1, x.shape[-1])
        prod = shared.get(inp, hessian.shape[0])
        if prod is None:
            try:
                prod = mm(x.t(), x)
            except RuntimeError:  # a layout or dtype this GEMM refuses: the engine's path
                shared.clear()
                return orig(inp, module, hessian, num_samples)
            shared.put(inp, prod)
        num_samples += num_added
        hessian.add_(prod, alpha=2.0)
        return hessian, num_samples

    accumulate_hessian.shared = shared  # type: ignore[attr-defined]
    return accumulate_hessian


@contextlib.contextmanager
def fast_hessian(enabled: bool) -> Iterator[None]:
    """Patch GPTQ's Hessian accumulation for one oneshot call on a GPU."""
    if not enabled or not out_dtype_supported():
        yield
        return
    from llmcompressor.modifiers.gptq import base

    orig = base.accumulate_hessian
    patched = make_accumulate(orig, gemm_fp32)
    base.accumulate_hessian = patched
    try:
        yield
    finally:
        base.accumulate_hessian = orig
        patched.shared.clear()


@contextlib.contextmanager
def sdpa_in_traced_layers(model: Any, enabled: bool) -> Iterator[None]:
    """The pipeline's GPU default (measured in bench/RESULTS.md): llm-compressor's
    sequential pipeline runs attention through the modeling module's
    `eager_attention_forward` although the loaded model says `sdpa` (an H200 profile of one
    Llama-3.1-8B layer at 8 x 2048 tokens: softmax, fp32 casts, mask add and bmm took about
    15 of 25.6 ms). This swaps that module function for transformers' SDPA one during one
    `oneshot`; anything but a model loaded with sdpa is left alone. Measured on the H200,
    8B, 128 x 2048 tokens: forward 28.0 -> 18.1 s, quantize stage 65.4 -> 52.9 s, GPU peak
    30.2 -> 21.7 GiB (no fp32 score matrices), GPTQ loss sum 0.99998x plain oneshot's
    with eager attention and otherwise the same settings. Like `fast_hessian`, it serves
    16-bit calibration only: an fp32 model (bench/sweep.py keeps the CPU path's fp32
    numerics on a GPU) keeps the library's eager attention."""
    import sys

    import torch

    mod = sys.modules.get(type(model).__module__)
    if (not enabled or mod is None or not hasattr(mod, "eager_attention_forward")
            or getattr(model.config, "_attn_implementation", None) != "sdpa"
            or getattr(model, "dtype", None) not in (torch.bfloat16, torch.float16)):
        yield
        return
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    orig = mod.eager_attention_forward

    def attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                  scaling: float, dropout: float = 0.0, **kwargs: Any) -> Any:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)

    mod.eager_attention_forward = attention  # type: ignore[attr-defined]
    try:
        yield
    finally:
        mod.eager_attention_forward = orig  # type: ignore[attr-defined]
