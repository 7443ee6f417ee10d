from __future__ import annotations

import pytest

from quantize.errors import RecipeError
from quantize.recipe.recipe import (
    EvalRef,
    apply_thresholds,
    available,
    load_calibration,
    load_recipe,
    load_suite,
)

GOOD = """\
name: x
description: test recipe
method: gptq
scheme: W4A16
group_size: 64
"""
AWQ = GOOD.replace("method: gptq", "method: awq").replace("W4A16", "W4A16_ASYM")


def test_every_shipped_recipe_loads_and_names_its_file() -> None:
    names = available("recipes")
    assert {"gptq-int4", "awq-int4", "w8a8-int8", "fp8-dynamic", "fp8-kv", "rtn-int4"} <= set(
        names)
    for name in names:
        r = load_recipe(name)
        assert r.name == name
        assert r.description
        assert "lm_head" in r.ignore


def test_bench_variant_recipes_load() -> None:
    """The 4-bit sweep's variants (bench/variants) are recipes too: one that does not parse
    costs a lent-GPU call (the autoround-sym description once held a bare `: `)."""
    from pathlib import Path

    files = sorted((Path(__file__).parents[3] / "bench" / "variants").glob("*.yaml"))
    assert len(files) >= 10
    for f in files:
        assert load_recipe(str(f)).name == f.stem


def test_shipped_specs_and_suites_load() -> None:
    for name in available("calibration"):
        spec, _ = load_calibration(name)
        assert spec.num_samples > 0
    for name in available("eval"):
        assert load_suite(name).metrics


def test_good_recipe(recipe_file) -> None:  # type: ignore[no-untyped-def]
    r = load_recipe(str(recipe_file(GOOD)))
    assert (r.method, r.scheme, r.group_size, r.ignore) == ("gptq", "W4A16", 64, ["lm_head"])


# (recipe text, line, words of the problem, words of the fix): the error's fields, not its prose
@pytest.mark.parametrize(
    ("text", "line", "problem", "hint"),
    [
        (GOOD + "method: awq\n", 6, "invalid YAML: duplicate key 'method' (first at line 3)",
         "keep one of them"),
        (GOOD + "bits: 4\n", 6, "bits: unknown field", "remove it or check its spelling"),
        (GOOD.replace("scheme: W4A16", "scheme: W5A5"), 4, "scheme: Input should be", None),
        (GOOD.replace("method: gptq\n", ""), 1, "method: required field is missing", "add it"),
        (GOOD + "  nested: [\n", 6, "invalid YAML", None),
        ("- a\n- b\n", None, "expected a YAML mapping", None),
        (GOOD.replace("W4A16", "W8A8"), 1, "per channel/tensor, so group_size does not apply",
         "remove group_size"),
        (GOOD.replace("method: gptq", "method: awq").replace("W4A16", "W8A8").replace(
            "group_size: 64\n", ""), 1, "AWQ is weight-only", "Use W4A16_ASYM/W4A16"),
        (GOOD.replace("W4A16", "FP8_DYNAMIC").replace("group_size: 64\n", ""), 1,
         "GPTQ needs an integer scheme", "Use method: rtn for FP8"),
        (GOOD + "smoothquant: {strength: 0.5}\n", 1, "smoothquant only helps", "Remove it"),
        (GOOD + "awq: {n_grid: 10}\n", 1, "`awq:` options given but method is gptq",
         "set method: awq"),
        (GOOD + "ignore: [Linear]\n", 1, "both targeted and ignored", "remove it from one list"),
        (GOOD + "observer: median\n", 6, "observer: Input should be", None),
        (GOOD.replace("method: gptq", "method: autoround") + "observer: mse\n", 1,
         "AutoRound tunes its own scales", "remove `observer`"),
        (GOOD + "autoround: {iters: 50}\n", 1, "`autoround:` options given but method is gptq",
         "set method: autoround"),
        (GOOD + "gptq: {actorder: sideways}\n", 6, "gptq.actorder", None),
        (AWQ + "awq: {search_samples: 0}\n", 6, "awq.search_samples: Input should be", None),
        (AWQ + "awq: {n_grid: 2}\n", 6, "n_grid 2 is too small for duo_scaling true",
         "use n_grid >= 3"),
        (AWQ + "awq: {n_grid: 3, duo_scaling: both}\n", 6, "duo_scaling both", "n_grid >= 4"),
        (AWQ + "backend: gptqmodel\nawq: {search_samples: 4}\n", 1,
         "searches on every calibration sample", "remove awq.search_samples"),
        (GOOD.replace("method: gptq", "method: autoround").replace("W4A16", "W8A8").replace(
            "group_size: 64\n", ""), 1, "AutoRound is weight-only", "Use W4A16_ASYM/W4A16"),
        (GOOD.replace("method: gptq", "method: autoround").replace("W4A16", "W4A16_ASYM"), 1,
         "AutoRound cannot use the asymmetric scheme W4A16_ASYM", "use scheme W4A16"),
        (GOOD.replace("method: gptq", "method: awq+gptq") + "autoround: {iters: 5}\n", 1,
         "`autoround:` options given but method is awq+gptq", "set method: autoround"),
        (GOOD.replace("name: x", "name: other"), None,
         "name 'other' differs from the file name 'x'", "make them equal"),
        (GOOD + "eval: {suite: default, thresholds: {wiki_ppl: 3.0}}\n", 6,
         "eval.thresholds", None),
        (GOOD + "rotation: {block: 48}\n", 6, "rotation.block 48 is not a power of two",
         "Sylvester Hadamard blocks only"),
        (AWQ + "rotation: {block: 64}\n", 1, "rotation: is measured with methods gptq and rtn",
         "Remove rotation or use method: gptq"),
    ],
)
def test_bad_recipes_name_line_field_and_fix(recipe_file, text: str, line: int | None,  # type: ignore[no-untyped-def]
                                             problem: str, hint: str | None) -> None:
    path = recipe_file(text)
    with pytest.raises(RecipeError) as info:
        load_recipe(str(path))
    err = info.value
    assert (err.path, err.line) == (str(path), line)
    assert err.problem is not None and problem in err.problem
    assert (err.hint is None) if hint is None else (err.hint is not None and hint in err.hint)


@pytest.mark.parametrize("size", ["big", "3"])
def test_a_bad_group_size_names_the_file_line_and_field(recipe_file, size: str) -> None:  # type: ignore[no-untyped-def]
    """Several schema problems at once (each union branch's): one line naming each."""
    path = recipe_file(GOOD.replace("group_size: 64", f"group_size: {size}"))
    with pytest.raises(RecipeError, match=r"x\.yaml:5: group_size") as info:
        load_recipe(str(path))
    assert info.value.path == str(path)


def test_unknown_recipe_suggests_the_closest_name() -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe("gptq-int5")
    assert info.value.problem == "unknown recipe 'gptq-int5'"
    assert info.value.hint is not None and info.value.hint.startswith("did you mean 'gptq-int4'")


def test_missing_recipe_file() -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe("nowhere/recipe.yaml")
    assert (info.value.path, info.value.problem) == ("nowhere/recipe.yaml", "no such file")


def test_recipe_thresholds_may_only_tighten() -> None:
    suite = load_suite("default")
    base = {m.name: m.threshold for m in suite.metrics}
    tight = apply_thresholds(suite, EvalRef(thresholds={"wiki_ppl": 0.99}))
    assert {m.name: m.threshold for m in tight.metrics}["wiki_ppl"] == 0.99
    with pytest.raises(RecipeError) as info:
        apply_thresholds(suite, EvalRef(thresholds={"wiki_ppl": base["wiki_ppl"] / 2}))
    assert info.value.problem is not None and "loosens" in info.value.problem
    assert info.value.hint is not None and "only tighten" in info.value.hint
    with pytest.raises(RecipeError) as info:
        apply_thresholds(suite, EvalRef(thresholds={"nope": 0.9}))
    assert info.value.problem is not None and "not in suite" in info.value.problem
    assert info.value.hint == "fix the name"


def test_calibration_spec_needs_exactly_one_source(tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = tmp_path / "c.yaml"
    p.write_text("name: c\nbuiltin: wiki\npath: x.txt\n")
    with pytest.raises(RecipeError) as info:
        load_calibration(str(p))
    assert (info.value.path, info.value.line) == (str(p), 1)
    assert info.value.problem is not None and "exactly one source" in info.value.problem


def test_suite_metric_needs_direction(tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = tmp_path / "s.yaml"
    p.write_text("name: s\nmetrics:\n  - name: p\n    kind: perplexity\n    builtin: wiki-eval\n"
                 "    threshold: 0.9\n")
    with pytest.raises(RecipeError) as info:
        load_suite(str(p))
    assert (info.value.path, info.value.line) == (str(p), 3)
    assert info.value.problem == "metrics.0.direction: required field is missing"


def test_the_default_recipe_is_shipped_and_the_makefile_agrees() -> None:
    import re

    from quantize.recipe.paths import PROJECT_ROOT
    from quantize.recipe.recipe import DEFAULT_RECIPE

    assert load_recipe(DEFAULT_RECIPE).name == DEFAULT_RECIPE
    make = (PROJECT_ROOT / "Makefile").read_text()
    assert re.search(rf"^RECIPE \?= {re.escape(DEFAULT_RECIPE)}$", make, re.M)


def test_gptq_solves_nvfp4_and_no_other_float_grid() -> None:
    """llm-compressor's GPTQ solves NVFP4's tensor-group grid (nvfp4a16-gptq: 88.6 % against
    round-to-nearest's 80.3 % on the default model); FP8 and MXFP4 stay round-to-nearest."""
    from pydantic import ValidationError

    from quantize.recipe.recipe import Recipe

    base = {"name": "r", "description": "d", "method": "gptq"}
    assert Recipe.model_validate({**base, "scheme": "NVFP4A16"}).scheme == "NVFP4A16"
    for scheme in ("FP8_DYNAMIC", "MXFP4A16"):
        with pytest.raises(ValidationError) as err:
            Recipe.model_validate({**base, "scheme": scheme})
        assert "GPTQ needs an integer scheme" in str(err.value)
    with pytest.raises(ValidationError) as err:
        Recipe.model_validate({**base, "method": "awq", "scheme": "NVFP4A16"})
    assert "or method: gptq for NVFP4" in str(err.value)


def test_a_rotation_needs_the_calibration_pass(recipe_file) -> None:  # type: ignore[no-untyped-def]
    """llm-compressor applies QuIP's rotations when calibration starts, so even round-to-
    nearest runs the calibration pass once a recipe rotates."""
    rtn = GOOD.replace("method: gptq", "method: rtn")
    assert not load_recipe(str(recipe_file(rtn))).needs_calibration
    assert load_recipe(str(recipe_file(rtn + "rotation: {block: 64}\n"))).needs_calibration
