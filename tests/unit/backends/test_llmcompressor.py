"""Each shipped recipe's YAML round-trips to the llm-compressor modifiers it stands for."""

from __future__ import annotations

import pytest

from quantize.backends.llmcompressor import build_modifiers
from quantize.recipe.recipe import load_recipe


def _weights(mod):  # type: ignore[no-untyped-def]
    return mod.config_groups["group_0"].weights


def test_gptq_int4() -> None:
    (gptq,) = build_modifiers(load_recipe("gptq-int4"), 64)
    assert type(gptq).__name__ == "GPTQModifier"
    w = _weights(gptq)
    assert (w.num_bits, w.type, w.symmetric, w.strategy, w.group_size) == (
        4, "int", True, "group", 64)
    assert gptq.ignore == ["lm_head"]
    assert gptq.dampening_frac == 0.01
    assert gptq.config_groups["group_0"].input_activations is None


def test_awq_int4_is_a_transform_then_asymmetric_quantization() -> None:
    awq, quant = build_modifiers(load_recipe("awq-int4"), 64)
    assert type(awq).__name__ == "SubsetSearchAWQModifier"  # quantize/backends/_awq_search.py
    assert (awq.n_grid, awq.search_samples) == (20, 4)
    assert type(quant).__name__ == "QuantizationModifier"
    w = _weights(quant)
    assert (w.num_bits, w.symmetric, w.group_size) == (4, False, 64)


def test_w8a8_is_smoothquant_then_gptq_int8() -> None:
    sq, gptq = build_modifiers(load_recipe("w8a8-int8"), None)
    assert type(sq).__name__ == "SmoothQuantModifier" and sq.smoothing_strength == 0.8
    g = gptq.config_groups["group_0"]
    assert (g.weights.num_bits, g.weights.strategy) == (8, "channel")
    assert (g.input_activations.num_bits, g.input_activations.dynamic,
            g.input_activations.strategy) == (8, True, "token")


def test_gptq_int4_rotated_is_hadamard_blocks_then_the_asym_gptq() -> None:
    quip, gptq = build_modifiers(load_recipe("gptq-int4-rotated"), 64)
    assert type(quip).__name__ == "QuIPModifier"
    assert (quip.rotations, quip.transform_type, quip.transform_block_size) == (
        ["v"], "hadamard", 64)
    assert quip.ignore == ["lm_head"]  # the tied lm_head/embeddings stay as they are
    (plain,) = build_modifiers(load_recipe("gptq-int4-asym"), 64)
    assert gptq.config_groups == plain.config_groups and gptq.actorder == plain.actorder


@pytest.mark.parametrize("name", ["fp8-dynamic", "fp8-kv"])
def test_fp8(name: str) -> None:
    (quant,) = build_modifiers(load_recipe(name), None)
    g = quant.config_groups["group_0"]
    assert (g.weights.type, g.weights.num_bits, g.input_activations.dynamic) == ("float", 8, True)
    kv = quant.kv_cache_scheme
    if name == "fp8-kv":
        assert (kv.type, kv.num_bits, kv.strategy, kv.dynamic) == ("float", 8, "tensor", False)
    else:
        assert kv is None


def test_rtn_int2_destructive_control() -> None:
    (quant,) = build_modifiers(load_recipe("rtn-int2"), 64)
    assert type(quant).__name__ == "QuantizationModifier"
    assert _weights(quant).num_bits == 2


def test_data_free_recipes_skip_calibration() -> None:
    assert not load_recipe("fp8-dynamic").needs_calibration
    assert not load_recipe("rtn-int4").needs_calibration
    for name in ("gptq-int4", "awq-int4", "w8a8-int8", "fp8-kv"):
        assert load_recipe(name).needs_calibration


def test_batch_size_auto_batches_equal_windows_on_gpu_only() -> None:
    from quantize.backends import resolve_batch_size

    equal = [[1] * 16] * 20
    assert resolve_batch_size("auto", "cuda", equal) == 8
    assert resolve_batch_size("auto", "cpu", equal) == 1
    assert resolve_batch_size("auto", "cuda", [[1] * 16, [1] * 9]) == 1
    assert resolve_batch_size("auto", "cuda", []) == 1
    assert resolve_batch_size(4, "cpu", equal) == 4
    assert resolve_batch_size(64, "cpu", equal[:3]) == 3


def test_batch_size_over_one_refuses_unequal_samples() -> None:
    from quantize.backends import resolve_batch_size
    from quantize.errors import RecipeError

    with pytest.raises(RecipeError) as info:
        resolve_batch_size(8, "cuda", [[1] * 16, [1] * 9])
    assert info.value.problem == "batch_size 8 needs equal-length calibration samples"
    assert info.value.hint is not None and "batch_size: 1" in info.value.hint


def _recipe(text: str):  # type: ignore[no-untyped-def]
    import yaml

    from quantize.recipe.recipe import Recipe

    return Recipe.model_validate(yaml.safe_load(text))


BASE = "name: v\ndescription: d\nscheme: W4A16_ASYM\ngroup_size: 64\n"


@pytest.mark.parametrize("observer", ["mse", "imatrix_mse"])
def test_observer_reaches_every_config_group(observer: str) -> None:
    r = _recipe(BASE + f"method: gptq\nobserver: {observer}\n"
                "overrides: [{targets: ['re:.*down_proj'], scheme: W8A16}]\n")
    (gptq,) = build_modifiers(r, 64)
    assert {g.weights.observer for g in gptq.config_groups.values()} == {observer}


def test_default_observer_is_the_librarys() -> None:
    (gptq,) = build_modifiers(_recipe(BASE + "method: gptq\n"), 64)
    assert _weights(gptq).observer is None  # filled in by the library (memoryless_minmax)


def test_autoround_is_one_modifier_with_its_options() -> None:
    r = _recipe(BASE.replace("W4A16_ASYM", "W4A16") +
                "method: autoround\nautoround: {iters: 50, batch_size: 4}\n")
    (ar,) = build_modifiers(r, 64)
    assert type(ar).__name__ == "AutoRoundModifier"
    assert (ar.iters, ar.batch_size, ar.enable_torch_compile, ar.lr) == (50, 4, False, None)
    w = _weights(ar)
    assert (w.num_bits, w.symmetric, w.group_size) == (4, True, 64)


def test_awq_without_search_samples_is_the_librarys_own() -> None:
    awq, _ = build_modifiers(_recipe(BASE + "method: awq\nawq: {n_grid: 10}\n"), 64)
    assert type(awq).__name__ == "AWQModifier" and awq.n_grid == 10


def test_awq_then_gptq_composes_the_two_modifiers() -> None:
    r = _recipe(BASE + "method: awq+gptq\nawq: {n_grid: 10}\ngptq: {actorder: weight}\n")
    awq, gptq = build_modifiers(r, 64)
    assert type(awq).__name__ == "AWQModifier" and awq.n_grid == 10
    assert type(gptq).__name__ == "GPTQModifier" and str(gptq.actorder) == "weight"
    assert _weights(gptq).symmetric is False


def test_save_casts_back_to_the_source_dtype_where_module_to_does_not(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """On torch 2.11 (the lent H200's image) `model.to(bf16)` after oneshot left every
    parameter fp32 and the CPU-calibrated export was written fp32 (2x the planned size);
    save then casts each parameter itself. Simulated here with a `to` that does nothing."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantize.backends.llmcompressor import save

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.to = lambda *a, **k: model  # type: ignore[method-assign]
    seen: dict[str, set[torch.dtype]] = {}
    model.save_pretrained = lambda out, **kw: seen.setdefault(  # type: ignore[method-assign]
        "dtypes", {p.dtype for p in model.parameters()})
    save(model, None, tmp_path, torch.float32, torch.bfloat16, write=False)
    assert seen["dtypes"] == {torch.bfloat16}
