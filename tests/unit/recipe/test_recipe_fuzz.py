"""Property test: any YAML document fed to the recipe loader is either accepted or rejected
with the project's own RecipeError (one clear line) — never another exception."""

from __future__ import annotations

from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantize.errors import RecipeError
from quantize.recipe.recipe import load_recipe

KEYS = ["name", "description", "method", "scheme", "group_size", "ignore", "targets",
        "overrides", "smoothquant", "gptq", "awq", "kv_cache", "calibration", "eval",
        "backend", "trust_remote_code", "bits", "x"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                    st.floats(allow_nan=True), st.text(max_size=12),
                    st.sampled_from(["gptq", "awq", "rtn", "W4A16", "W8A8", "FP8_DYNAMIC",
                                     "auto", "fp8", "lm_head", "Linear", "wiki", "default"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from([*KEYS, "strength", "n_grid", "suite", "thresholds", "targets"]), inner,
    max_size=3), max_leaves=8)
documents = st.dictionaries(st.sampled_from(KEYS), values, max_size=8)


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=documents, raw=st.booleans(), junk=st.text(max_size=40))
def test_loader_accepts_or_raises_recipe_error(tmp_path: Path, doc: dict, raw: bool,  # type: ignore[type-arg]
                                               junk: str) -> None:
    text = junk if raw else yaml.safe_dump(doc, allow_unicode=True)
    path = tmp_path / "fuzz.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        recipe = load_recipe(str(path))
    except RecipeError as exc:
        assert str(exc) and "\n" not in str(exc).strip()
    else:
        assert recipe.name == "fuzz"
