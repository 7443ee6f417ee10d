"""Adding a scheme, a method or an engine is one table entry (docs/architecture.md, "Where to
add ..."): each test adds a fake one at run time, edits nothing else, and checks that recipe
validation, the planner and the engine lookup take it. (A stage: tests/unit/pipeline/
test_stages.py; a metric kind: tests/unit/test_metrics.py.)"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from quantize import backends
from quantize.model.config import ModelConfig
from quantize.planner.weights import format_for, linear_bytes
from quantize.recipe import engines, methods, schemes
from quantize.recipe.recipe import Recipe


def _recipe(**kw: Any) -> Recipe:
    base: dict[str, Any] = {"name": "x", "description": "d", "method": "rtn",
                            "scheme": "W4A16", "group_size": 64}
    return Recipe.model_validate({**base, **kw})


def test_a_scheme_is_one_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    w6 = schemes.Scheme("W6A16", 6, "int", True, True, "none", "W6A16")
    monkeypatch.setitem(schemes.SCHEMES, "W6A16", w6)
    r = _recipe(scheme="W6A16")  # validation takes it
    assert r.scheme == "W6A16"
    fmt = format_for("W6A16", 64)  # the planner sizes it: 6-bit codes packed in int32
    assert fmt.kind == "pack" and fmt.bits == 6
    assert linear_bytes(128, 128, fmt, 2) == 128 * 24 * 4 + 128 * 2 * 2 + 16
    # the kernel rules of its family apply: no CUDA kernel takes 6-bit codes
    assert "6-bit integer weights" in (schemes.gpu_problem(w6.kernel, 6, 90) or "")
    monkeypatch.delitem(schemes.SCHEMES, "W6A16")
    with pytest.raises(Exception, match="Input should be"):
        _recipe(scheme="W6A16")


def test_a_method_is_one_entry_and_its_modifier_builder(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    from quantize.backends import llmcompressor

    fake = methods.Method("halfrtn", "half RTN", False, False, False, False, (), "a test")
    monkeypatch.setitem(methods.METHODS, "halfrtn", fake)
    monkeypatch.setitem(llmcompressor.MODIFIERS, "halfrtn",
                        lambda r, common, model: ["modifier-of-halfrtn", common["ignore"]])
    r = _recipe(method="halfrtn")
    assert llmcompressor.build_modifiers(r, 64) == ["modifier-of-halfrtn", ["lm_head"]]
    with pytest.raises(Exception, match="backend gptqmodel runs method"):
        _recipe(method="halfrtn", backend="gptqmodel")  # engines list what they run


def test_an_engine_is_one_entry_with_its_rules_and_model_check(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[str] = []

    class FakeBackend:
        name = "fake"

        def quantize(self, job: Any, out: Path) -> dict[str, Any]:
            return {}

        def check_model(self, config: ModelConfig, recipe: Recipe) -> None:
            seen.append(str(config.model_type))

    module = types.ModuleType("fake_engine_module")
    module.BACKEND = FakeBackend()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_engine_module", module)
    monkeypatch.setitem(engines.ENGINES, "fake", engines.Engine(
        "fake", "fake_engine_module", "Fake", "fake", {"rtn": ("W4A16",)},
        lambda r: "fake takes group 64 only" if r.group_size != 64 else None))
    r = _recipe(backend="fake")
    assert backends.get_backend("fake") is module.BACKEND
    backends.check_model(r, ModelConfig(model_type="llama"))
    assert seen == ["llama"]
    with pytest.raises(Exception, match="fake takes group 64 only"):
        _recipe(backend="fake", group_size=128)
    with pytest.raises(Exception, match="backend fake runs method rtn only"):
        _recipe(backend="fake", method="gptq")
