"""quantize/recipe/consumers.py with the recipe: which consumers a recipe advertises, and the
refusal, when the recipe loads, of a consumer its online rotations cannot run in."""

from __future__ import annotations

import pytest

from quantize.errors import RecipeError
from quantize.recipe.consumers import CONSUMERS, ONLINE, PORTABLE, cannot_apply
from quantize.recipe.recipe import available, load_recipe

ROTATED = """name: x
description: d
method: gptq
scheme: W4A16_ASYM
group_size: 64
rotation: {block: 64}
"""


def test_defaults_follow_the_online_transforms() -> None:
    assert load_recipe("gptq-int4-asym").advertised_consumers == PORTABLE
    assert load_recipe("gptq-int4-rotated").advertised_consumers == ONLINE
    assert cannot_apply(ONLINE) == []
    assert set(cannot_apply(PORTABLE)) == {"transformers", "lm-eval-hf"}


def test_every_shipped_recipe_advertises_only_consumers_it_can_run_in() -> None:
    for name in available("recipes"):
        r = load_recipe(name)
        assert set(r.advertised_consumers) <= set(CONSUMERS)
        if r.online_transforms:
            assert cannot_apply(r.advertised_consumers) == [], name


def test_a_rotated_recipe_for_transformers_is_refused_at_load(recipe_file) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RecipeError) as e:
        load_recipe(str(recipe_file(ROTATED + "consumers: [vllm, transformers]\n")))
    msg = str(e.value)
    assert "\n" not in msg and "['transformers']" in msg and "transform_config" in msg
    ok = load_recipe(str(recipe_file(ROTATED + "consumers: [vllm]\n")))
    assert ok.advertised_consumers == ("vllm",)


def test_an_unknown_consumer_is_refused(recipe_file) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RecipeError, match="consumers"):
        load_recipe(str(recipe_file(ROTATED.replace("rotation: {block: 64}\n", "")
                                    + "consumers: [llama.cpp]\n")))
