"""quantize.fit.mixed: a recipe's mixed_precision resolved into an ordinary override within
its budget, measured when the model is held whole, by the prior otherwise; the planner sizes
such a recipe at its budget."""

from __future__ import annotations

from pathlib import Path

import pytest

from quantize.fit.mixed import allocate
from quantize.planner.sources import load_source
from quantize.planner.weights import estimate_weights, meta, recipe_layers
from quantize.recipe.recipe import load_recipe


@pytest.fixture
def recipe():  # type: ignore[no-untyped-def]
    r = load_recipe("gptq-int4-mixed")
    assert r.mixed_precision is not None
    return r.model_copy(update={"mixed_precision": r.mixed_precision.model_copy(
        update={"budget": 1.2, "tokens": 32})})


@pytest.mark.parametrize("resident", [True, False])
def test_allocation_is_an_override_within_the_budget(tiny_model: Path, tmp_path: Path,
                                                     recipe, resident: bool) -> None:  # type: ignore[no-untyped-def]
    samples = [list(range(5, 69)), list(range(70, 134))]
    resolved, summary = allocate(tiny_model, recipe, samples, "cpu", resident, tmp_path, "fp")
    assert resolved.mixed_precision is None and resolved.name == recipe.name
    assert summary.measured is resident
    assert (tmp_path / "sensitivity.json").is_file() is resident
    assert (summary.predicted_recovery is not None) is resident
    assert summary.uniform_bytes < summary.weights_bytes <= summary.budget_bytes
    assert summary.budget_bytes == int(summary.uniform_bytes * 1.2)
    assert summary.units_high, "a 20 % budget raises some units"
    (ov,) = resolved.overrides
    assert ov.scheme == "W8A16"
    # each chosen unit's layers, fused shards together, are in the override
    for unit in summary.units_high:
        parent, _, leaves = unit.rpartition(".")
        assert {f"{parent}.{leaf}" for leaf in leaves.split("+")} <= set(ov.targets)
    # the planner's bytes for the resolved recipe are the allocation's
    model = meta(load_source(str(tiny_model)).config)
    planned = estimate_weights(model, 2, recipe_layers(model, resolved, 64, 2)).total
    assert planned == summary.weights_bytes


def test_the_planner_sizes_a_mixed_recipe_at_its_budget(tiny_model: Path, recipe) -> None:  # type: ignore[no-untyped-def]
    model = meta(load_source(str(tiny_model)).config)
    uniform = recipe.model_copy(update={"mixed_precision": None})
    u = estimate_weights(model, 2, recipe_layers(model, uniform, 64, 2))
    m = estimate_weights(model, 2, recipe_layers(model, recipe, 64, 2))
    assert m.total == u.total + int(u.total * 0.2)
    assert m.quantized - u.quantized == m.total - u.total


def test_samples_and_scales_reach_the_measurement(tiny_model: Path, tmp_path: Path,
                                                  recipe) -> None:  # type: ignore[no-untyped-def]
    import json

    mp = recipe.mixed_precision.model_copy(update={"samples": 2, "scales": "recipe"})
    samples = [list(range(5, 69)), list(range(70, 134))]
    allocate(tiny_model, recipe.model_copy(update={"mixed_precision": mp}), samples, "cpu",
             True, tmp_path, "fp")
    saved = json.loads((tmp_path / "sensitivity.json").read_text())
    assert saved["key"]["samples"] == 2 and saved["tokens"] == 32  # 2 x 16
    assert saved["key"]["observer"] == recipe.observer == "imatrix_mse"
