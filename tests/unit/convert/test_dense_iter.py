"""quantize.convert.dense_iter: every quantized HF input read as float32 weights in HF
naming (the feed of the GGUF writer), equal to the source's own dequantization."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quantize.convert.dense_iter import dense_tensors
from quantize.model.formats import detect


@pytest.mark.parametrize("source", ["fp8_dir", "gptq_dir", "awq_dir", "ct_dir"])
def test_dequantized_weights_equal_the_source(source: str, request: pytest.FixtureRequest
                                              ) -> None:
    folder, ref = request.getfixturevalue(source)
    tensors = dense_tensors(detect(folder))
    got = dict(tensors())
    assert set(got) == set(ref)
    for name, want in ref.items():
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name], want.float(), rtol=0, atol=1e-6, msg=name)
    assert [n for n, _ in tensors()] == list(got)  # callable again: a second pass


def test_dense_input_is_passed_as_stored(bf16_dir: Path) -> None:
    got = dict(dense_tensors(detect(bf16_dir))())
    assert "model.embed_tokens.weight" in got and all(t.dtype == torch.float32
                                                      for t in got.values())
