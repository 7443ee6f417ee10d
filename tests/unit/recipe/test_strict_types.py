"""Strict types in every declarative model (issue #47, defect 11): `trust_remote_code: "yes"`
once turned remote code on. No text for a boolean or a number, no boolean for a number, no
2.0 or 2.5 for an integer, no .inf/.nan; YAML's own types still load (an integer is a number).
Each refusal names the file, the line, the field, the value got and how to write it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError

from quantize.errors import RecipeError
from quantize.recipe.recipe import (
    CalibrationSpec,
    Recipe,
    load_calibration,
    load_recipe,
    load_suite,
    parse_metric,
)

HEAD = "name: r\ndescription: d\nmethod: gptq\nscheme: W4A16\n"  # lines 1-4
SUITE = ("name: s\nmetrics:\n  - name: ppl\n    kind: perplexity\n    builtin: wiki-eval\n"
         "    direction: lower_is_better\n    threshold: 0.9\n")  # metric fields: lines 3-7
CALIB = "name: c\nbuiltin: wiki\n"

BOOL = "Input should be a valid boolean"
INT = "Input should be a valid integer"
NUMBER = "Input should be a valid number"
FINITE = "Input should be a finite number"
TEXT = "Input should be a valid string"

# (loader, document, line, field, words of the problem, words of the fix)
MATRIX: list[tuple[str, str, str, int, str, str, str]] = [
    ("bool-as-text", "recipe", HEAD + 'trust_remote_code: "yes"\n', 5, "trust_remote_code",
     f"{BOOL}, got the text 'yes'", "write true or false, without quotes"),
    ("bool-as-text-true", "recipe", HEAD + "trust_remote_code: 'true'\n", 5,
     "trust_remote_code", f"{BOOL}, got the text 'true'", "without quotes"),
    ("bool-as-int", "recipe", HEAD + "trust_remote_code: 1\n", 5, "trust_remote_code",
     f"{BOOL}, got 1", "true or false"),
    ("bool-as-int-0", "recipe", HEAD + "calibrate_all_experts: 0\n", 5,
     "calibrate_all_experts", f"{BOOL}, got 0", "true or false"),
    ("nested-bool-as-text", "recipe", HEAD.replace("gptq", "autoround") +
     "autoround: {compile: 'on'}\n", 5, "autoround.compile", f"{BOOL}, got the text 'on'",
     "true or false"),
    ("int-as-bool", "recipe", HEAD + "gptq: {block_size: true}\n", 5, "gptq.block_size",
     f"{INT}, got true", "write a whole number"),
    ("int-as-whole-float", "recipe", HEAD + "gptq: {block_size: 64.0}\n", 5, "gptq.block_size",
     f"{INT}, got 64.0", "without quotes or a decimal point"),
    ("int-as-fraction", "recipe", HEAD + "gptq: {block_size: 64.5}\n", 5, "gptq.block_size",
     f"{INT}, got 64.5", "whole number"),
    ("int-as-text", "recipe", HEAD + "gptq: {block_size: '64'}\n", 5, "gptq.block_size",
     f"{INT}, got the text '64'", "whole number"),
    ("float-as-text", "recipe", HEAD + "gptq: {dampening_frac: '0.01'}\n", 5,
     "gptq.dampening_frac", f"{NUMBER}, got the text '0.01'", "write a number, without quotes"),
    ("float-as-bool", "recipe", HEAD + "gptq: {dampening_frac: true}\n", 5,
     "gptq.dampening_frac", f"{NUMBER}, got true", "write a number"),
    ("float-infinite", "recipe", HEAD + "mixed_precision: {budget: .inf}\n", 5,
     "mixed_precision.budget", f"{FINITE}, got inf", "not .inf or .nan"),
    ("float-nan", "recipe", HEAD + "mixed_precision: {budget: .nan}\n", 5,
     "mixed_precision.budget", f"{FINITE}, got nan", "not .inf or .nan"),
    ("float-overflow", "recipe", HEAD + "gptq: {dampening_frac: 1e999}\n", 5,
     "gptq.dampening_frac", f"{FINITE}, got inf", "finite number"),
    ("threshold-as-text", "recipe", HEAD + "eval: {thresholds: {wiki_ppl: '0.9'}}\n", 5,
     "eval.thresholds.wiki_ppl", f"{NUMBER}, got the text '0.9'", "without quotes"),
    ("text-as-number", "recipe", HEAD.replace("description: d", "description: 1.5"), 2,
     "description", f"{TEXT}, got 1.5", "put the value in quotes"),
    ("text-as-bool", "recipe", HEAD + "ignore: [lm_head, no]\n", 5, "ignore.1",
     f"{TEXT}, got false", "in quotes"),
    ("calib-int-as-text", "calibration", CALIB + "num_samples: '32'\n", 3, "num_samples",
     f"{INT}, got the text '32'", "whole number"),
    ("calib-int-as-float", "calibration", CALIB + "seq_len: 512.0\n", 3, "seq_len",
     f"{INT}, got 512.0", "whole number"),
    ("calib-bool-as-text", "calibration", CALIB + "packing: 'false'\n", 3, "packing",
     f"{BOOL}, got the text 'false'", "true or false"),
    ("calib-seed-as-bool", "calibration", CALIB + "seed: false\n", 3, "seed", f"{INT}, got false",
     "whole number"),
    ("suite-int-as-float", "suite", SUITE + "    seq_len: 256.0\n", 8, "metrics.0.seq_len",
     f"{INT}, got 256.0", "whole number"),
    ("suite-threshold-as-text", "suite", SUITE.replace("threshold: 0.9", "threshold: '0.9'"), 7,
     "metrics.0.threshold", f"{NUMBER}, got the text '0.9'", "without quotes"),
    ("suite-bool-as-text", "suite", SUITE + "    allow_external_path: 'yes'\n", 8,
     "metrics.0.allow_external_path", f"{BOOL}, got the text 'yes'", "true or false"),
    ("suite-batch-as-bool", "suite", SUITE.replace("metrics:", "batch_size: true\nmetrics:"), 2,
     "batch_size", f"{INT}, got true", "whole number"),
]


@pytest.fixture
def load(tmp_path: Path) -> Callable[[str, str], object]:
    def _load(kind: str, text: str) -> object:
        name = {"recipe": "r", "calibration": "c", "suite": "s"}[kind]
        path = tmp_path / f"{name}.yaml"
        path.write_text(text, encoding="utf-8")
        return {"recipe": load_recipe, "calibration": load_calibration,
                "suite": load_suite}[kind](str(path))

    return _load


@pytest.mark.parametrize(("kind", "text", "line", "field", "problem", "hint"),
                         [m[1:] for m in MATRIX], ids=[m[0] for m in MATRIX])
def test_a_value_of_another_type_is_refused_with_its_line(
        load: Callable[[str, str], object], tmp_path: Path, kind: str, text: str, line: int,
        field: str, problem: str, hint: str) -> None:
    with pytest.raises(RecipeError) as info:
        load(kind, text)
    err = info.value
    assert err.line == line and err.path is not None and err.path.startswith(str(tmp_path))
    assert err.problem is not None and err.problem.startswith(f"{field}: "), err.problem
    assert problem in err.problem, err.problem
    assert err.hint is not None and hint in err.hint, err.hint
    assert "\n" not in str(err) and str(err).startswith(f"{err.path}:{line}: {field}: ")


def test_yaml_own_types_still_load(load: Callable[[str, str], object]) -> None:
    """An integer for a number, unquoted booleans (YAML 1.1's yes/no too), nulls, lists and
    mappings load as before; `5e-3` is a number."""
    r = load("recipe", HEAD + "trust_remote_code: true\ncalibrate_all_experts: no\n"
             "gptq: {block_size: 64, dampening_frac: 0.05}\nmixed_precision: {budget: 2}\n"
             "eval: {thresholds: {wiki_ppl: 1}}\nbatch_size: 8\ngroup_size: 128\n"
             "observer: null\ncalibration: {builtin: wiki, num_samples: 16, packing: off}\n")
    assert isinstance(r, Recipe)
    assert (r.trust_remote_code, r.calibrate_all_experts, r.batch_size, r.group_size) == (
        True, False, 8, 128)
    assert r.gptq is not None and (r.gptq.block_size, r.gptq.dampening_frac) == (64, 0.05)
    assert r.mixed_precision is not None and r.mixed_precision.budget == 2.0
    assert isinstance(r.mixed_precision.budget, float)
    assert r.eval.thresholds == {"wiki_ppl": 1.0}
    assert isinstance(r.calibration, CalibrationSpec) and r.calibration.packing is False
    tuned = load("recipe", HEAD.replace("gptq", "autoround") + "autoround: {lr: 5e-3}\n"
                 "smoothquant: null\n")
    assert isinstance(tuned, Recipe) and tuned.autoround is not None
    assert tuned.autoround.lr == 0.005  # YAML 1.2's float: PyYAML alone reads the text '5e-3'
    auto = load("recipe", HEAD + "group_size: auto\nbatch_size: auto\n")
    assert isinstance(auto, Recipe) and (auto.group_size, auto.batch_size) == ("auto", "auto")


def test_models_built_in_code_are_strict_too() -> None:
    """The Strict base, not only the YAML loader: a dict from JSON or code is held to it."""
    base = {"name": "r", "description": "d", "method": "gptq", "scheme": "W4A16"}
    assert Recipe.model_validate({**base, "trust_remote_code": True}).trust_remote_code
    with pytest.raises(ValidationError, match="valid boolean"):
        Recipe.model_validate({**base, "trust_remote_code": "yes"})
    with pytest.raises(ValidationError, match="valid integer"):
        CalibrationSpec(builtin="wiki", num_samples=32.0)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="valid boolean"):
        parse_metric({"name": "p", "kind": "perplexity", "builtin": "wiki-eval",
                      "direction": "lower_is_better", "threshold": 0.9,
                      "allow_external_path": "false"})
    with pytest.raises(ValidationError, match="finite number"):
        parse_metric({"name": "p", "kind": "perplexity", "builtin": "wiki-eval",
                      "direction": "lower_is_better", "threshold": float("nan")})


def test_every_shipped_yaml_file_still_loads() -> None:
    """recipes/, calibration/, eval/ (the shipped loaders' tests are in test_recipe.py), the
    GPU catalog, the speed table, the question set and bench/'s specs and suites."""
    from quantize.planner import gpus, speed
    from quantize.recipe.paths import PROJECT_ROOT
    from quantize.recipe.yamlio import load_yaml, read_text
    from quantize.report.answers import load_questions

    assert len(gpus._read(gpus.DATA)) >= 10
    speed.table.cache_clear()
    assert speed.table().rows
    assert load_questions().questions
    bench = sorted((PROJECT_ROOT / "bench").glob("*.yaml"))
    loaded = set()
    for path in bench:
        data, _ = load_yaml(read_text(path), str(path))
        if "metrics" in data:
            assert load_suite(str(path)).metrics
            loaded.add("suite")
        elif {"builtin", "path", "hub"} & set(data):
            assert load_calibration(str(path))[0].num_samples > 0
            loaded.add("calibration")
    assert loaded == {"suite", "calibration"}
