"""quantize.model.layers: the Linears a recipe targets on a meta model, the group size they
get (the recipe's, `auto`, an override's), and the experts module of a per-expert name."""

from __future__ import annotations

import pytest

from quantize.errors import PreflightError
from quantize.model import layers
from quantize.model.config import ModelConfig
from quantize.recipe.recipe import Override, Recipe

QKV = "re:.*(q|k|v)_proj$"
LLAMA = ModelConfig.model_validate({
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 2, "num_attention_heads": 9,
    "num_key_value_heads": 3, "vocab_size": 256})


def _recipe(**kw: object) -> Recipe:
    base = {"name": "t", "description": "t", "method": "gptq", "scheme": "W4A16_ASYM",
            "ignore": ["lm_head"]}
    return Recipe.model_validate(base | kw)


def test_targeted_layers_match_what_compressed_tensors_matches() -> None:
    meta = layers.meta_model(LLAMA)
    every = layers.targeted_layers(meta, ["Linear"], ["lm_head"])
    assert len(every) == 2 * 7 and all(lay.copies == 1 for lay in every)
    qkv = layers.targeted_layers(meta, [QKV], [])
    assert {lay.name.rpartition(".")[2] for lay in qkv} == {"q_proj", "k_proj", "v_proj"}
    assert {(lay.in_features, lay.out_features) for lay in qkv} == {(576, 576), (576, 192)}


def test_group_size_auto_takes_the_largest_that_divides_every_layer() -> None:
    every = layers.targeted_layers(layers.meta_model(LLAMA), ["Linear"], ["lm_head"])
    assert layers.divisors(every) == [64, 32, 16]  # 576 = 9 x 64: 128 does not divide it
    assert layers.resolve_group_size(_recipe(group_size="auto"), every) == 64
    assert layers.resolve_group_size(_recipe(group_size=32), every) == 32
    with pytest.raises(PreflightError, match="group_size 128 does not divide"):
        layers.resolve_group_size(_recipe(group_size=128), every)
    assert layers.resolve_group_size(_recipe(scheme="W8A8", group_size=None), every) is None


def test_override_group_size_rule() -> None:
    ov = Override(targets=[QKV], scheme="W8A16")
    assert layers.override_group_size(ov, 64) == 64
    assert layers.override_group_size(ov.model_copy(update={"group_size": "auto"}), 32) == 32
    assert layers.override_group_size(ov.model_copy(update={"group_size": 16}), 64) == 16
    assert layers.override_group_size(ov, None) == 128  # compressed-tensors' preset
    assert layers.override_group_size(Override(targets=[QKV], scheme="W8A8"), 64) is None


def test_experts_module() -> None:
    assert layers.experts_module("model.layers.3.mlp.experts.17.down_proj") == \
        "model.layers.3.mlp.experts"
    assert layers.experts_module("model.layers.3.mlp.down_proj") is None
