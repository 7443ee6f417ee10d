"""The disk pre-check: what the remaining stages write, summed per file system against its
free space, refused on one line (need, free, path, fix) before any calibration."""

from __future__ import annotations

from pathlib import Path

import pytest

from quantize.checks import preflight
from quantize.checks.resources import DiskNeed, check_disk
from quantize.errors import ResourceError
from quantize.pipeline import disk
from quantize.recipe.recipe import load_recipe

MiB = 2**20
STAGES = ["calibrate", "quantize", "export", "eval", "gate"]


def test_refuses_on_one_line_naming_need_free_path_and_fix(tmp_path: Path) -> None:
    needs = [DiskNeed("quantize", tmp_path / "run", 300 * MiB),
             DiskNeed("export", tmp_path / "run", 4 * MiB)]
    with pytest.raises(ResourceError) as err:
        check_disk(needs, free=lambda _p: 100 * MiB)
    assert "\n" not in str(err.value)
    assert err.value.problem == (f"not enough disk space: this run writes about 304.0 MiB to "
                                 f"{tmp_path / 'run'} (quantize 300.0 MiB, export 4.0 MiB) and "
                                 "100.0 MiB is free there")
    assert err.value.hint is not None
    assert "--no-disk-check" in err.value.hint and "--out" in err.value.hint


def test_needs_on_one_file_system_add_up(tmp_path: Path) -> None:
    """The run folder and the cache on one disk share its free space: 60 + 60 > 100."""
    needs = [DiskNeed("quantize", tmp_path / "run", 60 * MiB),
             DiskNeed("baseline cache", tmp_path / "cache", 60 * MiB)]
    with pytest.raises(ResourceError) as err:
        check_disk(needs, free=lambda _p: 100 * MiB)
    assert err.value.problem is not None
    assert err.value.problem.startswith("not enough disk space: this run writes about 120.0 MiB")
    facts = check_disk(needs, free=lambda _p: 200 * MiB)
    assert facts == {"disk_needed_bytes": {"quantize": 60 * MiB, "baseline cache": 60 * MiB}}


def test_real_free_space_passes_a_small_need(tmp_path: Path) -> None:
    assert check_disk([DiskNeed("gate", tmp_path / "not" / "yet", 4096)])


@pytest.mark.parametrize(("stages", "rerun", "same", "want"), [
    ({}, (), True, STAGES),
    ({"calibrate": "done", "quantize": "done"}, (), True, STAGES[2:]),
    ({s: "done" for s in STAGES}, (), True, []),
    ({s: "done" for s in STAGES}, ("export",), True, STAGES[2:]),
    ({s: "done" for s in STAGES}, ("all",), True, STAGES),
    ({s: "done" for s in STAGES}, (), False, STAGES),  # another recipe/model in that folder
    ({"calibrate": "done", "quantize": "failed"}, (), True, STAGES[1:]),
])
def test_remaining_stages(stages: dict[str, str], rerun: tuple[str, ...], same: bool,
                          want: list[str]) -> None:
    from quantize.run.manifest import Manifest

    manifest = Manifest.model_validate(
        {"stages": {k: {"key": "k", "status": v} for k, v in stages.items()}})
    assert disk.remaining(manifest, STAGES, rerun, same_run=same) == want


def test_export_weights_come_from_the_planner(tiny_model: Path) -> None:
    """gptq-int4 on the tiny model: the planner's bytes for the export's weights are within
    1 % of a real export's model.safetensors (12,746,208 bytes, measured) - the header is
    the rest."""
    from quantize.model.config import read_config

    config = read_config(tiny_model)
    recipe = load_recipe("gptq-int4")
    meta = preflight.build_meta(recipe, config)
    group = preflight.check(recipe, config, model=meta).group_size
    got = disk.export_weight_bytes(meta, recipe, config, group)
    assert abs(got - 12_746_208) / 12_746_208 < 0.01


def test_needs_count_hard_linked_weights_once(tiny_model: Path, tmp_path: Path) -> None:
    from quantize.model.config import read_config

    config = read_config(tiny_model)
    recipe = load_recipe("gptq-int4")
    meta = preflight.build_meta(recipe, config)
    from quantize.pipeline.stages import PIPELINE

    ctx = disk.DiskContext(tmp_path / "run", tmp_path / "cache", tiny_model, meta, recipe,
                           config, 64, "cpu", (32, 512), 1)
    got = {n.what: n for n in disk.needs([st.disk for st in PIPELINE], ctx)}
    side = disk.side_files(tiny_model)
    assert side > 3_000_000  # tokenizer.json and friends
    assert got["export"].bytes < side + 64 * 1024  # no weights: they are hard links
    assert got["quantize"].bytes > 12_000_000 + side
    assert got["calibrate"].bytes >= 32 * 512 * 8
    assert got["baseline cache"].path == tmp_path / "cache"
    assert "offload" not in got  # the tiny model fits in RAM
