"""The assignment as an ordinary recipe: the base recipe (DEFAULT_RECIPE) with the 8-bit
units as one `overrides` entry (W8A16, the base recipe's group size) and the 16-bit units
added to `ignore`. Fused shards are listed together (one unit), so pre-flight's fused-shard
check and vLLM's config-group matching (compressed_tensors/utils.py find_matched_target:
exact layer names before the `Linear` class target; a fused qkv_proj matches only when all
of q/k/v name the same group) both accept it."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from quantize.fit.assign import Assignment, Problem
from quantize.fit.units import HIGH_SCHEME, Unit
from quantize.model.layers import experts_module
from quantize.recipe.recipe import Override, Recipe, load_recipe
from quantize.run.files import atomic_write_text


def _targets(unit: Unit) -> list[str]:
    """A unit as recipe targets: its layers' exact names, or for a MoE layer's experts one
    pattern for every expert projection (the engine unfuses them into `experts.<i>.<proj>`
    Linears; vLLM takes one scheme for all of them)."""
    mod = experts_module(unit.layers[0])
    return [f"re:^{re.escape(mod)}\\.\\d+\\."] if mod else list(unit.layers)


def fit_recipe(p: Problem, a: Assignment, name: str) -> Recipe:
    high = [t for u in p.units.units if a.bits[u.name] == 8 and u.choice(8).scheme
            for t in _targets(u)]
    dense = [t for u in p.units.units if a.bits[u.name] == 16 for t in _targets(u)]
    overrides = list(p.base.overrides)
    if high:
        overrides.append(Override(targets=high, scheme=HIGH_SCHEME))
    counts = ", ".join(f"{n} layers at {b} bits" for b, (n, _) in a.counts.items())
    data = p.base.model_dump()
    data.update(name=name, overrides=overrides, ignore=[*p.base.ignore, *dense],
                mixed_precision=None,  # the assignment is made: a base's own is dropped
                description=f"quantize fit of {p.source.name} from {p.base.name}: {counts} "
                f"({a.size / 1e6:,.1f} MB)")
    return Recipe.model_validate(data)


def write_recipe(recipe: Recipe, folder: Path) -> Path:
    """recipe YAML in `folder`, named after the recipe (as load_recipe requires), re-read
    through the strict loader."""
    path = folder / f"{recipe.name}.yaml"
    folder.mkdir(parents=True, exist_ok=True)
    data = recipe.model_dump(mode="json", exclude_defaults=True)
    data = {"name": recipe.name, "description": recipe.description, **data}
    text = ("# written by `quantize fit`: an ordinary recipe; run it with quantize run "
            f"{path}\n" + yaml.safe_dump(data, sort_keys=False, width=100))
    atomic_write_text(path, text)
    load_recipe(str(path))
    return path
