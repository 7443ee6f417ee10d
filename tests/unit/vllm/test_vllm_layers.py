"""quantize.vllm.layers: vLLM's fused sibling groups and its head-splitting rule."""

from __future__ import annotations

from quantize.vllm.layers import FUSED_GROUPS, FUSED_NAMES, ROW_PARALLEL, heads_problem


def test_fused_groups_are_the_fused_names_shards() -> None:
    assert set(FUSED_NAMES.values()) <= set(FUSED_GROUPS)
    assert ("w1", "w3") in FUSED_GROUPS
    assert not {s for g in FUSED_GROUPS for s in g} & set(ROW_PARALLEL)  # column-parallel


def test_heads_problem() -> None:
    assert heads_problem(32, 8, 4) is None
    assert heads_problem(32, 8, 16) is None  # 8 KV heads replicated over 16 ranks
    assert "not divisible by 3" in (heads_problem(32, 8, 3) or "")
    assert "cannot be split or replicated" in (heads_problem(36, 6, 4) or "")
    assert heads_problem(None, None, 8) is None
