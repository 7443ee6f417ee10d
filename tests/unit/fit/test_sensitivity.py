"""quantize.fit.sensitivity: the replay from a unit's decoder layer gives the logits a whole
forward gives, and `low_only` measures only the lowest precision."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantize.fit.sensitivity import Replay, SensitivityKey, measure
from quantize.fit.units import build_units
from quantize.planner.sources import load_source
from quantize.planner.weights import meta
from quantize.recipe.recipe import load_recipe


@pytest.fixture(scope="module")
def model(tiny_model: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.mark.parametrize("changed", ["model.layers.0.self_attn.q_proj",
                                     "model.layers.1.mlp.down_proj"])
def test_replay_from_a_layer_gives_the_whole_forward(model, changed: str) -> None:  # type: ignore[no-untyped-def]
    ids = torch.randint(0, 1000, (1, 24))
    with torch.inference_mode():
        replay = Replay(model, ids)
        assert replay.layers is not None and len(replay.inputs) == 2  # the fast path ran
        weight = dict(model.named_modules())[changed].weight
        saved = weight.data.clone()
        weight.data = saved * 0.5
        try:
            fast = replay.logits((changed,))
            whole = model(ids, use_cache=False).logits
        finally:
            weight.data = saved
        unchanged = replay.logits((changed,))
    torch.testing.assert_close(fast, whole, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(fast, unchanged, atol=1e-3)  # the change did reach the logits
    torch.testing.assert_close(torch.log_softmax(unchanged, -1), replay.ref, rtol=1e-5,
                               atol=1e-5)


def test_low_only_measures_the_low_bits_and_scales_the_rest(tiny_model: Path,
                                                            tmp_path: Path) -> None:
    base = load_recipe("gptq-int4-asym")
    units = build_units(meta(load_source(str(tiny_model)).config), base, (4, 8, 16), 2)
    tokens = [list(range(5, 69))]
    key = SensitivityKey("cal", "m", base.scheme, units.group, [4, 8, 16], 32, 1,
                         low_only=True)
    costs = measure(tiny_model, units, tokens, 32, tmp_path / "s.json", key)
    for u in units.units:
        c = costs[u.name]
        assert c[16] == 0.0 and c[4] > 0.0
        assert c[8] == pytest.approx(c[4] / 256)
    saved = json.loads((tmp_path / "s.json").read_text())
    assert saved["tokens"] == 32  # fewer tokens than one sample: its first 32
    assert saved["key"]["low_only"] is True


def test_samples_spread_the_tokens_over_several_samples(tiny_model: Path,
                                                        tmp_path: Path) -> None:
    base = load_recipe("gptq-int4-asym")
    units = build_units(meta(load_source(str(tiny_model)).config), base, (4, 16), 2)
    tokens = [list(range(5 + i, 69 + i)) for i in range(6)]
    one = SensitivityKey("cal", "m", base.scheme, units.group, [4, 16], 32, 1, low_only=True)
    four = SensitivityKey("cal", "m", base.scheme, units.group, [4, 16], 32, 1, low_only=True,
                          samples=4)
    first = measure(tiny_model, units, tokens, 32, tmp_path / "one.json", one)
    spread = measure(tiny_model, units, tokens, 32, tmp_path / "four.json", four)
    assert json.loads((tmp_path / "four.json").read_text())["tokens"] == 32  # 4 x 8
    assert json.loads((tmp_path / "four.json").read_text())["key"]["samples"] == 4
    assert first != spread  # other tokens, other costs
    # the cache answers only the same key: the one-sample file is not reused for four
    again = measure(tiny_model, units, tokens, 32, tmp_path / "one.json", four)
    assert again == spread


@pytest.mark.parametrize("observer", ["imatrix_mse", "mse"])
def test_the_recipes_observer_rounds_with_smaller_costs(tiny_model: Path, tmp_path: Path,
                                                       observer: str) -> None:
    """An observer that searches each group's range (weighted by E[x^2] on the reference pass,
    for imatrix_mse) rounds closer than min-max: its costs are lower on most units."""
    base = load_recipe("gptq-int4-asym")
    units = build_units(meta(load_source(str(tiny_model)).config), base, (4, 16), 2)
    tokens = [list(range(5, 69))]
    plain = SensitivityKey("cal", "m", base.scheme, units.group, [4, 16], 64, 1, low_only=True)
    searched = SensitivityKey("cal", "m", base.scheme, units.group, [4, 16], 64, 1,
                              low_only=True, observer=observer)
    a = measure(tiny_model, units, tokens, 64, tmp_path / "a.json", plain)
    b = measure(tiny_model, units, tokens, 64, tmp_path / "b.json", searched)
    lower = sum(b[u.name][4] < a[u.name][4] for u in units.units)
    assert lower > len(units.units) / 2, (a, b)
    assert json.loads((tmp_path / "b.json").read_text())["key"]["observer"] == observer
