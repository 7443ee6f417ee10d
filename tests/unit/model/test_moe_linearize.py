"""quantize.model.moe.linearize under each host tier (quantize.checks.placement): tiny random
Qwen3-MoE checkpoints loaded the way the pipeline loads them (quantize.backends.llmcompressor
.load_model). Under the disk tier the model is offloaded by compressed-tensors, whose
`offload_module` makes every module a reference cycle: a replaced fused-experts module must
still give its memory (and its offload files) back at once, not when the cyclic collector
runs, and the heap the per-expert copies passed through must not stay behind (Qwen3-30B-A3B
was OOM-killed that way; quantize.model.release)"""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fixtures.moe import CONFIGS

from quantize.backends import QuantizeJob
from quantize.model import moe


class _Tok:
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 2

    def __len__(self) -> int:
        return 512


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("qwen3-moe")
    cfg = CONFIGS["qwen3_moe"](_Tok())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=0.05)
    model.to(torch.bfloat16).save_pretrained(out)
    return out


def _load(path: Path, tier: str, budget: int | None = None,
          offload: Path | None = None) -> Any:
    from quantize.backends.llmcompressor import load_model

    job = QuantizeJob(model_path=path, recipe=SimpleNamespace(trust_remote_code=False),  # type: ignore[arg-type]
                      group_size=64, samples=[], device="cpu", placement="onload",
                      host_tier=tier, cpu_budget=budget, offload_dir=offload)
    return load_model(job, torch.bfloat16)


def _state(model: Any) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


@pytest.fixture(scope="module")
def disk_load(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> dict[str, Any]:
    """The disk tier with RAM for most of the weights (accelerate keeps a layer's margin: the
    first layer's experts stay in RAM, the second's go to disk), the cyclic collector off
    throughout: weak references to every fused tensor, and the kind of cache each fused
    module sat in."""
    offload = tmp_path_factory.mktemp("offload")
    size = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    refs: list[weakref.ref[Any]] = []
    caches: set[str] = set()
    original = moe.linearize

    def watched(model: Any) -> Any:
        from compressed_tensors.offload import disable_onloading
        from llmcompressor.modeling.moe.linearize import get_non_linearized_moes

        with disable_onloading():  # the stored tensors (CPU, or meta for those on disk)
            for _, fused in get_non_linearized_moes(model):
                caches.add(type(fused._parameters).__name__)
                refs.extend(weakref.ref(t) for t in fused._parameters.values())
        return original(model)

    gc.collect()
    gc.disable()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(moe, "linearize", watched)
            model = _load(checkpoint, "disk", size * 9 // 10, offload)
        alive = sum(r() is not None for r in refs)
    finally:
        gc.enable()
    return {"model": model, "refs": len(refs), "alive": alive, "caches": caches,
            "offload": offload}


def test_fused_experts_are_freed_at_once_under_the_disk_tier(disk_load: dict[str, Any]
                                                              ) -> None:
    assert disk_load["caches"] == {"CPUCache", "DiskCache"}  # both kinds were exercised
    assert disk_load["refs"] == 4  # 2 layers x (gate_up_proj, down_proj)
    assert disk_load["alive"] == 0


def test_offload_folder_holds_only_the_models_tensors(disk_load: dict[str, Any]) -> None:
    """No file is left for the fused tensors: neither DiskCache's link nor the file
    transformers wrote for the fused tensor the checkpoint does not hold."""
    from compressed_tensors.offload import disable_onloading
    from compressed_tensors.offload.cache import DiskCache

    used: set[str] = set()
    with disable_onloading():
        for mod in disk_load["model"].modules():
            for store in (mod._parameters, mod._buffers):
                if isinstance(store, DiskCache):
                    for t in store.offloaded_values.values():
                        if t is None:
                            continue
                        f = DiskCache.index[t]["safetensors_file"]
                        used |= {os.path.realpath(f), os.path.abspath(f)}
    files = {os.path.abspath(p) for p in disk_load["offload"].iterdir()}
    expert = disk_load["model"].get_submodule("model.layers.1.mlp.experts.0.down_proj")
    assert isinstance(expert._parameters, DiskCache)  # the per-expert copies went to disk
    assert files - used == set()


def test_linearized_tensors_are_the_same_in_ram_and_on_disk(
        checkpoint: Path, disk_load: dict[str, Any]) -> None:
    """Bit-identical: the RAM tier against llm-compressor's own linearize_moe on a plain
    load, and the disk tier (tensors read back from RAM and disk) against the RAM tier."""
    from llmcompressor.modeling.moe.linearize import linearize_moe
    from transformers import AutoModelForCausalLM

    ram = _state(_load(checkpoint, "ram"))
    plain = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    linearize_moe(plain)
    reference = _state(plain)
    disk = _state(disk_load["model"])
    assert any(".experts.7.down_proj.weight" in n for n in ram)
    for other in (reference, disk):
        assert sorted(other) == sorted(ram)
        for name, t in ram.items():
            assert t.dtype == other[name].dtype and torch.equal(t, other[name]), name


def _anon_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's /proc")
def test_linearize_under_disk_offload_holds_no_layer_after_it(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Anonymous memory after linearize stays where it was after loading (within half a
    layer's experts): neither the replaced fused tensors (kept by offload_module's reference
    cycle) nor the heap the per-expert copies were written to disk from stay behind. Larger
    experts than the other tests' (25 MiB a layer) so that a layer shows above the noise."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    path = tmp_path_factory.mktemp("qwen3-moe-25m")
    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         intermediate_size=512, moe_intermediate_size=512, num_experts=16,
                         num_experts_per_tok=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    layer = 16 * 3 * 512 * 512 * 2
    seen: dict[str, int] = {}
    original = moe.linearize

    def watched(model: Any) -> Any:
        seen["before"] = _anon_bytes()
        out = original(model)
        seen["after"] = _anon_bytes()
        return out

    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    gc.collect()
    gc.disable()  # the cyclic collector would free the fused modules at random times
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(moe, "linearize", watched)
            _load(path, "disk", size // 2, tmp_path_factory.mktemp("offload25"))
    finally:
        gc.enable()
    assert seen["after"] - seen["before"] < layer // 2, (seen, layer)


def test_per_expert_linears_are_built_on_the_fused_modules_device() -> None:
    """A model that is not offloaded gets its per-expert Linears created on the device its
    fused experts are on, not on torch's default device (on a GPU-resident model: no round
    trip through host memory). Shown with the default device set to meta: the host model's
    experts still come out on the host, with the library's own `linearize_moe` values,
    tensor for tensor."""
    from llmcompressor.modeling.moe.linearize import linearize_moe
    from transformers import AutoModelForCausalLM

    cfg = CONFIGS["qwen3_moe"](_Tok())
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    theirs = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    theirs.load_state_dict(ours.state_dict())
    default = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        moe.linearize(ours)
    finally:  # None removes the device mode; setting "cpu" back would leave one installed
        torch.set_default_device(None if default.type == "cpu" else default)
    linearize_moe(theirs)
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys() and any(".experts.0.gate_proj." in k for k in a)
    assert {t.device.type for t in a.values()} == {"cpu"}
    assert all(torch.equal(a[k], b[k]) for k in a)
