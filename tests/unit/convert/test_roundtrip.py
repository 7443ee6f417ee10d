"""quantize.convert.roundtrip: the per-tensor summary and the logits comparison."""

from __future__ import annotations

import torch

from quantize.convert.produced import TensorCheck
from quantize.convert.roundtrip import compare_logits, summarise


def test_summary_names_the_worst_tensors() -> None:
    s = summarise([TensorCheck("a", "A", 0.1, 0.99), TensorCheck("b", "B", 0.5, 0.999)])
    assert (s.tensors, s.worst_max_abs_tensor, s.min_cosine_tensor) == (2, "B", "A")
    assert summarise([]).tensors == 0


def test_logits_comparison() -> None:
    a = torch.randn(1, 8, 50, generator=torch.Generator().manual_seed(0))
    same = compare_logits(a, a.clone())
    assert same.kl is not None and same.kl < 1e-9 and same.top1 == 1.0 and same.tokens == 8
    other = compare_logits(a, -a)
    assert other.kl is not None and other.kl > 1.0 and other.top1 == 0.0
