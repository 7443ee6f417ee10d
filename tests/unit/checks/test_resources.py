"""Memory checks before the quantize stage loads a model: host RAM and GPU memory estimated
from the meta model pre-flight built, compared with fake free-memory values (no GPU needed)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from quantize.checks import preflight, resources
from quantize.checks.resources import GiB, check_memory
from quantize.errors import ResourceError
from quantize.model import layers as model_layers
from quantize.model.config import ModelConfig
from quantize.recipe.recipe import load_recipe

CONFIGS = Path(__file__).resolve().parents[3] / "quantize" / "data" / "model_configs"
SMALL = ModelConfig.model_validate({
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000})
WINDOWS = [[0] * 2048] * 32  # the bench's 32 x 2048 calibration tokens


@pytest.fixture(scope="module")
def llama8b() -> tuple[ModelConfig, Any]:
    raw = json.loads((CONFIGS / "meta-llama--Llama-3.1-8B-Instruct.json").read_text())
    raw.pop("quantization_config", None)
    cfg = ModelConfig.model_validate(raw)
    return cfg, model_layers.meta_model(cfg)


def _free(monkeypatch: pytest.MonkeyPatch, *, host: float = 1e6, gpu: float | None = None
          ) -> None:
    monkeypatch.setattr(resources, "host_free_bytes", lambda: int(host * GiB))

    def no_gpu() -> int:
        raise AssertionError("the GPU must not be asked about on --device cpu")

    monkeypatch.setattr(resources, "gpu_free_bytes",
                        no_gpu if gpu is None else (lambda: int(gpu * GiB)))


def test_host_ram_refused_with_needed_free_and_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    meta = model_layers.meta_model(SMALL)
    r = load_recipe("gptq-int4")
    _free(monkeypatch)
    facts = check_memory(meta, r, SMALL, "cpu", [], 1)
    assert 0 < facts["host_ram_needed_gib"] < facts["host_ram_free_gib"]
    assert "gpu_placement" not in facts
    _free(monkeypatch, host=0.001)
    with pytest.raises(ResourceError) as info:
        check_memory(meta, r, SMALL, "cpu", [], 1)
    assert re.fullmatch(r"quantizing this model needs about [\d.]+ GiB of host RAM and 0\.0 GiB "
                        r"is free", info.value.problem or "")
    assert info.value.hint is not None and "--device cuda" in info.value.hint


def test_the_meta_model_is_passed_in_not_rebuilt(monkeypatch: pytest.MonkeyPatch) -> None:
    meta = model_layers.meta_model(SMALL)

    def rebuilt(*_a: Any, **_k: Any) -> None:
        raise AssertionError("resources rebuilt the meta model")

    monkeypatch.setattr(preflight, "meta_model", rebuilt)
    _free(monkeypatch)
    size = resources.model_size(meta, load_recipe("gptq-int4"))
    assert size.params == sum(p.numel() for p in meta.parameters())
    check_memory(meta, load_recipe("gptq-int4"), SMALL, "cpu", [], 1)


def test_estimate_matches_the_measured_8b_rows(llama8b: tuple[ModelConfig, Any]) -> None:
    """bench/RESULTS.md section 3, H200, Llama-3.1-8B architecture, GPTQ 32 x 2048 tokens:
    allocated peak 19.4 GiB (resident, batch 1), 27.9 (batch 8), 4.5 (loaded on the host)."""
    cfg, meta = llama8b
    r = load_recipe("gptq-int4")
    size = resources.model_size(meta, r)
    assert size.params == 8_030_261_248 and size.widest_out == 14336
    b1 = resources.estimate_gpu(size, r, cfg, WINDOWS, 1)
    b8 = resources.estimate_gpu(size, r, cfg, WINDOWS, 8)
    for est, placement, measured in ((b1, "resident", 19.4), (b8, "resident", 27.88),
                                     (b1, "onload", 4.54)):
        got = est.allocated(placement) / GiB
        assert measured * 0.95 <= got <= measured * 1.3, (placement, got, measured)
    assert b1.need("onload+offload") < b1.need("onload") < b1.need("resident")


def test_moe_estimate_counts_every_experts_hessian() -> None:
    """bench/RESULTS.md, 2026-12-03, H200: Qwen3-30B-A3B's architecture cut to 12 of its 48
    layers (random weights), GPTQ W4A16, 32 x 2048 tokens, batch 8: allocated peak 29.68 GiB
    resident and 15.45 GiB onloaded. Counting each fused experts module once (as one expert)
    estimated 24.4 and 11.6 GiB: 128 experts' Hessians (4.3 GiB a layer) were missing."""
    raw = json.loads((CONFIGS / "Qwen--Qwen3-30B-A3B.json").read_text())
    cfg = ModelConfig.model_validate({**raw, "num_hidden_layers": 12})
    r = load_recipe("gptq-int4")
    size = resources.model_size(model_layers.meta_model(cfg), r)
    per_expert = (2 * 2048 ** 2 + 768 ** 2) * 4  # gate and up take the hidden size, down 768
    attention = (3 * 2048 ** 2 + 4096 ** 2) * 4  # q/k/v take 2048, o the 32 x 128 heads
    assert size.hessian_bytes == 128 * per_expert + attention
    est = resources.estimate_gpu(size, r, cfg, WINDOWS, 8)
    for placement, measured in (("resident", 29.68), ("onload", 15.45)):
        got = est.allocated(placement) / GiB
        assert measured * 0.95 <= got <= measured * 1.3, (placement, got, measured)


@pytest.mark.parametrize(("free", "placement"), [(40, "resident"), (10, "onload"),
                                                 (6.5, "onload+offload")])
def test_gpu_placement_is_the_cheapest_that_fits(
        monkeypatch: pytest.MonkeyPatch, llama8b: tuple[ModelConfig, Any], free: float,
        placement: str, capsys: pytest.CaptureFixture[str]) -> None:
    cfg, meta = llama8b
    _free(monkeypatch, gpu=free)
    facts = check_memory(meta, load_recipe("gptq-int4"), cfg, "cuda", WINDOWS, 1)
    assert facts["gpu_placement"] == placement
    assert facts["gpu_free_gib"] == free and facts["gpu_needed_gib"] <= free
    err = capsys.readouterr().err
    if placement != "resident":
        assert "sequential onloading" in err and f"{free:.1f} GiB is free" in err


def test_gpu_refused_with_needed_free_and_each_fix(monkeypatch: pytest.MonkeyPatch,
                                                   llama8b: tuple[ModelConfig, Any]) -> None:
    cfg, meta = llama8b
    r = load_recipe("gptq-int4")
    _free(monkeypatch, gpu=4.0)
    with pytest.raises(ResourceError) as err:
        check_memory(meta, r, cfg, "cuda", WINDOWS, 8)
    problem, hint = err.value.problem, err.value.hint
    assert "\n" not in str(err.value) and problem is not None and hint is not None
    assert problem.startswith("quantizing on the GPU needs about 15.4 GiB of GPU memory even "
                              "with sequential onloading and activations offloaded")
    assert problem.endswith(" and 4.0 GiB is free")
    assert hint.startswith("fix: set `batch_size: 1` in the recipe (the calibration batch of 8")
    assert "; or a shorter seq_len than 2048" in hint
    assert "; or --device cpu (about 74.8 GiB" in hint
    assert hint.endswith("; or free the GPU / use a larger one")
    # batch 1 fits where batch 8 did not: the fix the message names works
    _free(monkeypatch, gpu=7.0)
    assert check_memory(meta, r, cfg, "cuda", WINDOWS, 1)["gpu_placement"] == "onload+offload"


def test_data_free_recipes_need_no_activation_memory(
        llama8b: tuple[ModelConfig, Any]) -> None:
    cfg, meta = llama8b
    r = load_recipe("rtn-int4")
    est = resources.estimate_gpu(resources.model_size(meta, r), r, cfg, [], 1)
    assert est.activations == 0 and est.forward == 0
    gptq = load_recipe("gptq-int4")
    assert est.working < resources.estimate_gpu(
        resources.model_size(meta, gptq), gptq, cfg, WINDOWS, 1).working  # no Hessians


def test_backend_applies_the_placement(monkeypatch: pytest.MonkeyPatch,
                                       tmp_path: Path) -> None:
    """The engine loads an onloaded model on the host (device_map=None) and offloads
    activations only when told to."""
    import llmcompressor
    import transformers

    from quantize.backends import QuantizeJob
    from quantize.backends.llmcompressor import BACKEND

    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    seen: dict[str, Any] = {}

    class Stop(Exception):
        pass

    def load(*_a: Any, **kw: Any) -> object:
        seen["device_map"] = kw.get("device_map")
        import torch

        return torch.nn.Module()  # a model without routers (the MoE hook looks for them)

    def oneshot(**kw: Any) -> None:
        seen["offload"] = kw.get("sequential_offload_device")
        raise Stop

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: None)
    monkeypatch.setattr(llmcompressor, "oneshot", oneshot)
    import torch

    tf32 = torch.backends.cuda.matmul.allow_tf32  # the GPU path sets it; restore it after
    r = load_recipe("gptq-int4")
    try:
        for placement, device_map, offload in (("resident", "cuda", "cuda"),
                                               ("onload", None, "cuda"),
                                               ("onload+offload", None, "cpu")):
            job = QuantizeJob(tmp_path, r, 64, [[1, 2, 3]], "cuda", placement=placement)
            with pytest.raises(Stop):
                BACKEND.quantize(job, tmp_path / "out")
            assert (seen["device_map"], seen["offload"]) == (device_map, offload), placement
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
