"""Each llm-compressor workaround is still needed; when one of these fails, upstream fixed
the problem: delete the workaround in quantize/backends/_llmc_compat.py and this test."""

from __future__ import annotations

import pytest
import torch

from quantize.backends import _llmc_compat


@pytest.mark.skipif(torch.accelerator.is_available(), reason="the bug only shows without one")
def test_cpu_pin_memory_still_raises_upstream() -> None:
    from llmcompressor.pipelines.cache import IntermediatesCache

    assert _llmc_compat.cpu_pin_memory_is_broken()
    cache = IntermediatesCache.from_dataloader([{"x": torch.zeros(2)}], torch.device("cpu"))
    original = IntermediatesCache.__dict__["pin_memory"]
    if getattr(IntermediatesCache, "_quantize_patched", 0):
        pytest.skip("already patched in this process; the check above still holds")
    with pytest.raises(RuntimeError, match="accelerator"):
        original(cache, 0)


def test_distributed_qparam_broadcast_still_unsynchronised_upstream() -> None:
    assert _llmc_compat.cpu_qparams_unsynchronised()


def test_apply_distributed_wraps_both_users_once() -> None:
    import importlib

    names = _llmc_compat._QPARAM_USERS
    before = [importlib.import_module(n).broadcast_qparams_and_cleanup for n in names]
    original = importlib.import_module("llmcompressor.utils.dist").broadcast_qparams_and_cleanup
    try:
        _llmc_compat.apply_distributed()
        after = [importlib.import_module(n).broadcast_qparams_and_cleanup for n in names]
        assert all(a is not original for a in after) and after[0] is after[1]
        _llmc_compat.apply_distributed()  # idempotent
        assert [importlib.import_module(n).broadcast_qparams_and_cleanup
                for n in names] == after
    finally:
        for n, fn in zip(names, before, strict=True):
            importlib.import_module(n).broadcast_qparams_and_cleanup = fn


def _deepseek_v3_marked() -> torch.nn.Module:
    """The tiny DeepSeek-V3 fixture (first layer dense, two MoE layers of 8 experts),
    linearized, every Linear but the routers and lm_head marked as quantization targets (what
    AWQ checks before it maps a layer)."""
    from fixtures.moe import CONFIGS
    from transformers import AutoModelForCausalLM

    from quantize.model.moe import linearize

    class Tok:
        bos_token_id, eos_token_id, pad_token_id = 1, 2, 2

        def __len__(self) -> int:
            return 512

    model = linearize(AutoModelForCausalLM.from_config(CONFIGS["deepseek_v3"](Tok())))
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and not name.endswith(("mlp.gate", "lm_head")):
            mod.quantization_scheme = object()
    return model


def test_deepseek_v3_awq_mappings_still_fail_upstream() -> None:
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from llmcompressor.modifiers.transform.awq.mappings import AWQ_MAPPING_REGISTRY

    awq = AWQModifier(mappings=AWQ_MAPPING_REGISTRY["DeepseekV3ForCausalLM"])
    with pytest.raises(ValueError, match="single smoothlayer"):
        awq._set_resolved_mappings(_deepseek_v3_marked())


def test_deepseek_v3_awq_mappings_balance_each_layer_router_included() -> None:
    """One post-attention mapping per layer: the dense layer's norm with its gate/up, each MoE
    layer's norm with its router, its 8 experts' gate/up and the shared expert's."""
    from llmcompressor.modifiers.transform.awq import AWQModifier

    model = _deepseek_v3_marked()
    awq = AWQModifier(mappings=_llmc_compat.awq_mappings(model))
    awq._set_resolved_mappings(model)
    post = {m.smooth_name: m.balance_names for m in awq._resolved_mappings
            if m.smooth_name.endswith("post_attention_layernorm")}
    assert sorted(post) == [f"model.layers.{i}.post_attention_layernorm" for i in range(3)]
    assert post["model.layers.0.post_attention_layernorm"] == [
        "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    for i in (1, 2):
        names = post[f"model.layers.{i}.post_attention_layernorm"]
        assert f"model.layers.{i}.mlp.gate" in names and len(names) == 1 + 8 * 2 + 2
        assert all(n.startswith(f"model.layers.{i}.") for n in names)


def test_awq_mappings_leave_other_models_to_the_library() -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         intermediate_size=32, moe_intermediate_size=16, num_experts=2,
                         num_experts_per_tok=1)
    with torch.device("meta"):
        assert _llmc_compat.awq_mappings(Qwen3MoeForCausalLM(cfg)) is None
    assert _llmc_compat.awq_mappings(None) is None
