"""Where the weights live: host RAM or disk (fake sizes), and the from_pretrained arguments
each placement and process count turns into."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from quantize.checks import placement, resources
from quantize.checks.placement import GiB, choose_host, load_plan
from quantize.errors import NotImplementedFeature, PlacementError
from quantize.model import layers as model_layers
from quantize.model.config import ModelConfig
from quantize.recipe.recipe import load_recipe

CONFIGS = Path(__file__).resolve().parents[3] / "quantize" / "data" / "model_configs"


def test_ram_when_everything_fits() -> None:
    plan = choose_host(need=40 * GiB, weights=16 * GiB, free=64 * GiB, disk_free=0)
    assert plan.tier == "ram" and plan.cpu_budget is None
    assert plan.facts() == {"host_tier": "ram", "host_ram_needed_gib": 40.0,
                            "host_ram_free_gib": 64.0}


def test_short_ram_spills_what_does_not_fit_to_disk() -> None:
    # a 405B model in bf16 (810 GB of weights) on a 512 GiB host
    plan = choose_host(need=2025 * GiB, weights=810 * GiB, free=512 * GiB,
                       disk_free=2000 * GiB)
    reserve = max(placement.DISK_RESERVE_MIN, int(512 * GiB * placement.DISK_RESERVE_FRACTION))
    assert plan.tier == "disk"
    assert plan.cpu_budget == 512 * GiB - reserve
    assert plan.disk_bytes == 810 * GiB - plan.cpu_budget
    facts = plan.facts()
    assert facts["host_tier"] == "disk" and facts["host_cpu_budget_bytes"] == plan.cpu_budget
    assert facts["disk_offload_gib"] == pytest.approx(810 - plan.cpu_budget / GiB, abs=0.01)


def test_short_ram_with_weights_that_fit_under_the_cap_keeps_them_in_ram() -> None:
    # the estimate (2.5x the weights) says short; the weights alone fit under the budget
    plan = choose_host(need=100 * GiB, weights=40 * GiB, free=64 * GiB, disk_free=0)
    assert plan.tier == "disk" and plan.disk_bytes == 0
    assert plan.cpu_budget is not None and plan.cpu_budget >= 40 * GiB


def test_refused_when_the_disk_cannot_take_the_rest() -> None:
    with pytest.raises(PlacementError) as info:
        choose_host(need=2025 * GiB, weights=810 * GiB, free=512 * GiB, disk_free=100 * GiB)
    assert re.fullmatch(r"host RAM is short \(512\.0 GiB free, about 2025\.0 GiB needed\) and "
                        r"offloading the rest to disk needs about [\d.]+ GiB where 100\.0 GiB "
                        r"is free", info.value.problem or "")
    assert info.value.hint is not None and info.value.hint.startswith("free disk space")


def test_refused_when_ram_cannot_even_hold_the_engine() -> None:
    with pytest.raises(PlacementError) as info:
        choose_host(need=10 * GiB, weights=4 * GiB, free=2 * GiB, disk_free=1000 * GiB)
    problem = info.value.problem or ""
    assert problem.startswith("quantizing needs about 10.0 GiB of host RAM and only 2.0 GiB is "
                              "free, too little even to offload weights to disk")
    assert info.value.hint == "close other programs or use a machine with more memory"


def test_several_processes_are_capped_by_shared_memory(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    """compressed-tensors keeps one shared copy of host weights in /dev/shm for all ranks."""
    monkeypatch.setattr(placement, "shm_free", lambda: 8 * GiB)
    one = placement.host_plan(12 * GiB, 5 * GiB, 64 * GiB, 1, tmp_path / ".offload")
    two = placement.host_plan(12 * GiB, 5 * GiB, 64 * GiB, 2, tmp_path / ".offload")
    assert (one.tier, one.free) == ("ram", 64 * GiB)
    assert (two.tier, two.free) == ("disk", 8 * GiB)


# --- from_pretrained arguments -------------------------------------------------------------
OFF = Path("/runs/x/.offload")


@pytest.mark.parametrize(("device", "gpu", "host", "world", "context", "kwargs"), [
    ("cpu", "resident", "ram", 1, False, {"device_map": None}),
    ("cuda", "resident", "ram", 1, False, {"device_map": "cuda"}),
    ("cuda", "onload", "ram", 1, False, {"device_map": None}),
    ("cuda", "onload+offload", "ram", 1, False, {"device_map": None}),
    # several processes: rank 0 loads, the others receive (replicas / shared host memory)
    ("cuda", "resident", "ram", 2, True, {"device_map": "cuda"}),
    ("cuda", "onload", "ram", 2, True, {"device_map": "cpu", "max_memory": {"cpu": 7}}),
    ("cpu", "resident", "ram", 2, True, {"device_map": "cpu", "max_memory": {"cpu": 7}}),
    # host RAM short: RAM up to the budget, the rest on disk
    ("cuda", "onload", "disk", 1, True, {"device_map": "auto_offload",
                                         "max_memory": {"cpu": 7}, "offload_folder": str(OFF)}),
    ("cuda", "onload+offload", "disk", 4, True, {
        "device_map": "auto_offload", "max_memory": {"cpu": 7}, "offload_folder": str(OFF)}),
    ("cpu", "resident", "disk", 1, True, {"device_map": "auto_offload",
                                          "max_memory": {"cpu": 7}, "offload_folder": str(OFF)}),
    # resident on the GPU: the host tier does not matter
    ("cuda", "resident", "disk", 1, False, {"device_map": "cuda"}),
])
def test_load_plan(device: str, gpu: str, host: str, world: int, context: bool,
                   kwargs: dict[str, Any]) -> None:
    plan = load_plan(device, gpu, host, world, 7, OFF)
    assert (plan.offloaded_context, plan.kwargs) == (context, kwargs)
    assert plan.where


def test_where_says_what_happens() -> None:
    assert load_plan("cuda", "resident", "ram", 2, None, None).where == \
        "whole model on the GPU (a replica on each)"
    assert load_plan("cuda", "onload", "disk", 1, 3 * GiB, OFF).where == \
        f"host RAM up to 3.0 GiB, the rest on disk ({OFF}), onloaded layer by layer to the GPU"


def test_several_cpu_processes_with_disk_offload_are_refused() -> None:
    with pytest.raises(NotImplementedFeature) as info:
        load_plan("cpu", "resident", "disk", 2, 7, OFF)
    assert info.value.problem == ("--gpus 2 on CPU with weights offloaded to disk (host RAM is "
                                  "short) is not supported")
    assert info.value.hint is not None and "drop --gpus" in info.value.hint


# --- through the memory check: a 70B model on one 80 GB GPU and a 64 GiB host ------------
def test_70b_on_one_gpu_and_a_small_host_onloads_from_ram_and_disk(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    raw = json.loads((CONFIGS / "meta-llama--Llama-3.1-70B-Instruct.json").read_text())
    raw.pop("quantization_config", None)
    cfg = ModelConfig.model_validate(raw)
    meta = model_layers.meta_model(cfg)
    r = load_recipe("gptq-int4")
    monkeypatch.setattr(resources, "host_free_bytes", lambda: 64 * GiB)
    monkeypatch.setattr(resources, "gpu_free_bytes", lambda: 80 * GiB)
    monkeypatch.setattr(placement, "disk_free_bytes", lambda _p: 1000 * GiB)
    facts = resources.check_memory(meta, r, cfg, "cuda", [[0] * 2048] * 16, 1,
                                   offload_dir=tmp_path / ".offload")
    assert facts["gpu_placement"] in ("onload", "onload+offload")  # 131 GiB of weights
    assert facts["host_tier"] == "disk"
    assert 50 < facts["disk_offload_gib"] < 131
    plan = load_plan("cuda", facts["gpu_placement"], facts["host_tier"], 1,
                     facts["host_cpu_budget_bytes"], tmp_path / ".offload")
    assert plan.kwargs["device_map"] == "auto_offload"
    # without an offload folder the old rule stands: refuse
    with pytest.raises(resources.ResourceError) as info:
        resources.check_memory(meta, r, cfg, "cuda", [[0] * 2048] * 16, 1)
    assert re.fullmatch(r"quantizing this model needs about [\d.]+ GiB of host RAM and 64\.0 "
                        r"GiB is free", info.value.problem or "")
