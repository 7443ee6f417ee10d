"""quantize.fit: the multiple-choice knapsack, the units (fused shards tied), the budget and
the recipe it writes. Meta-device models only: no weights."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from quantize.fit import knapsack
from quantize.fit.knapsack import Item


def _random_classes(seed: int, n: int = 7) -> list[list[Item]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        base = rng.randint(50, 500)
        out.append([Item(base, rng.uniform(1.0, 5.0)), Item(2 * base, rng.uniform(0.1, 1.0)),
                    Item(4 * base, 0.0)])
    return out


def _brute(classes: list[list[Item]], budget: int) -> float:
    best = math.inf
    for picks in itertools.product(*[range(len(c)) for c in classes]):
        size = sum(c[j].bytes for c, j in zip(classes, picks, strict=True))
        if size <= budget:
            best = min(best, sum(c[j].cost for c, j in zip(classes, picks, strict=True)))
    return best


@pytest.mark.parametrize("seed", range(5))
def test_budget_respected_and_near_optimal(seed: int) -> None:
    classes = _random_classes(seed)
    table = knapsack.build(classes)
    low = sum(c[0].bytes for c in classes)
    for budget in (low, low + 300, low + 1500, low * 2, low * 4):
        sol = table.solve(budget)
        assert sol.feasible
        assert sol.bytes <= budget  # never over, whatever the rounding
        real = sum(c[j].bytes for c, j in zip(classes, sol.picks, strict=True))
        assert real == sol.bytes
        exact = _brute(classes, budget)
        assert sol.cost >= exact - 1e-9
        # rounding up per item loses little: optimal at a budget 1% smaller is no worse
        assert sol.cost <= _brute(classes, int(budget * 0.99)) + 1e-9


def test_monotonic_in_budget() -> None:
    classes = _random_classes(11, n=12)
    table = knapsack.build(classes)
    low = sum(c[0].bytes for c in classes)
    high = sum(c[-1].bytes for c in classes)
    budgets = [*range(low, high, max(1, (high - low) // 200)), high]
    costs = [table.solve(b).cost for b in budgets]
    assert all(b <= a + 1e-12 for a, b in itertools.pairwise(costs))
    assert costs[0] > costs[-1]
    assert table.solve(high + high // 100).cost == 0.0  # all at the top (rounding: < 1%)


def test_below_the_smallest_is_infeasible() -> None:
    classes = _random_classes(3)
    low = sum(c[0].bytes for c in classes)
    table = knapsack.build(classes)
    assert not table.solve(low - 1).feasible
    assert table.solve(low).picks == [0] * len(classes)


def test_smallest_within_cost() -> None:
    classes = _random_classes(5)
    table = knapsack.build(classes)
    high = sum(c[-1].bytes for c in classes)
    full = table.solve(high + high // 100)  # rounding up costs under 1%
    target = table.solve(sum(c[1].bytes for c in classes)).cost
    small = table.smallest_within(target, high)
    assert small.feasible and small.cost <= target + 1e-12
    assert small.bytes <= sum(c[1].bytes for c in classes)
    assert full.cost == 0.0


def _llama_meta():  # type: ignore[no-untyped-def]
    from quantize.planner.sources import load_source
    from quantize.planner.weights import meta

    return meta(load_source("meta-llama/Llama-3.1-8B-Instruct").config)


def test_units_tie_fused_shards() -> None:
    from quantize.fit.units import build_units
    from quantize.recipe.recipe import DEFAULT_RECIPE, load_recipe

    base = load_recipe(DEFAULT_RECIPE)
    units = build_units(_llama_meta(), base, (4, 8, 16), 2)
    names = {u.name for u in units.units}
    assert "model.layers.0.self_attn.q_proj+k_proj+v_proj" in names
    assert "model.layers.0.mlp.gate_proj+up_proj" in names
    assert len(units.units) == 32 * 4  # qkv, o, gate/up, down per block
    qkv = next(u for u in units.units if u.name.endswith("0.self_attn.q_proj+k_proj+v_proj"))
    assert len(qkv.layers) == 3
    sizes = [c.bytes for c in qkv.choices]
    assert sizes == sorted(sizes) and qkv.choice(16).bytes == qkv.params * 2


def test_written_recipe_passes_preflight_fused_check(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from quantize.checks.preflight import check_fused_schemes, layer_schemes
    from quantize.fit.assign import Problem, make_assignment
    from quantize.fit.budget import Budget
    from quantize.fit.recipe_writer import fit_recipe, write_recipe
    from quantize.fit.units import build_units
    from quantize.model.config import model_shape
    from quantize.planner.sources import load_source
    from quantize.recipe.recipe import DEFAULT_RECIPE, load_recipe

    base = load_recipe(DEFAULT_RECIPE)
    model = _llama_meta()
    units = build_units(model, base, (4, 8, 16), 2)
    source = load_source("meta-llama/Llama-3.1-8B-Instruct")
    p = Problem(source, model_shape(source.config, model.config), model, base, units,
                Budget(10**12))
    bits = {u.name: (4, 8, 16)[i % 3] for i, u in enumerate(units.units)}
    costs = {u.name: {c.bits: 0.0 for c in u.choices} for u in units.units}
    a = make_assignment(p, bits, costs, True)
    recipe = load_recipe(str(write_recipe(fit_recipe(p, a, "fit-test"), tmp_path)))
    check_fused_schemes(layer_schemes(model, recipe, units.group))  # raises on a split
    assert recipe.overrides and recipe.overrides[-1].scheme == "W8A16"
    assert a.counts[4][0] + a.counts[8][0] + a.counts[16][0] == 32 * 7
    from quantize.planner.weights import estimate_weights, recipe_layers

    planned = estimate_weights(model, 2, recipe_layers(model, recipe, units.group)).total
    assert planned == a.size  # the fit's bytes are the planner's bytes for its recipe


def test_budget_leaves_room_for_the_kv_cache() -> None:
    from quantize.fit.budget import Serving, check_fit, weight_budget
    from quantize.model.config import model_shape
    from quantize.planner.gpus import find
    from quantize.planner.sources import load_source

    source = load_source("meta-llama/Llama-3.1-8B-Instruct")
    model = _llama_meta()
    shape = model_shape(source.config, model.config)
    s = Serving(find("l4"), 1, 8192, 8)
    b = weight_budget(shape, s, 0, 64)
    assert b.per_gpu is not None and 0 < b.total == b.per_gpu
    assert check_fit(shape, s, b.total, 0)[0]  # at the budget: C sequences fit
    assert not check_fit(shape, s, b.total + 64 * (1 << 20), 0)[0]  # 64 MiB more: not


def test_moe_experts_are_one_unit_per_layer_and_the_fit_recipe_keeps_them_together(
        tmp_path) -> None:  # type: ignore[no-untyped-def]
    """fit never gives a MoE layer's experts two schemes (vLLM refuses that at load): all of a
    layer's expert projections, for all experts, are one knapsack item, written as one
    pattern; pre-flight then sees one scheme per layer's experts."""
    from quantize.checks.preflight import check_fused_schemes, layer_schemes
    from quantize.fit.assign import Problem, make_assignment
    from quantize.fit.budget import Budget
    from quantize.fit.recipe_writer import fit_recipe, write_recipe
    from quantize.fit.units import build_units
    from quantize.model.config import model_shape
    from quantize.model.layers import experts_module
    from quantize.planner.sources import load_source
    from quantize.planner.weights import estimate_weights, meta, recipe_layers
    from quantize.recipe.recipe import load_recipe

    source = load_source("Qwen/Qwen3-30B-A3B")
    model = meta(source.config)
    base = load_recipe("gptq-int4")
    units = build_units(model, base, (4, 8, 16), 2)
    experts = [u for u in units.units if u.name.endswith(".mlp.experts")]
    assert len(experts) == 48
    assert {ln.rpartition(".")[2] for ln in experts[0].layers} == {
        "gate_proj", "up_proj", "down_proj"}
    assert experts[0].params == 128 * 3 * 2048 * 768  # every expert counted
    p = Problem(source, model_shape(source.config, model.config), model, base, units,
                Budget(10**13))
    bits = {u.name: (4, 8, 16)[i % 3] for i, u in enumerate(units.units)}
    costs = {u.name: {c.bits: 0.0 for c in u.choices} for u in units.units}
    a = make_assignment(p, bits, costs, True)
    recipe = load_recipe(str(write_recipe(fit_recipe(p, a, "fit-moe"), tmp_path)))
    schemes = layer_schemes(model, recipe, units.group)
    check_fused_schemes(schemes)  # raises on a split
    per_layer: dict[str, set[object]] = {}
    for ls in schemes:
        if (mod := experts_module(ls.layer.name)) is not None:
            per_layer.setdefault(mod, set()).add(ls.scheme)
    assert {len(s) for s in per_layer.values()} == {1}
    assert {next(iter(s)) for s in per_layer.values()} == {"W4A16", "W8A16", None}
    planned = estimate_weights(model, 2, recipe_layers(model, recipe, units.group)).total
    assert planned == a.size
