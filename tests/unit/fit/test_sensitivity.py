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
from quantize.spec.recipe import load_recipe


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
