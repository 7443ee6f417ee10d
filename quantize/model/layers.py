"""The layers a recipe targets, read from a meta-device model (config.json alone, no weights):
which Linears (and fused MoE expert projections) a target list matches, the group size they
get, and which experts module a per-expert projection belongs to. One home for these rules:
pre-flight, the engine, `plan` and `fit` ask here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quantize.errors import PreflightError
from quantize.model.config import ModelConfig, build_hf_config
from quantize.recipe.recipe import Override, Recipe
from quantize.recipe.schemes import SCHEMES

_AUTO_CANDIDATES = (128, 64, 32, 16)
PRESET_GROUP_SIZE = 128  # compressed-tensors' preset default for grouped schemes (W4A16...)


@dataclass(frozen=True)
class Layer:
    name: str
    in_features: int
    out_features: int
    copies: int = 1  # a fused experts module's projection stands for one layer per expert


def meta_model(config: ModelConfig, *, trust_remote_code: bool = False) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    cfg = build_hf_config(config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code)


def targeted_layers(model: Any, targets: list[str], ignore: list[str]) -> list[Layer]:
    """The Linear layers the engine will quantize, matched exactly as compressed-tensors does."""
    from compressed_tensors.utils import match_named_modules

    from quantize.model.moe import fused_expert_projections

    return [
        Layer(name, m.in_features, m.out_features)
        for name, m in match_named_modules(model, targets, ignore)
        if hasattr(m, "in_features")
    ] + [Layer(*p) for p in fused_expert_projections(model, targets, ignore)]  # MoE experts


def divisors(layers: list[Layer]) -> list[int]:
    return [g for g in _AUTO_CANDIDATES if all(lay.in_features % g == 0 for lay in layers)]


def resolve_group_size(recipe: Recipe, layers: list[Layer]) -> int | None:
    """The group size to use: the recipe's, checked against every targeted layer, or `auto`."""
    if not SCHEMES[recipe.scheme].group:
        return None
    gs = recipe.group_size
    if gs is None:
        gs = PRESET_GROUP_SIZE
    fits = divisors(layers)
    if gs == "auto":
        if not fits:
            raise PreflightError(
                problem="no group size in 128/64/32/16 divides every targeted layer",
                hint="add the odd layers to `ignore` or use a per-channel scheme")
        return fits[0]
    bad = [lay for lay in layers if lay.in_features % gs != 0]
    if bad:
        ok = ", ".join(map(str, fits)) or "none of 128/64/32/16"
        raise PreflightError(
            problem=f"group_size {gs} does not divide the input size of {len(bad)} targeted "
                    f"layer(s), e.g. {bad[0].name} (in_features {bad[0].in_features})",
            hint=f"sizes that divide every targeted layer: {ok}; set group_size to one of "
                 "them or `auto`")
    return gs


def override_group_size(ov: Override, group_size: int | None) -> int | None:
    """The group size an override's layers get. One rule for pre-flight, the engine
    (backends/llmcompressor.py config_groups) and plan: the override's own integer group_size;
    otherwise (none given, or `auto`) the recipe's resolved group size; when the recipe's own
    scheme has no groups, compressed-tensors' preset default (128). None for a per-channel
    override scheme."""
    if not SCHEMES[ov.scheme].group:
        return None
    if isinstance(ov.group_size, int):
        return ov.group_size
    return group_size if group_size is not None else PRESET_GROUP_SIZE


def experts_module(name: str) -> str | None:
    """The experts module a per-expert projection belongs to (`...mlp.experts`), or None."""
    head, sep, _ = name.partition(".experts.")
    return head + ".experts" if sep else None
