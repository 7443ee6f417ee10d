"""AWQ's scale search on a subset of the calibration samples (recipe `awq.search_samples`):
which batches it picks, and on a tiny model that it runs the search on exactly those and
equals the library's AWQ when the subset is every sample."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from quantize.backends._awq_search import SubsetSearchAWQModifier, spread


@pytest.mark.parametrize(("batches", "rows", "samples", "picked"), [
    (32, 1, 4, [0, 8, 16, 24]),
    (32, 1, 1, [0]),
    (5, 1, 2, [0, 2]),
    (3, 1, 10, [0, 1, 2]),  # more asked than there are: every batch
    (4, 8, 8, [0]),  # batches of 8 samples (GPU): whole batches
    (4, 8, 9, [0, 2]),
])
def test_spread_picks_whole_batches_evenly(batches: int, rows: int, samples: int,
                                           picked: list[int]) -> None:
    assert spread(batches, rows, samples) == picked


def _awq(tiny_model: Path, awq: Any) -> dict[str, Any]:
    """oneshot(AWQ, then asymmetric W4 g32) on the tiny model with 6 samples of 32 tokens;
    the quantized state dict."""
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    from quantize.backends import _llmc_compat

    _llmc_compat.apply()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (6, 32), generator=gen).tolist()
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    oneshot(model=model, recipe=[awq, QuantizationModifier(
        scheme="W4A16_ASYM", targets=["Linear"], ignore=["lm_head"])],
            dataset=Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 32] * 6}),
            num_calibration_samples=6, max_seq_length=32, shuffle_calibration_samples=False)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.e2e  # three AWQ runs (~13 CPU s)
def test_search_runs_on_the_subset_and_equals_the_library_on_all(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from llmcompressor.modifiers.transform.awq import AWQModifier

    lib = _awq(tiny_model, AWQModifier(n_grid=5))
    every = _awq(tiny_model, SubsetSearchAWQModifier(n_grid=5, search_samples=6))
    assert lib.keys() == every.keys()
    assert all(torch.equal(lib[k], every[k]) for k in lib)

    seen: list[int] = []
    run = SubsetSearchAWQModifier._run_samples

    def counting(self: Any, module: Any) -> list[Any]:
        out = run(self, module)
        seen.append(len(out))
        return out

    monkeypatch.setattr(SubsetSearchAWQModifier, "_run_samples", counting)
    sub = _awq(tiny_model, SubsetSearchAWQModifier(n_grid=5, search_samples=2))
    # 2 layers x 3 mappings (v_proj -> o_proj is skipped for grouped KV heads), each the
    # unscaled reference and 5 candidates, every one on 2 of the 6 samples
    assert seen == [2] * (2 * 3 * 6)
    assert all(torch.isfinite(v).all() for v in sub.values() if v.is_floating_point())
    scales = [k for k in sub if k.endswith("weight_scale")]
    assert scales and any(not torch.equal(sub[k], lib[k]) for k in scales)
