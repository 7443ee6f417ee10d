"""Repo names and scheme tags.

The default repo name is `<base>-<recipe>` (`SmolLM2-135M-Instruct-gptq-int4`): the recipe's
name is in it, so two recipes of one scheme (gptq-int4 and rtn-int4 are both W4A16) never
share a repo. It is made valid for the Hub (letters, digits, `-`, `_`, `.`; no `--` or `..`;
starting and ending with a letter or digit; at most 96 characters): a base name too long is
cut and given 8 hex digits of its sha256, so two long bases stay apart too.

The scheme tags are the ones users know from Red Hat AI / Neural Magic releases
(quantize.recipe.schemes holds each scheme's tag); the card's tags use them.
"""

from __future__ import annotations

import hashlib
import re

from quantize.recipe.recipe import Recipe
from quantize.recipe.schemes import SCHEMES

MAX_NAME = 96  # the Hub's limit on a repo name


def scheme_tag(scheme: str, kv_cache: str | None) -> str:
    """`W4A16`, `FP8-dynamic`, ...; an FP8 KV cache gives `FP8-KV` (or `<tag>-FP8-KV`)."""
    s = SCHEMES[scheme]
    if kv_cache == "fp8":  # FP8 weights and KV cache: the one tag says both
        return "FP8-KV" if s.weight_type == "float" else f"{s.tag}-FP8-KV"
    return s.tag


def hub_safe(text: str) -> str:
    """`text` as a Hub name part: other characters become `-`, no `--`/`..`, no separator at
    either end (may be empty)."""
    out = re.sub(r"[^A-Za-z0-9._-]+", "-", text)
    out = re.sub(r"-{2,}", "-", out)
    out = re.sub(r"\.{2,}", ".", out)
    return out.strip("-._")


def default_repo_name(base_name: str, recipe: Recipe) -> str:
    """`<base>-<recipe>`, valid for the Hub (see the module docstring)."""
    base = hub_safe(base_name) or "model"
    tail = hub_safe(recipe.name) or hub_safe(scheme_tag(recipe.scheme, recipe.kv_cache))
    tail = tail[:MAX_NAME - 11].rstrip("-._")  # room for at least one base character + hash
    name = f"{base}-{tail}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(base_name.encode()).hexdigest()[:8]
    keep = MAX_NAME - len(tail) - len(digest) - 2
    return f"{base[:keep].rstrip('-._')}-{digest}-{tail}"
