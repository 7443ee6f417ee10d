"""Checks that run before any calibration work, from config.json alone (a meta-device model:
no weights are read, so this takes seconds even for a 405B model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quantize.errors import PreflightError
from quantize.recipe import SCHEMES, Recipe

_AUTO_CANDIDATES = (128, 64, 32, 16)


@dataclass(frozen=True)
class Layer:
    name: str
    in_features: int
    out_features: int


def meta_model(config: dict[str, Any], *, trust_remote_code: bool = False) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_dict = {k: v for k, v in config.items() if k != "quantization_config"}
    model_type = cfg_dict.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **cfg_dict)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code)


def targeted_layers(model: Any, targets: list[str], ignore: list[str]) -> list[Layer]:
    """The Linear layers the engine will quantize, matched exactly as compressed-tensors does."""
    from compressed_tensors.utils import match_named_modules

    return [
        Layer(name, m.in_features, m.out_features)
        for name, m in match_named_modules(model, targets, ignore)
        if hasattr(m, "in_features")
    ]


def _divisors(layers: list[Layer]) -> list[int]:
    return [g for g in _AUTO_CANDIDATES if all(lay.in_features % g == 0 for lay in layers)]


def resolve_group_size(recipe: Recipe, layers: list[Layer]) -> int | None:
    """The group size to use: the recipe's, checked against every targeted layer, or `auto`."""
    if not SCHEMES[recipe.scheme].group:
        return None
    gs = recipe.group_size
    if gs is None:
        gs = 128  # compressed-tensors' preset default for grouped schemes
    fits = _divisors(layers)
    if gs == "auto":
        if not fits:
            raise PreflightError(
                "no group size in 128/64/32/16 divides every targeted layer; add the odd "
                "layers to `ignore` or use a per-channel scheme")
        return fits[0]
    bad = [lay for lay in layers if lay.in_features % gs != 0]
    if bad:
        ok = ", ".join(map(str, fits)) or "none of 128/64/32/16"
        raise PreflightError(
            f"group_size {gs} does not divide the input size of {len(bad)} targeted layer(s), "
            f"e.g. {bad[0].name} (in_features {bad[0].in_features}); sizes that divide every "
            f"targeted layer: {ok}; set group_size to one of them or `auto`")
    return gs


def check(recipe: Recipe, config: dict[str, Any]) -> dict[str, Any]:
    """All pre-flight checks; returns the facts later stages need (resolved group size...)."""
    model = meta_model(config, trust_remote_code=recipe.trust_remote_code)
    layers = targeted_layers(model, recipe.targets, recipe.ignore)
    if not layers:
        raise PreflightError(f"targets {recipe.targets} minus ignore {recipe.ignore} match no "
                             "layer of this model; fix `targets`/`ignore`")
    group_size = resolve_group_size(recipe, layers)
    for ov in recipe.overrides:
        sub = targeted_layers(model, ov.targets, recipe.ignore)
        if not sub:
            raise PreflightError(f"override targets {ov.targets} match no layer; fix them")
        if SCHEMES[ov.scheme].group:
            resolve_group_size(recipe.model_copy(update={"scheme": ov.scheme,
                                                         "group_size": ov.group_size}), sub)
    names = {n for n, _ in model.named_modules()}
    if recipe.kv_cache and not any(n.endswith(("k_proj", "v_proj")) for n in names):
        raise PreflightError("kv_cache: fp8 needs separate k_proj/v_proj layers, which this "
                             "model lacks; remove kv_cache from the recipe")
    tied = bool(config.get("tie_word_embeddings"))
    if tied and any(lay.name.endswith("lm_head") for lay in layers):
        raise PreflightError("lm_head is tied to the input embeddings, so quantizing it would "
                             "also change the embeddings; add lm_head to `ignore`")
    return {"group_size": group_size, "layers": len(layers)}
