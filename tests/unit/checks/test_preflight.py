"""Pre-flight checks: each one has a model config that triggers it, and the message names the
layer (or config field) and the fix. Meta-device models only: no weights, a few seconds."""

from __future__ import annotations

from typing import Any

import pytest

from quantize.checks import preflight
from quantize.errors import PreflightError
from quantize.model import layers as model_layers
from quantize.model.config import ModelConfig
from quantize.recipe.recipe import Override, Recipe


def llama(**over: Any) -> ModelConfig:
    """A 2-layer config shaped like the default model (SmolLM2-135M)."""
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 576,
           "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
           "head_dim": 64, "num_hidden_layers": 2, "vocab_size": 1024,
           "tie_word_embeddings": True}
    cfg.update(over)
    return ModelConfig.model_validate(cfg)


def refusal(r: Recipe, cfg: ModelConfig, tp: int = 1) -> PreflightError:
    """The error pre-flight raises; tests assert its fields (problem, hint), not its prose."""
    with pytest.raises(PreflightError) as info:
        preflight.check(r, cfg, tp=tp)
    assert info.value.problem is not None
    return info.value


def recipe(**over: Any) -> Recipe:
    base: dict[str, Any] = {"name": "t", "description": "test", "method": "rtn",
                            "scheme": "W4A16", "group_size": 64}
    base.update(over)
    return Recipe(**base)


def test_default_shape_passes_and_reports_marlin_padding() -> None:
    facts = preflight.check(recipe(), llama())
    assert facts.group_size == 64 and facts.tp == 1
    assert facts.layers == 2 * 7
    # 576 is neither N%64&K%128 nor N%128&K%64 for q_proj (N=K=576): Marlin pads it.
    assert any("Marlin" in w and "q_proj" in w for w in facts.warnings)


def test_old_signature_still_works() -> None:
    assert preflight.check(recipe(), llama()).group_size == 64


def test_group_size_must_divide_every_layer() -> None:
    err = refusal(recipe(group_size=128), llama())
    assert err.problem is not None and err.problem.startswith("group_size 128 does not divide")
    assert "q_proj (in_features 576)" in err.problem
    assert err.hint == ("sizes that divide every targeted layer: 64, 32, 16; set group_size to "
                        "one of them or `auto`")


def test_tp_must_divide_attention_heads() -> None:
    err = refusal(recipe(), llama(), tp=2)
    assert err.problem is not None and err.problem.startswith("--tp 2: num_attention_heads 9")
    assert err.hint == "use a tp in [1, 3, 9]"


def test_tp_must_split_or_replicate_kv_heads() -> None:
    cfg = llama(num_attention_heads=8, num_key_value_heads=3, hidden_size=512, head_dim=64)
    err = refusal(recipe(), cfg, tp=2)
    assert err.problem is not None and "num_key_value_heads 3" in err.problem
    assert "over 2 ranks" in err.problem and err.hint is not None and "divides 3" in err.hint


def test_tp_replicating_kv_heads_is_fine() -> None:
    cfg = llama(num_attention_heads=8, num_key_value_heads=2, hidden_size=512,
                intermediate_size=1536, head_dim=64)
    assert preflight.check(recipe(), cfg, tp=4).tp == 4


def test_tp_must_divide_sharded_dimension() -> None:
    cfg = llama(num_attention_heads=8, num_key_value_heads=4, hidden_size=512, head_dim=64,
                intermediate_size=1002)
    err = refusal(recipe(scheme="W8A8", group_size=None), cfg, tp=4)
    assert err.problem is not None and "gate_proj shards its out_features (1002) over 4 ranks" \
        in err.problem
    assert err.hint == "use a tp that divides 1002"


def test_group_times_tp_must_divide_row_parallel_inputs() -> None:
    # down_proj's input (1280) is sharded: 1280 / 4 = 320 per rank, not a multiple of 128.
    cfg = llama(num_attention_heads=8, num_key_value_heads=4, hidden_size=512, head_dim=64,
                intermediate_size=1280)
    assert preflight.check(recipe(group_size=128), cfg, tp=1).group_size == 128
    err = refusal(recipe(group_size=128), cfg, tp=4)
    assert err.problem is not None and ("down_proj has in_features 1280, 320 per rank, which "
                                        "group_size 128 does not divide") in err.problem
    assert err.hint is not None and err.hint.startswith("use a group_size dividing 320")


def test_group_size_outside_marlin_set_warns() -> None:
    facts = preflight.check(recipe(group_size=16), llama())
    assert any("group_size [16]" in w for w in facts.warnings)


def test_marlin_friendly_shapes_give_no_warning() -> None:
    cfg = llama(num_attention_heads=8, num_key_value_heads=8, hidden_size=512, head_dim=64,
                intermediate_size=1024)
    assert preflight.check(recipe(group_size=128), cfg, tp=2).warnings == []


def test_fused_qkv_shards_need_one_scheme() -> None:
    r = recipe(overrides=[Override(targets=["re:.*k_proj$"], scheme="W8A16", group_size=64)])
    err = refusal(r, llama())
    assert err.problem is not None
    assert err.problem.startswith("model.layers.0.self_attn: q_proj/k_proj/v_proj are fused")
    assert "k_proj W8A16 g64" in err.problem
    assert err.hint is not None and err.hint.startswith("give all of them the same scheme")


def test_fused_shards_ignored_alone_are_refused() -> None:
    r = recipe(ignore=["lm_head", "re:.*up_proj$"])
    err = refusal(r, llama())
    assert err.problem is not None and "gate_proj/up_proj" in err.problem
    assert "up_proj unquantized" in err.problem


def test_fused_shards_overridden_together_pass() -> None:
    r = recipe(overrides=[Override(targets=["re:.*(gate|up)_proj$"], scheme="W8A16",
                                   group_size=64)])
    assert preflight.check(r, llama()).layers == 14


def test_tied_embeddings_refuse_quantized_lm_head() -> None:
    err = refusal(recipe(ignore=[]), llama())
    assert err.problem is not None and err.problem.startswith("lm_head is tied")
    assert err.hint == "add lm_head to `ignore`"


def test_kv_cache_needs_separate_k_v_projections() -> None:
    # Phi-3 fuses q/k/v into one qkv_proj Linear.
    cfg = ModelConfig.model_validate({
        "model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "hidden_size": 256,
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": 1, "vocab_size": 512, "tie_word_embeddings": False,
        "pad_token_id": 0})
    r = recipe(scheme="FP8_DYNAMIC", group_size=None, kv_cache="fp8")
    err = refusal(r, cfg)
    assert err.problem is not None and err.problem.startswith(
        "kv_cache: fp8 needs separate k_proj/v_proj")
    assert err.hint == "remove kv_cache from the recipe"


def test_unknown_model_type_is_an_unsupported_architecture() -> None:
    err = refusal(recipe(), llama(model_type="not-a-model"))
    assert err.problem is not None and err.problem.startswith("unsupported architecture: ")
    assert "'not-a-model'" in err.problem
    assert err.hint == "use a supported model or upgrade transformers"


def test_config_without_architectures_is_refused() -> None:
    cfg = llama().without("architectures")
    err = refusal(recipe(), cfg)
    assert err.problem == "config.json has no `architectures`"
    assert err.hint is not None and "LlamaForCausalLM" in err.hint


def test_architecture_unknown_to_vllm_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = '_TEXT_GENERATION_MODELS = {\n    "LlamaForCausalLM": ("llama", "Llama"),\n}'
    monkeypatch.setattr(preflight, "_vllm_registry_text", lambda: ("0.32.0", registry))
    assert preflight.check(recipe(), llama()).layers == 14
    err = refusal(recipe(), llama(architectures=["MyLlamaForCausalLM"]))
    assert err.problem is not None and err.problem.startswith(
        "architecture MyLlamaForCausalLM is not in vLLM 0.32.0's model registry")
    assert err.hint == "use a supported model or upgrade vLLM (`make vllm-env`)"


def test_registry_is_read_from_the_vllm_env(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Any) -> None:
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    reg = site / "vllm" / "model_executor" / "models" / "registry.py"
    reg.parent.mkdir(parents=True)
    reg.write_text('"LlamaForCausalLM": ("llama", "LlamaForCausalLM"),\n')
    (site / "vllm-9.9.9.dist-info").mkdir()
    py = tmp_path / "venv" / "bin" / "python"
    py.parent.mkdir()
    py.write_text("")
    monkeypatch.setenv("QUANTIZE_VLLM_PYTHON", str(py))
    found = preflight._vllm_registry_text()
    assert found is not None and found[0] == "9.9.9" and "LlamaForCausalLM" in found[1]


def test_tp_must_be_positive() -> None:
    err = refusal(recipe(), llama(), tp=0)
    assert err.problem == "--tp 0: tensor parallelism needs a positive integer"


# --- overrides: one group-size rule for pre-flight and the engine ---------------------------
QKV = "re:.*(q|k|v)_proj$"


def test_override_without_group_size_inherits_the_recipes() -> None:
    """q/k/v take 576 inputs: the recipe's g64 divides them, the preset's 128 does not. The
    engine quantizes such an override at g64; pre-flight used to check it at 128 and refuse."""
    from quantize.backends.llmcompressor import config_groups

    r = recipe(overrides=[Override(targets=[QKV], scheme="W8A16")])
    assert preflight.check(r, llama()).group_size == 64
    schemes = preflight.layer_schemes(model_layers.meta_model(llama()), r, 64)
    q = next(s for s in schemes if s.layer.name.endswith("layers.0.self_attn.q_proj"))
    assert (q.scheme, q.group_size) == ("W8A16", 64)
    assert config_groups(r, 64)["group_1"].weights.group_size == 64  # what the engine runs


def test_override_inheriting_a_group_size_that_does_not_divide_is_refused() -> None:
    # Per-channel recipe: a grouped override without group_size gets the preset's 128.
    r = recipe(scheme="W8A8", group_size=None,
               overrides=[Override(targets=[QKV], scheme="W4A16")])
    err = refusal(r, llama())
    assert err.problem is not None and err.problem.startswith(
        "override ['re:.*(q|k|v)_proj$']: the recipe's group size, which it inherits (128) "
        "does not divide")
    assert err.problem.endswith("q_proj (in_features 576)")
    assert err.hint == "give the override a group_size that divides its layers (64, 32, 16)"
    ok = r.model_copy(update={"overrides": [Override(targets=[QKV], scheme="W4A16",
                                                     group_size=64)]})
    assert preflight.check(ok, llama()).layers == 14


def test_override_own_group_size_must_divide_its_layers() -> None:
    r = recipe(overrides=[Override(targets=["re:.*down_proj$"], scheme="W8A16",
                                   group_size=1024)])
    err = refusal(r, llama())
    assert err.problem is not None and "its group_size (1024) does not divide" in err.problem
    assert err.problem.endswith("down_proj (in_features 1536)")


def _qwen3_moe() -> ModelConfig:
    return ModelConfig.model_validate({
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
        "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "vocab_size": 1024, "tie_word_embeddings": False})


def test_a_moe_layers_experts_need_one_scheme() -> None:
    """vLLM runs a layer's experts as one fused layer: "All MoE projections need to have
    same quantization scheme but found multiple" (compressed_tensors_moe.py)."""
    moe = _qwen3_moe()
    r = recipe(ignore=["lm_head", "re:.*mlp.gate$"],
               overrides=[Override(targets=["re:.*experts.*down_proj$"], scheme="W8A16",
                                   group_size=64)])
    err = refusal(r, moe)
    assert err.problem is not None and err.problem.startswith("model.layers.0.mlp.experts:")
    assert "All MoE projections need to have same quantization scheme" in err.problem
    assert "0.down_proj W8A16 g64" in err.problem and "0.gate_proj W4A16 g64" in err.problem
    assert err.hint is not None and "the whole `experts` module" in err.hint
    whole = recipe(ignore=["lm_head", "re:.*mlp.gate$"],
                   overrides=[Override(targets=[r"re:.*mlp\.experts\.\d+\."],
                                       scheme="W8A16", group_size=64)])
    assert preflight.check(whole, moe).layers > 0  # all of them together pass


def test_a_rotated_recipe_needs_hadacore_on_the_target(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM runs the online Hadamard in Hadacore, built for sm_80 and later: an export meant
    for an older GPU is refused before calibration; on a host without a CUDA GPU and no
    `--gpu`, a note says vLLM there cannot serve it."""
    import torch

    from quantize.checks.formats import GpuTarget

    rotated = recipe(method="gptq", scheme="W4A16_ASYM", rotation={"block": 64})
    with pytest.raises(PreflightError) as info:
        preflight.check(rotated, llama(), gpu=GpuTarget("t4", 75))
    err = info.value
    assert "sm_75" in (err.problem or "") and "rotation" in (err.hint or "")
    assert not any("Hadacore" in w
                   for w in preflight.check(rotated, llama(), gpu=GpuTarget("l4", 89)).warnings)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert any("Hadacore" in w and "gptq-int4" in w
               for w in preflight.check(rotated, llama()).warnings)
    assert not any("Hadacore" in w for w in preflight.check(recipe(), llama()).warnings)


# --- #47: the stored tensors against config.json (quantize.checks.tensors) -----------------
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "dtype": "float16"}


def _weights(tmp_path: Any, cfg: ModelConfig, change: Any = None) -> Any:
    """A model folder whose safetensors hold zeros of the shapes `cfg`'s meta model has
    (the tied lm_head left out, as save_pretrained does); `change(state)` edits them."""
    import torch
    from safetensors.torch import save_file

    model = model_layers.meta_model(cfg)
    state = {k: torch.zeros(v.shape, dtype=torch.float16) for k, v in model.state_dict().items()
             if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    if change is not None:
        change(state)
    save_file(state, tmp_path / "model.safetensors")
    return tmp_path


def _weights_refused(tmp_path: Any, cfg: ModelConfig, change: Any) -> PreflightError:
    folder = _weights(tmp_path, cfg, change)
    with pytest.raises(PreflightError) as info:
        preflight.check(recipe(), cfg, weights=folder)
    return info.value


def test_weights_that_match_the_config_pass(tmp_path: Any) -> None:
    cfg = llama(**SMALL)
    preflight.check(recipe(), cfg, weights=_weights(tmp_path, cfg))


def test_a_missing_weight_is_named(tmp_path: Any) -> None:
    key = "model.layers.1.mlp.down_proj.weight"
    err = _weights_refused(tmp_path, llama(**SMALL), lambda s: s.pop(key))
    assert err.path == str(tmp_path)
    assert err.problem == (f"stores no tensor {key}, which config.json's architecture needs "
                           "(transformers would initialise it at random)")


def test_an_untied_lm_head_must_be_stored(tmp_path: Any) -> None:
    cfg = llama(**SMALL, tie_word_embeddings=False)
    err = _weights_refused(tmp_path, cfg, lambda s: s.pop("lm_head.weight"))
    assert err.problem is not None and err.problem.startswith("stores no tensor lm_head.weight")


def test_an_extra_weight_is_named_and_many_are_counted(tmp_path: Any) -> None:
    import torch

    def add(s: dict[str, Any]) -> None:
        for i in range(5):
            s[f"model.layers.{9 + i}.mlp.up_proj.weight"] = torch.zeros(2)

    err = _weights_refused(tmp_path, llama(**SMALL), add)
    assert err.path == str(tmp_path / "model.safetensors")
    assert err.problem == ("stores model.layers.10.mlp.up_proj.weight, model.layers.11.mlp."
                           "up_proj.weight, model.layers.12.mlp.up_proj.weight (and 2 more), "
                           "which config.json's architecture has no place for (transformers "
                           "would drop it)")


def test_a_shape_config_json_contradicts(tmp_path: Any) -> None:
    folder = _weights(tmp_path, llama(**SMALL))
    with pytest.raises(PreflightError) as info:
        preflight.check(recipe(), llama(**{**SMALL, "intermediate_size": 192}), weights=folder)
    assert info.value.problem == ("model.layers.0.mlp.down_proj.weight has shape [64, 128] but "
                                  "config.json makes it [64, 192]")


@pytest.mark.parametrize(("dtype", "phrase"), [
    ("int8", "is stored as I8, but a weight of this model is floating point (config.json "
             "declares float16)"),
    ("float8_e4m3fn", "is stored as F8_E4M3, but a weight of this model is floating point "
                      "(config.json declares float16)"),
    ("bfloat16", "is stored as BF16, but config.json declares float16 (loading it as float16 "
                 "would change its values)"),
])
def test_a_dtype_config_json_does_not_declare(tmp_path: Any, dtype: str, phrase: str) -> None:
    import torch

    key = "model.layers.0.self_attn.q_proj.weight"
    err = _weights_refused(tmp_path, llama(**SMALL), lambda s: s.__setitem__(
        key, s[key].to(getattr(torch, dtype))))
    assert err.problem == f"{key} {phrase}"


def test_float32_norms_and_a_missing_prefix_load_as_transformers_loads_them(
        tmp_path: Any) -> None:
    import torch

    def change(s: dict[str, Any]) -> None:
        s["model.norm.weight"] = s["model.norm.weight"].to(torch.float32)
        for k in list(s):  # saved from the base model: no `model.` prefix
            s[k.removeprefix("model.")] = s.pop(k)

    cfg = llama(**SMALL)
    preflight.check(recipe(), cfg, weights=_weights(tmp_path, cfg, change))


def test_a_quantized_source_and_one_without_tensors(tmp_path: Any) -> None:
    from quantize.checks.tensors import check_weights

    quantized = llama(**SMALL, quantization_config={"quant_method": "fp8"})
    folder = _weights(tmp_path, quantized, lambda s: s.pop("model.norm.weight"))
    check_weights(folder, model_layers.meta_model(quantized), quantized)  # left to its engine
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    plain = llama(**SMALL)
    with pytest.raises(PreflightError) as info:
        check_weights(empty, model_layers.meta_model(plain), plain)
    assert info.value.problem == "holds no tensors"


def test_a_tower_the_causal_lm_lacks_is_left_to_transformers(tmp_path: Any) -> None:
    """A multimodal checkpoint's vision tower under a root the text model has no tensor in
    (Llama 4's `vision_model.`) is dropped by transformers by design; a stray tensor under
    the model's own roots is refused (test_an_extra_weight_is_named_and_many_are_counted)."""
    import torch

    def add(s: dict[str, Any]) -> None:
        s["vision_model.patch_embedding.weight"] = torch.zeros(4, 4)
        s["multi_modal_projector.linear_1.weight"] = torch.zeros(4, 4)

    cfg = llama(**SMALL)
    preflight.check(recipe(), cfg, weights=_weights(tmp_path, cfg, add))
