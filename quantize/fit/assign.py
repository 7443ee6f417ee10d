"""From a model and a budget to a per-unit precision assignment: the units, the budget, the
costs (measured or prior) and the knapsack, tied together. No weights are read here; the
costs come in from quantize.fit.sensitivity."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from quantize.errors import FitError
from quantize.fit import knapsack
from quantize.fit.budget import Budget, Serving, nearest, weight_budget
from quantize.fit.sensitivity import Costs
from quantize.fit.units import Units, build_units, check_bits
from quantize.model.config import Shape, model_shape
from quantize.planner.sources import ModelSource, load_source
from quantize.planner.weights import meta
from quantize.recipe.recipe import Recipe


@dataclass
class Problem:
    """Everything fixed before any cost is known."""

    source: ModelSource
    shape: Shape
    model: Any  # meta-device
    base: Recipe
    units: Units
    budget: Budget
    min_recovery: float | None = None


@dataclass
class Assignment:
    bits: dict[str, int]  # unit name -> bits
    size: int  # whole-model weight bytes
    cost: float
    measured: bool  # costs measured (KL) or a prior
    counts: dict[int, tuple[int, int]] = field(default_factory=dict)  # bits -> (layers, bytes)

    @property
    def predicted_recovery(self) -> float | None:
        return math.exp(-self.cost) if self.measured else None


def setup(model_spec: str, base: Recipe, serving: Serving | None, max_weights: int | None,
          bits: tuple[int, ...], min_recovery: float | None) -> Problem:
    """Check the inputs and fix the problem; raises one-line errors before any long work.
    A base recipe's own mixed_precision is dropped: fit's assignment takes its place."""
    base = base.model_copy(update={"mixed_precision": None})
    if min_recovery is not None and not 0.0 < min_recovery <= 1.0:
        raise FitError(problem=f"--min-recovery {min_recovery} is outside (0, 1]: recovery is "
                               "the share of the fp16 model's perplexity kept (1.0 = no loss)",
                       hint="give e.g. 0.9")
    if serving is None and max_weights is None:
        raise FitError(problem="no memory budget given",
                       hint="give --gpu (with --max-model-len and --concurrency) or "
                            "--max-weights")
    if serving is not None and (serving.gpus < 1 or serving.context < 1
                                or serving.concurrency < 1):
        raise FitError(problem="--gpus, --max-model-len and --concurrency must be positive")
    bits = check_bits(base, bits)
    source = load_source(model_spec)
    model = meta(source.config)
    shape = model_shape(source.config, model.config)
    units = build_units(model, base, bits, shape.dtype_bytes)
    if serving is not None:
        budget = weight_budget(shape, serving, units.replicated, units.group)
        if max_weights is not None:
            budget = Budget(min(max_weights, budget.total), budget.per_gpu, serving,
                            budget.kv_needed, budget.activation, budget.nontorch,
                            budget.requested)
    else:
        budget = Budget(int(max_weights or 0))
    low = units.size(units.uniform(bits[0]))
    if budget.total < low:
        if serving is not None:
            raise nearest(shape, serving, low, units.replicated, units.group)
        raise FitError(problem=f"--max-weights {budget.total / 1e6:,.1f} MB is below the "
                               f"smallest assignment ({low / 1e6:,.1f} MB: every layer at "
                               f"{bits[0]} bits, embeddings and norms at the model dtype)",
                       hint="give at least that")
    return Problem(source, shape, model, base, units, budget, min_recovery)


def classes(p: Problem, costs: Costs) -> list[list[knapsack.Item]]:
    return [[knapsack.Item(c.bytes, costs[u.name][c.bits]) for c in u.choices]
            for u in p.units.units]


def solve(p: Problem, costs: Costs, measured: bool) -> Assignment:
    """The least-cost assignment within the budget; with --min-recovery (measured costs),
    the smallest one whose predicted recovery reaches it."""
    table = knapsack.build(classes(p, costs))
    room = p.budget.total - p.units.fixed  # the knapsack's share: the units' bytes
    if p.min_recovery is not None and measured:
        sol = table.smallest_within(-math.log(p.min_recovery), room)
        if not sol.feasible:
            best = table.solve(room)
            raise FitError(problem=f"--min-recovery {p.min_recovery}: the best assignment "
                                   f"within the budget predicts {math.exp(-best.cost):.1%}",
                           hint="give more memory (more GPUs, fewer users, shorter context, "
                                "fp8 KV) or lower it")
    else:
        sol = table.solve(room)
    if not sol.feasible:  # setup() checked the lowest precision fits; rounding may not
        raise FitError(problem="no assignment fits the budget once sizes are rounded",
                       hint="give a slightly larger budget")
    return make_assignment(p, {u.name: u.choices[j].bits
                               for u, j in zip(p.units.units, sol.picks, strict=True)},
                           costs, measured)


def make_assignment(p: Problem, bits: dict[str, int], costs: Costs,
                    measured: bool) -> Assignment:
    counts: Counter[int] = Counter()
    sizes: Counter[int] = Counter()
    for u in p.units.units:
        b = bits[u.name]
        counts[b] += len(u.layers)
        sizes[b] += u.choice(b).bytes
    cost = sum(costs[u.name][bits[u.name]] for u in p.units.units)
    return Assignment(bits, p.units.size(bits), cost, measured,
                      {b: (counts[b], sizes[b]) for b in sorted(counts)})
