"""The knapsack's items: every targeted Linear of the model, with the layers vLLM fuses
(q/k/v, gate/up) tied into one unit, and each unit's bytes at each candidate precision.

A unit is one "class" of the multiple-choice knapsack: exactly one precision per unit, so
fused shards always share a scheme (pre-flight's check_fused_schemes, vLLM's "some but not
all shards" refusal). Bytes come from the planner's format rules (planner/weights.py), the
same numbers `quantize plan` and the export size use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quantize.model.layers import (
    experts_module,
    override_group_size,
    resolve_group_size,
    targeted_layers,
)
from quantize.planner.weights import LayerPlan, estimate_weights, format_for, linear_bytes
from quantize.recipe.recipe import Override, Recipe
from quantize.recipe.schemes import SCHEMES, SchemeName
from quantize.vllm.layers import FUSED_GROUPS

HIGH_SCHEME: SchemeName = "W8A16"  # the 8-bit choice: weight-only INT8, same group size


@dataclass(frozen=True)
class Choice:
    bits: int
    scheme: str | None  # None: left at the model dtype (the recipe's `ignore`)
    group_size: int | None
    bytes: int


@dataclass(frozen=True)
class Unit:
    name: str  # e.g. model.layers.3.self_attn.q_proj+k_proj+v_proj
    layers: tuple[str, ...]
    params: int
    choices: tuple[Choice, ...]  # lowest precision first

    def choice(self, bits: int) -> Choice:
        return next(c for c in self.choices if c.bits == bits)


@dataclass(frozen=True)
class Units:
    units: list[Unit]
    fixed: int  # bytes outside the units (embeddings, norms, lm_head): model dtype
    replicated: int  # bytes every tensor-parallel rank holds in full
    group: int | None  # the base recipe's resolved group size
    dtype_bytes: int

    def size(self, bits: dict[str, int]) -> int:
        return self.fixed + sum(u.choice(bits[u.name]).bytes for u in self.units)

    def uniform(self, b: int) -> dict[str, int]:
        return {u.name: b for u in self.units}


def check_bits(base: Recipe, bits: tuple[int, ...]) -> tuple[int, ...]:
    from quantize.errors import FitError

    low = SCHEMES[base.scheme].weight_bits
    allowed = sorted({low, 8, 16})
    bad = [b for b in bits if b not in allowed]
    if bad or len(bits) < 2:
        raise FitError(problem=f"--bits {','.join(map(str, bits))}: choose two or more of "
                               f"{','.join(map(str, allowed))} (the base recipe {base.name} is "
                               f"{low}-bit)")
    return tuple(sorted(set(bits)))


def _fused_key(name: str) -> tuple[str, tuple[str, ...]] | None:
    """The fused layer a Linear belongs to in vLLM: its q/k/v or gate/up group, or, for a MoE
    expert projection, the whole experts module (vLLM refuses mixed schemes across a layer's
    experts: pre-flight's check_fused_schemes)."""
    if (mod := experts_module(name)) is not None:
        return mod, ("experts",)
    parent, _, leaf = name.rpartition(".")
    for group in FUSED_GROUPS:
        if leaf in group:
            return parent, group
    return None


def build_units(model: Any, base: Recipe, bits: tuple[int, ...], dtype_bytes: int) -> Units:
    """The units of a meta-device model under the base recipe's targets and ignore list."""
    layers = targeted_layers(model, base.targets, base.ignore)
    group = resolve_group_size(base, layers)
    actorder = base.gptq.actorder if base.gptq else None
    low = SCHEMES[base.scheme].weight_bits
    grouped: dict[str, list[Any]] = {}
    for lay in layers:
        key = _fused_key(lay.name)
        uname = key[0] if key and key[1] == ("experts",) else (
            f"{key[0]}.{'+'.join(key[1])}" if key else lay.name)
        grouped.setdefault(uname, []).append(lay)
    hi_group = override_group_size(Override(targets=["x"], scheme=HIGH_SCHEME), group)
    units = []
    for uname, lays in grouped.items():
        choices = []
        for b in sorted(bits):
            if b == 16:
                scheme, g = None, None
                size = sum(x.out_features * x.in_features * dtype_bytes * x.copies
                           for x in lays)
            else:
                scheme, g = (base.scheme, group) if b == low else (HIGH_SCHEME, hi_group)
                fmt = format_for(scheme, g, actorder)
                size = sum(linear_bytes(x.out_features, x.in_features, fmt, dtype_bytes)
                           * x.copies for x in lays)
            choices.append(Choice(b, scheme, g, size))
        params = sum(x.out_features * x.in_features * x.copies for x in lays)
        units.append(Unit(uname, tuple(x.name for x in lays), params, tuple(choices)))
    dense = estimate_weights(model, dtype_bytes, LayerPlan({}, None))
    in_units = sum(u.choice(16).bytes if 16 in bits else u.params * dtype_bytes for u in units)
    return Units(units, dense.total - in_units, dense.replicated, group, dtype_bytes)
