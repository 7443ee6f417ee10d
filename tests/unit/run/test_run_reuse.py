"""A run folder belongs to one recipe and one model: another's run is not silently replaced
(#47 item 12); `--rerun all` says to replace it."""

from __future__ import annotations

from pathlib import Path

import pytest

from quantize.errors import QuantizeError
from quantize.run.manifest import (
    Manifest,
    ModelInfo,
    RecipeInfo,
    check_out_folder,
    check_same_run,
)


def _manifest(recipe: str, source: str, path: Path) -> Manifest:
    return Manifest(recipe=RecipeInfo(name=recipe), model=ModelInfo(source=source,
                                                                    path=str(path)))


def test_the_same_recipe_and_model_go_on(tmp_path: Path) -> None:
    m = _manifest("gptq-int4", "./m", tmp_path / "m")
    check_same_run(m, tmp_path, "gptq-int4", "./m", tmp_path / "m", replace=False)
    # the same folder, typed another way
    check_same_run(m, tmp_path, "gptq-int4", str(tmp_path / "m"), tmp_path / "m",
                   replace=False)
    # a Hub id whose snapshot moved to a new revision
    hub = _manifest("gptq-int4", "org/m", tmp_path / "snapshots" / "a")
    check_same_run(hub, tmp_path, "gptq-int4", "org/m", tmp_path / "snapshots" / "b",
                   replace=False)
    check_same_run(Manifest(), tmp_path, "x", "y", tmp_path, replace=False)  # a new folder


def test_another_recipe_or_model_is_refused_unless_replacing(tmp_path: Path) -> None:
    m = _manifest("gptq-int4", "default", tmp_path / "cache" / "default")
    with pytest.raises(QuantizeError) as err:
        check_same_run(m, tmp_path / "run", "fp8-dynamic", "default",
                       tmp_path / "cache" / "default", replace=False)
    assert err.value.path == str(tmp_path / "run")
    assert err.value.problem == ("holds the run of recipe 'gptq-int4', which this run of "
                                 "recipe 'fp8-dynamic' on 'default' would replace")
    assert err.value.hint == "give another --out folder, or pass --rerun all to replace that run"
    with pytest.raises(QuantizeError) as err:
        check_same_run(m, tmp_path / "run", "gptq-int4", "./other", tmp_path / "other",
                       replace=False)
    assert err.value.problem is not None and "model 'default'" in err.value.problem
    check_same_run(m, tmp_path / "run", "fp8-dynamic", "./other", tmp_path / "other",
                   replace=True)


def test_the_run_folder_is_not_the_model_folder(tmp_path: Path) -> None:
    m = tmp_path / "m"
    m.mkdir()
    for out in (m, m / "run", tmp_path / "m" / ".." / "m"):
        with pytest.raises(QuantizeError) as err:
            check_out_folder(out, m)
        assert err.value.hint == "give --out a folder of its own"
    check_out_folder(tmp_path / "run", m)
    check_out_folder(tmp_path / "m-run", m)
