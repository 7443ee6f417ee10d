"""The layer names vLLM matches a compressed-tensors config group by, written into an export
so that vLLM releases before the fix load a per-layer mix.

vLLM fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, then asks which config
group each fused layer belongs to. Until vllm-project/vllm#49483 (merged 2026-07-22) its
`find_matched_target` tried the exact name, then the module's class name, then the fused
shards: in an export whose main group targets `Linear` and whose 8-bit group names
`...q_proj`, `...k_proj`, `...v_proj`, the fused layer matched `Linear` first, was built at 4
bits, and loading the 8-bit shards failed on a shape assertion. Observed on an H100 with
vLLM 0.26.0 for the default recipe's export (bench/RESULTS.md); vLLM 0.32 matches the shards
first. Naming the fused layer itself in the group makes the first step match in every release;
compressed-tensors, which matches the model's unfused Linears, does not use these names.
"""

from __future__ import annotations

from typing import Any

from quantize.vllm.layers import FUSED_NAMES


def with_fused_names(config_groups: dict[str, Any]) -> dict[str, Any]:
    """The config groups with each fully listed set of shards also named as vLLM's fused
    layer (`model.layers.3.self_attn.qkv_proj` beside its q/k/v). Groups that target by
    class or pattern are left as they are."""
    out = {}
    for name, group in config_groups.items():
        targets = list(group.get("targets") or [])
        exact = {t for t in targets if not t.startswith("re:")}
        added = []
        for t in targets:
            parent, _, leaf = t.rpartition(".")
            for fused, shards in FUSED_NAMES.items():
                if (parent and leaf == shards[0] and f"{parent}.{fused}" not in exact
                        and all(f"{parent}.{s}" in exact for s in shards)):
                    added.append(f"{parent}.{fused}")
        out[name] = {**group, "targets": targets + added} if added else group
    return out
