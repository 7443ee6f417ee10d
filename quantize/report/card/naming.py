"""Repo names: `<base>-<tag>`, with the tags users know from Red Hat AI / Neural Magic
releases (quantize.spec.schemes holds each scheme's tag)."""

from __future__ import annotations

from quantize.spec.recipe import Recipe
from quantize.spec.schemes import SCHEMES


def scheme_tag(scheme: str, kv_cache: str | None) -> str:
    """`W4A16`, `FP8-dynamic`, ...; an FP8 KV cache gives `FP8-KV` (or `<tag>-FP8-KV`)."""
    s = SCHEMES[scheme]
    if kv_cache == "fp8":  # FP8 weights and KV cache: the one tag says both
        return "FP8-KV" if s.weight_type == "float" else f"{s.tag}-FP8-KV"
    return s.tag


def default_repo_name(base_name: str, recipe: Recipe) -> str:
    return f"{base_name}-{scheme_tag(recipe.scheme, recipe.kv_cache)}"
