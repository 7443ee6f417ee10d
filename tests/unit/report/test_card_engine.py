"""The card names the serving stack a gate ran through: vLLM's version, where it ran and the
kernels it picked (eval.json `engine`, verify.json `vllm.layers`)."""

from __future__ import annotations

from quantize.report.card.body import scored_by
from quantize.report.card.inputs import VerifyView, kernel_names

KERNELS = {"CompressedTensorsLinearMethod/CompressedTensorsWNA16/MarlinLinearKernel": 90,
           "CompressedTensorsLinearMethod/CompressedTensorsWNA16/MacheteLinearKernel": 30,
           "FLASH_ATTN/kv_cache_dtype=auto/CompressedTensorsKVCacheMethod": 30}


def test_kernel_names_keep_the_kernel_class_and_the_attention_backend() -> None:
    assert kernel_names(KERNELS) == ("MarlinLinearKernel x90, MacheteLinearKernel x30, "
                                     "FLASH_ATTN x30")


def test_an_eval_scored_by_vllm_names_version_device_and_kernels() -> None:
    ev = {"engine": {"name": "vllm", "vllm_version": "0.26.0", "device": "cuda",
                     "vllm": {"candidate": {"vllm_version": "0.26.0", "kernels": KERNELS}}}}
    assert scored_by(ev) == ("vLLM 0.26.0 on GPU (kernels: MarlinLinearKernel x90, "
                             "MacheteLinearKernel x30, FLASH_ATTN x30)")
    assert scored_by({"engine": {"name": "hf"}}) == ""
    assert scored_by({}) == ""


def test_verify_facts_list_the_kernels_vllm_ran() -> None:
    layers = {"linear": {k: {"count": n, "example": "l"} for k, n in KERNELS.items()
                         if "kv_cache" not in k}, "attention": {}}
    view = VerifyView.read({"level": "vllm", "passed": True, "result": "ok",
                            "vllm": {"vllm_version": "0.26.0", "layers": layers}})
    assert view is not None
    assert ("vLLM 0.26.0 kernels", "MarlinLinearKernel x90, MacheteLinearKernel x30") in view.rows


def test_the_card_cites_the_measured_serving_speed_of_its_format() -> None:
    from types import SimpleNamespace

    from quantize.recipe.recipe import load_recipe
    from quantize.report.card.body import _speed

    lines = _speed(SimpleNamespace(recipe=load_recipe("gptq-int4-asym"), group_size=64))  # type: ignore[arg-type]
    assert len(lines) == 3 and lines[0].startswith("MacheteLinearKernel (vLLM's own choice)")
    assert "one H200" in lines[0] and "one H100" in lines[2]  # each GPU's rows, named
    (rot,) = _speed(SimpleNamespace(recipe=load_recipe("gptq-int4-rotated"), group_size=64))  # type: ignore[arg-type]
    assert "online Hadamard" in rot and "one H100" in rot
    assert _speed(SimpleNamespace(recipe=load_recipe("gptq-int4"), group_size=64)) == []  # type: ignore[arg-type]
