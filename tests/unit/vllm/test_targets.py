"""quantize.vllm.targets: vLLM's fused layer names beside their shards, only where every
shard of the fused layer is in the group."""

from __future__ import annotations

from quantize.vllm.targets import with_fused_names


def test_fully_listed_shards_get_the_fused_name_and_nothing_else_changes() -> None:
    main = {"targets": ["Linear"], "weights": {"num_bits": 4}}
    high = {"targets": ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj",
                        "model.layers.1.self_attn.v_proj", "model.layers.2.self_attn.q_proj",
                        "model.layers.2.self_attn.k_proj",  # v_proj at 4 bits: not fused here
                        "model.layers.3.mlp.gate_proj", "model.layers.3.mlp.up_proj",
                        "model.layers.3.mlp.down_proj", "re:.*lm_head"],
            "weights": {"num_bits": 8}}
    out = with_fused_names({"group_0": main, "group_1": high})
    assert out["group_0"] is main
    assert out["group_1"]["targets"] == [*high["targets"], "model.layers.1.self_attn.qkv_proj",
                                         "model.layers.3.mlp.gate_up_proj"]
    assert out["group_1"]["weights"] == {"num_bits": 8}
    assert with_fused_names(out) == out  # names already there are not added twice
