"""The pipeline on a tiny random Qwen3-MoE (fused experts): the experts reach calibration and
the export one Linear per expert projection, the router stays dense, and the coverage file
says whether every expert saw every token (the recipe's `calibrate_all_experts`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures.moe import NUM_EXPERTS, build_moe
from fixtures.tiers import quantize_both_tiers

from quantize.errors import RecipeError
from quantize.model.moe import COVERAGE_FILE
from quantize.pipeline import RunOptions, run
from quantize.recipe.recipe import load_recipe


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Path) -> Path:
    return build_moe("qwen3_moe", tmp_path_factory.mktemp("moe") / "m", default_tokenizer)


def _keys(export: Path) -> set[str]:
    from safetensors import safe_open

    out: set[str] = set()
    for f in export.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            out |= set(st.keys())
    return out


@pytest.mark.e2e  # a pipeline run each (~5 CPU s)
@pytest.mark.parametrize("all_experts", [True, False])
def test_gptq_on_moe_through_the_pipeline(moe_model: Path, tmp_path: Path,
                                          all_experts: bool) -> None:
    data = load_recipe("gptq-int4").model_dump(mode="json", exclude_defaults=True)
    data["calibrate_all_experts"] = all_experts
    recipe = tmp_path / f"{data['name']}.yaml"
    recipe.write_text(yaml.safe_dump(data))
    calib = tmp_path / "c.yaml"
    calib.write_text("name: small\nbuiltin: wiki\nnum_samples: 4\nseq_len: 64\n")
    run(RunOptions(recipe=str(recipe), model=str(moe_model), dataset=str(calib),
                   out=tmp_path / "run", until="export", device="cpu"))
    keys = _keys(tmp_path / "run" / "export")
    experts = {k for k in keys if ".mlp.experts." in k and k.endswith("weight_packed")}
    assert len(experts) == 2 * NUM_EXPERTS * 3  # 2 layers, every expert's 3 projections
    assert not any("gate_up_proj" in k for k in keys)  # nothing left fused
    assert "model.layers.0.mlp.gate.weight" in keys  # the router stays dense
    cov = json.loads(next((tmp_path / "run").rglob(COVERAGE_FILE)).read_text())
    assert cov["all_experts_calibrated"] is all_experts
    # the router's real top-2 choices were counted either way: 4 x 64 tokens, 2 experts each
    assert [(lay["tokens"], sum(lay["counts"])) for lay in cov["layers"]] == [(256, 512)] * 2


def test_all_expert_switch_is_an_llmcompressor_option(tmp_path: Path) -> None:
    data = load_recipe("gptq-int4-gptqmodel").model_dump(mode="json", exclude_defaults=True)
    data["calibrate_all_experts"] = False
    recipe = tmp_path / f"{data['name']}.yaml"
    recipe.write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeError) as info:
        load_recipe(str(recipe))
    assert "calibrate_all_experts" in info.value.problem
    assert "llmcompressor" in (info.value.hint or info.value.problem)


def _export(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.e2e  # quantizes the MoE twice (~20 CPU s)
def test_disk_tier_gives_the_same_moe_export(moe_model: Path, tmp_path: Path) -> None:
    """Host RAM short (quantize.checks.placement's disk tier): compressed-tensors keeps the
    first layers in RAM and offloads the rest, routers and fused experts included, to disk.
    The expert coverage reads each router's size from an offloaded router, linearize replaces
    offloaded fused experts, and the export is the one the RAM tier writes, bit for bit."""
    import torch

    size = sum(f.stat().st_size for f in moe_model.glob("*.safetensors"))
    samples = [[(i * 7 + j * 13) % 500 + 3 for j in range(32)] for i in range(2)]
    outs = quantize_both_tiers(moe_model, samples, size * 9 // 10, tmp_path)
    ram, disk = _export(outs["ram"]), _export(outs["disk"])
    assert sum(".mlp.experts." in k for k in ram) == 2 * NUM_EXPERTS * 3 * 3  # packed/scale/shape
    assert sorted(ram) == sorted(disk)
    assert all(ram[k].dtype == disk[k].dtype and torch.equal(ram[k], disk[k]) for k in ram)
