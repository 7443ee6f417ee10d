"""How vLLM treats a model's layers, for the checks that must agree with it before any work:
which sibling Linears it fuses into one, which it shards by their input dimension under
tensor parallelism, and when it cannot split the attention heads over the ranks."""

from __future__ import annotations

# vLLM fuses these sibling layers into one (QKVParallelLinear, MergedColumnParallelLinear); the
# names are the `packed_modules_mapping` of its Llama/Mistral/Qwen/... model classes.
FUSED_NAMES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
               "gate_up_proj": ("gate_proj", "up_proj")}
# the shard groups; Mixtral-style experts fuse w1/w3 the same way
FUSED_GROUPS = (*FUSED_NAMES.values(), ("w1", "w3"))
# Layers whose input dimension vLLM shards across tensor-parallel ranks (RowParallelLinear);
# every other Linear is column-parallel (output dimension sharded).
ROW_PARALLEL = ("o_proj", "down_proj", "out_proj", "dense_4h_to_h", "fc2", "c_proj", "wo", "w2")


def heads_problem(heads: int | None, kv_heads: int | None, tp: int) -> str | None:
    """Why vLLM cannot split `heads` query and `kv_heads` KV heads over `tp` ranks, or None.
    One rule for pre-flight (from config.json) and the planner (from the model shape)."""
    if heads and heads % tp:
        ok = [d for d in range(1, heads + 1) if heads % d == 0]
        return (f"num_attention_heads {heads} is not divisible by {tp}, so vLLM refuses the "
                f"model (vllm/config/model.py); use a tp in {ok}")
    kv = kv_heads or heads
    if kv and (kv % tp if kv >= tp else tp % kv):
        return (f"num_key_value_heads {kv} cannot be split or replicated over {tp} ranks "
                "(vllm/model_executor/layers/linear.py QKVParallelLinear); use a tp that "
                f"divides {kv} or a multiple of it")
    return None
