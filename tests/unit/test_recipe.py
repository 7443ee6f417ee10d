from __future__ import annotations

import pytest

from quantize.errors import RecipeError
from quantize.spec.recipe import (
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


def test_every_shipped_recipe_loads_and_names_its_file() -> None:
    names = available("recipes")
    assert {"gptq-int4", "awq-int4", "w8a8-int8", "fp8-dynamic", "fp8-kv", "rtn-int4"} <= set(
        names)
    for name in names:
        r = load_recipe(name)
        assert r.name == name
        assert r.description
        assert "lm_head" in r.ignore


def test_shipped_specs_and_suites_load() -> None:
    for name in available("calibration"):
        spec, _ = load_calibration(name)
        assert spec.num_samples > 0
    for name in available("eval"):
        assert load_suite(name).metrics


def test_good_recipe(recipe_file) -> None:  # type: ignore[no-untyped-def]
    r = load_recipe(str(recipe_file(GOOD)))
    assert (r.method, r.scheme, r.group_size, r.ignore) == ("gptq", "W4A16", 64, ["lm_head"])


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (GOOD + "method: awq\n", r"x\.yaml:6.*duplicate key 'method' \(first at line 3\)"),
        (GOOD + "bits: 4\n", r"x\.yaml:6: bits: unknown field"),
        (GOOD.replace("group_size: 64", "group_size: big"), r"x\.yaml:5: group_size"),
        (GOOD.replace("group_size: 64", "group_size: 3"), r"group_size"),
        (GOOD.replace("scheme: W4A16", "scheme: W5A5"), r"x\.yaml:4: scheme"),
        (GOOD.replace("method: gptq\n", ""), r"method: required field is missing"),
        (GOOD + "  nested: [\n", r"x\.yaml:\d+: invalid YAML"),
        ("- a\n- b\n", r"expected a YAML mapping"),
        (GOOD.replace("W4A16", "W8A8"), r"per channel/tensor, so group_size does not apply"),
        (GOOD.replace("method: gptq", "method: awq").replace("W4A16", "W8A8").replace(
            "group_size: 64\n", ""), r"AWQ is weight-only"),
        (GOOD.replace("W4A16", "FP8_DYNAMIC").replace("group_size: 64\n", ""),
         r"GPTQ needs an integer scheme"),
        (GOOD + "smoothquant: {strength: 0.5}\n", r"smoothquant only helps"),
        (GOOD + "awq: {n_grid: 10}\n", r"`awq:` options given but method is gptq"),
        (GOOD + "ignore: [Linear]\n", r"both targeted and ignored"),
        (GOOD + "observer: median\n", r"x\.yaml:6: observer"),
        (GOOD.replace("method: gptq", "method: autoround") + "observer: mse\n",
         r"AutoRound tunes its own scales; remove `observer`"),
        (GOOD + "autoround: {iters: 50}\n",
         r"`autoround:` options given but method is gptq; .*set method: autoround"),
        (GOOD + "gptq: {actorder: sideways}\n", r"x\.yaml:6: gptq.actorder"),
        (GOOD.replace("method: gptq", "method: autoround").replace("W4A16", "W8A8").replace(
            "group_size: 64\n", ""), r"AutoRound is weight-only"),
        (GOOD.replace("method: gptq", "method: awq+gptq") + "autoround: {iters: 5}\n",
         r"`autoround:` options given but method is awq\+gptq"),
        (GOOD.replace("name: x", "name: other"), r"differs from the file name"),
        (GOOD + "eval: {suite: default, thresholds: {wiki_ppl: 3.0}}\n", r"eval.thresholds"),
    ],
)
def test_bad_recipes_name_line_field_and_fix(recipe_file, text: str, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RecipeError, match=match):
        load_recipe(str(recipe_file(text)))


def test_unknown_recipe_suggests_the_closest_name() -> None:
    with pytest.raises(RecipeError, match=r"unknown recipe 'gptq-int5'; did you mean 'gptq-int4'"):
        load_recipe("gptq-int5")


def test_missing_recipe_file() -> None:
    with pytest.raises(RecipeError, match="no such file"):
        load_recipe("nowhere/recipe.yaml")


def test_recipe_thresholds_may_only_tighten() -> None:
    suite = load_suite("default")
    base = {m.name: m.threshold for m in suite.metrics}
    tight = apply_thresholds(suite, EvalRef(thresholds={"wiki_ppl": 0.99}))
    assert {m.name: m.threshold for m in tight.metrics}["wiki_ppl"] == 0.99
    with pytest.raises(RecipeError, match="loosens"):
        apply_thresholds(suite, EvalRef(thresholds={"wiki_ppl": base["wiki_ppl"] / 2}))
    with pytest.raises(RecipeError, match="not in suite"):
        apply_thresholds(suite, EvalRef(thresholds={"nope": 0.9}))


def test_calibration_spec_needs_exactly_one_source(tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = tmp_path / "c.yaml"
    p.write_text("name: c\nbuiltin: wiki\npath: x.txt\n")
    with pytest.raises(RecipeError, match="exactly one source"):
        load_calibration(str(p))


def test_suite_metric_needs_direction(tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = tmp_path / "s.yaml"
    p.write_text("name: s\nmetrics:\n  - name: p\n    kind: perplexity\n    builtin: wiki-eval\n"
                 "    threshold: 0.9\n")
    with pytest.raises(RecipeError, match=r"s\.yaml:3: metrics\.0\.direction: required"):
        load_suite(str(p))


def test_the_default_recipe_is_shipped_and_the_makefile_agrees() -> None:
    import re

    from quantize.spec.paths import PROJECT_ROOT
    from quantize.spec.recipe import DEFAULT_RECIPE

    assert load_recipe(DEFAULT_RECIPE).name == DEFAULT_RECIPE
    make = (PROJECT_ROOT / "Makefile").read_text()
    assert re.search(rf"^RECIPE \?= {re.escape(DEFAULT_RECIPE)}$", make, re.M)
