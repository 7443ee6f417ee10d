"""A recipe's `mixed_precision:` made concrete: before the method runs, the layers that get 8
bits are chosen on this model and its calibration data, and the recipe the engine receives is
an ordinary one with those layers as an override (as `quantize fit` writes it).

The same three steps as `quantize fit` with a budget of bytes instead of a GPU: units (fused
shards tied), each unit's measured cost at the recipe's scheme (sensitivity.measure, lowest
precision only: the 8-bit cost follows the 4^-bits law), and the multiple-choice knapsack
within `budget` times the bytes of the export with every layer at the recipe's scheme. When the
model is not held whole on the device (a GPU placement that streams layers from host memory
or disk), the forward passes that measure the costs would stream the whole model once per
unit; the data-free prior (llama.cpp's k-quant emphasis, sensitivity.prior) chooses instead,
and the summary says so.
"""

from __future__ import annotations

import time
from pathlib import Path

from quantize.fit.assign import Problem, solve
from quantize.fit.budget import Budget
from quantize.fit.recipe_writer import fit_recipe
from quantize.fit.sensitivity import VERSION, SensitivityKey, measure, prior
from quantize.fit.units import build_units
from quantize.model.config import model_shape
from quantize.planner.sources import load_source
from quantize.planner.weights import meta
from quantize.progress import info
from quantize.recipe.recipe import Recipe
from quantize.recipe.schemes import SCHEMES
from quantize.run.results import MixedSummary

HIGH_BITS = 8


def allocate(model_path: Path, recipe: Recipe, samples: list[list[int]], device: str,
             resident: bool, out: Path, calibration: str) -> tuple[Recipe, MixedSummary]:
    """The recipe with its mixed precision resolved into an override, and what was chosen."""
    mp = recipe.mixed_precision
    assert mp is not None, "allocate() is for recipes with mixed_precision"
    t0 = time.perf_counter()
    base = recipe.model_copy(update={"mixed_precision": None})
    source = load_source(str(model_path))
    model = meta(source.config)
    shape = model_shape(source.config, model.config)
    low = SCHEMES[base.scheme].weight_bits
    units = build_units(model, base, (low, HIGH_BITS), shape.dtype_bytes)
    uniform = units.size(units.uniform(low))
    problem = Problem(source, shape, model, base, units, Budget(int(uniform * mp.budget)))
    measured = resident and bool(samples)
    if measured:
        observer = (base.observer if mp.scales == "recipe" else None) or "minmax"
        key = SensitivityKey(calibration, str(model_path), base.scheme,
                             units.group, [low, HIGH_BITS], mp.tokens, VERSION, low_only=True,
                             samples=mp.samples, observer=observer)
        costs = measure(model_path, units, samples, mp.tokens, out / "sensitivity.json", key,
                        device)
    else:
        info("mixed precision: the model is not held whole on the device, so the layers are "
             "chosen by the data-free prior (llama.cpp's k-quant rule), not measured")
        costs = prior(units, shape.layers)
    assignment = solve(problem, costs, measured)
    resolved = fit_recipe(problem, assignment, recipe.name)
    resolved = resolved.model_copy(update={"description": recipe.description})
    high = sorted(u.name for u in units.units if assignment.bits[u.name] == HIGH_BITS)
    summary = MixedSummary(
        measured=measured, budget_bytes=problem.budget.total, uniform_bytes=uniform,
        weights_bytes=assignment.size, units_high=high, units=len(units.units),
        predicted_recovery=assignment.predicted_recovery,
        seconds=round(time.perf_counter() - t0, 1))
    info(f"mixed precision: {len(high)} of {len(units.units)} units at {HIGH_BITS} bits, "
         f"{assignment.size / 2**20:,.1f} MiB of a {problem.budget.total / 2**20:,.1f} MiB "
         f"budget ({mp.budget:g}x every layer at {base.scheme})"
         + (f"; perplexity recovery predicted for round-to-nearest "
            f"{summary.predicted_recovery:.1%}"
            if summary.predicted_recovery is not None else ""))
    return resolved, summary
