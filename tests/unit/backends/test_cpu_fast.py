"""quantize.backends._cpu_fast: the shared CPU Hessian is llm-compressor's, bit for bit, with
one product per input tensor, and only while one oneshot call runs."""

from __future__ import annotations

from typing import Any

import torch
from llmcompressor.modifiers.gptq.helpers import accumulate_hessian

from quantize.backends._cpu_fast import make_shared_accumulate, shared_hessian


def _run(fn: Any, inputs: list[torch.Tensor], modules: list[torch.nn.Linear]) -> Any:
    hs = {id(m): torch.zeros(m.in_features, m.in_features) for m in modules}
    ns = {id(m): torch.zeros(()) for m in modules}
    for x in inputs:
        for m in modules:  # q, k, v: the same input tensor object, as in a decoder layer
            hs[id(m)], ns[id(m)] = fn(x, m, hs[id(m)], ns[id(m)])
    return hs, ns


def test_bit_identical_to_llmcompressor_with_one_product_per_shared_input() -> None:
    torch.manual_seed(0)
    mods = [torch.nn.Linear(48, 8), torch.nn.Linear(48, 4), torch.nn.Linear(48, 4)]
    inputs = [torch.randn(1, 37, 48), torch.randn(3, 5, 48), torch.randn(11, 48)]
    products = []
    real_matmul = torch.Tensor.matmul

    def counting(self: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        products.append(self.shape)
        return real_matmul(self, other)

    fast = make_shared_accumulate(accumulate_hessian)
    torch.Tensor.matmul = counting  # type: ignore[method-assign]
    try:
        got_h, got_n = _run(fast, inputs, mods)
    finally:
        torch.Tensor.matmul = real_matmul  # type: ignore[method-assign]
    ref_h, ref_n = _run(accumulate_hessian, inputs, mods)
    assert len(products) == len(inputs)  # one product per input tensor, not one per Linear
    for m in mods:
        assert torch.equal(got_h[id(m)], ref_h[id(m)])  # the same bits
        assert torch.equal(got_n[id(m)], ref_n[id(m)])


def test_changed_or_new_tensors_are_recomputed() -> None:
    m = torch.nn.Linear(16, 4)
    fast = make_shared_accumulate(accumulate_hessian)
    x = torch.randn(1, 8, 16)
    h, _ = fast(x, m, torch.zeros(16, 16), torch.zeros(()))
    x.mul_(2)  # changed in place: its version moves, so the product is recomputed
    h2, _ = fast(x, m, torch.zeros(16, 16), torch.zeros(()))
    assert torch.allclose(h2, 4 * h)
    wide = torch.nn.Linear(8, 2)  # another width: never the cached product
    h3, _ = fast(torch.randn(1, 8, 8), wide, torch.zeros(8, 8), torch.zeros(()))
    assert h3.shape == (8, 8)


def test_other_modules_use_the_engine_function() -> None:
    seen = []

    def orig(inp, module, hessian, num_samples):  # type: ignore[no-untyped-def]
        seen.append(type(module).__name__)
        return hessian, num_samples

    fast = make_shared_accumulate(orig)
    conv = torch.nn.Conv2d(2, 2, 3)
    fast(torch.randn(1, 2, 5, 5), conv, torch.zeros(18, 18), torch.zeros(()))
    assert seen == ["Conv2d"]


def test_patches_are_scoped() -> None:
    from llmcompressor.modifiers.gptq import base
    hessian = base.accumulate_hessian
    with shared_hessian(False):
        assert base.accumulate_hessian is hessian
    with shared_hessian(True):
        assert base.accumulate_hessian is not hessian
    assert base.accumulate_hessian is hessian
