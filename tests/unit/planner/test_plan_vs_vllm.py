"""`quantize plan` against vLLM 0.26.0 running on an H200 (bench/results/
2026-12-04-plan-vs-vllm.json; bench/vllm_gpu.py made the rows, bench/plan_check.py compares):
each configuration's KV-cache tokens and maximum concurrency as vLLM logged them, pinned here.
The plan must be within 1 % and never more than 0.3 % above (a plan that says "fits" must
start), and each lever must move the plan the way its flag moves vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest

from quantize.planner import plan as P
from quantize.planner.gpus import find
from quantize.planner.levers import boundary, margin
from quantize.planner.rows import PlanRequest
from quantize.recipe.recipe import load_recipe

L8 = "meta-llama/Llama-3.1-8B-Instruct"
# (label, recipe, vLLM settings: gpu_memory_utilization, max_model_len, max_num_batched_tokens,
# max_num_seqs, eager), vLLM's "GPU KV cache size" and "Maximum concurrency" lines
H200_ROWS = [
    ("bf16, 0.9, 8k", None, (0.9, 8192, 16384, 1024, False), 891_392, 108.81),
    ("fp8-dynamic, 0.9, 8k", "fp8-dynamic", (0.9, 8192, 16384, 1024, False), 944_512, 115.30),
    ("gptq-int4-asym (Machete), 0.9, 8k", "gptq-int4-asym", (0.9, 8192, 16384, 1024, False),
     967_872, 118.15),
    ("gptq-int4-asym --linear-backend marlin", "gptq-int4-asym",
     (0.9, 8192, 16384, 1024, False), 969_248, 118.32),
    ("gptq-int4-asym g128, 0.9, 8k", "bench/variants/gptq-int4-asym-g128.yaml",
     (0.9, 8192, 16384, 1024, False), 969_728, 118.38),
    ("gptq-int4-asym, a 24 GB card's share, 32k, eager", "gptq-int4-asym",
     (0.1515, 32768, 2048, 256, True), 123_232, 3.76),
    ("the same at max_model_len 121,984 (starts)", "gptq-int4-asym",
     (0.1515, 121984, 2048, 256, True), 123_232, 1.01),
    # 2026-12-05 (bench/results/2026-12-05-plan-vs-vllm.json): CUDA graphs on at a 24 GB
    # card's settings raise the profile peak (1.01 GiB against 0.21 eager); fp8 KV cache
    ("bf16, a 24 GB card's share, 8k, CUDA graphs", None, (0.1508, 8192, 2048, 256, False),
     39_664, 4.84),
    ("fp8-kv, 0.9, 8k", "fp8-kv", (0.9, 8192, 16384, 1024, False), 1_889_024, 230.59),
]


@pytest.mark.parametrize("row", H200_ROWS, ids=[r[0] for r in H200_ROWS])
def test_plan_matches_vllm_026_on_h200(row: tuple) -> None:  # type: ignore[type-arg]
    _, recipe, (util, mml, batched, seqs, eager), tokens, concurrency = row
    mem = P.predict(L8, find("h200"), util=util, context=mml, batched=batched, seqs=seqs,
                    recipe=load_recipe(recipe) if recipe else None, profile="0.26", eager=eager,
                    kv_fp8=recipe == "fp8-kv")  # served with --kv-cache-dtype fp8
    err = mem.kv_tokens / tokens - 1
    assert -0.01 <= err <= 0.003, f"KV tokens {mem.kv_tokens:,} vs vLLM {tokens:,}"
    cerr = mem.max_concurrency / concurrency - 1
    assert -0.01 <= cerr <= 0.003 + 0.005 / concurrency  # vLLM logs two decimals


def test_cpu_offload_moved_nothing_in_vllm_026() -> None:
    """--cpu-offload-gb 8 on the 24 GB-card bf16 row: vLLM 0.26 still loaded 15.0 GiB of
    weights, logged the same 39,664 KV tokens and decoded at 194 against 196 tokens/s; the
    plan counts the same."""
    base = P.predict(L8, find("h200"), util=0.1508, context=8192, batched=2048, seqs=256)
    off = P.predict(L8, find("h200"), util=0.1508, context=8192, batched=2048, seqs=256,
                    cpu_offload_gib=8.0)
    assert off.kv_tokens == base.kv_tokens and off.offloaded == 0


def test_the_boundary_vllm_drew_is_where_the_plan_draws_it() -> None:
    """vLLM started at max_model_len 121,984 and refused 124,464 ("To serve at least one
    request with the model's max seq len (124464), (15.19 GiB KV cache is needed, which is
    larger than the available KV cache memory (15.04 GiB)"): the plan says the same."""
    fits = P.predict(L8, find("h200"), util=0.1515, context=121_984, batched=2048, seqs=256,
                     recipe=load_recipe("gptq-int4-asym"), eager=True)
    refused = P.predict(L8, find("h200"), util=0.1515, context=124_464, batched=2048, seqs=256,
                        recipe=load_recipe("gptq-int4-asym"), eager=True)
    assert fits.max_concurrency >= 1 > refused.max_concurrency
    assert boundary(fits, 1).startswith("fits with")
    assert boundary(refused, 1).startswith("short by")
    assert margin(refused, 1).startswith("refused")


def _plan(**kw: object) -> P.Plan:
    base = dict(model=L8, gpu=find("rtx4090"), context=32768, concurrency=8,
                recipes=["gptq-int4-asym"])
    return P.make_plan(PlanRequest(**{**base, **kw}))  # type: ignore[arg-type]


def test_levers_move_the_plan_as_their_flags_move_vllm() -> None:
    plan = _plan()
    row = next(r for r in plan.rows if r.recipe == "gptq-int4-asym")
    assert row.status == "partial" and plan.lever_row is row and row.memory is not None
    by_flag = {lv.flag.split()[0]: lv for lv in plan.levers}
    # vLLM 0.26 measured no effect of --cpu-offload-gb (memory.PROFILES): not offered there
    assert set(by_flag) == {"--kv-cache-dtype", "--enforce-eager"}
    fp8 = P.predict(L8, find("rtx4090"), context=32768, seqs=8, kv_fp8=True,
                    recipe=load_recipe("gptq-int4-asym"))
    assert by_flag["--kv-cache-dtype"].sequences == fp8.max_sequences > row.memory.max_sequences
    offload = _plan(cpu_offload_gib=2.0).rows[1].memory
    assert offload is not None and offload.offloaded == 0
    assert offload.available == row.memory.available
    # where the engine offloads (the 0.19 profile), N GiB of weights give the KV cache N GiB
    old = _plan(profile="0.19")
    old_row = next(r for r in old.rows if r.recipe == "gptq-int4-asym").memory
    moved = _plan(profile="0.19", cpu_offload_gib=2.0).rows[1].memory
    assert old_row is not None and moved is not None and moved.offloaded == 2 * (1 << 30)
    assert moved.available - old_row.available == 2 * (1 << 30)
    assert any(lv.flag.startswith("--cpu-offload-gb") for lv in old.levers)
    # a smaller prefill budget lowers the activation peak (the 4090's default is 2048 already)
    big = _plan(max_num_batched_tokens=16384)
    assert any(lv.flag.startswith("--max-num-batched-tokens 2048") for lv in big.levers)


def test_the_serve_line_carries_the_levers_the_plan_assumed() -> None:
    plan = _plan(cpu_offload_gib=3.0, enforce_eager=True, max_num_seqs=12, concurrency=4)
    serve = next(r for r in plan.rows if r.recipe == "gptq-int4-asym").serve or ""
    assert "--cpu-offload-gb 3" in serve and "--enforce-eager" in serve
    assert "--max-num-seqs 12" in serve
    assert not any(lv.flag.startswith("--enforce-eager") for lv in plan.levers)
    # the flag is passed on as asked; 0.26 frees nothing by it, so the boundary is the same
    same = _plan(enforce_eager=True, max_num_seqs=12, concurrency=4)
    assert plan.to_dict()["boundary"] == same.to_dict()["boundary"]


def test_measured_speeds_reach_the_plan_on_the_gpu_they_were_measured_on() -> None:
    """W4A16 on Hopper: vLLM's own kernel (Machete) and --linear-backend marlin, both measured
    (quantize/data/vllm_speed.yaml); a GPU without rows says nothing."""
    from quantize.planner.speed import describe, measured

    asym = load_recipe("gptq-int4-asym")
    rows = measured(asym, 90, 64)
    assert [r.kernel for r in rows] == ["MacheteLinearKernel", "MarlinLinearKernel"]
    assert rows[1].one_request > rows[0].one_request > 1.0  # batch 1: Marlin is faster
    assert rows[0].sixty_four_requests > rows[1].sixty_four_requests  # at 64: Machete
    assert measured(asym, 89, 64) == [] and measured(None, 90, 64) == []
    assert "1.49x bf16 output tokens/s at one request" in describe(rows)[1]
    assert measured(asym, 90, 64, "h200") == rows  # the H200's own rows
    # the H100's own row when the plan is for an H100 (ratios are per GPU, never mixed)
    (h100,) = measured(asym, 90, 64, "h100")
    assert h100.gpu == "h100" and h100.rotation is None
    # a rotated export runs an online Hadamard per layer: its own rows, not the uniform ones
    (rot,) = measured(load_recipe("gptq-int4-rotated"), 90, 64, "h200")
    assert rot.rotation == 64 and rot.gpu == "h100"  # measured on the H100 only: named so
    assert rot.one_request < h100.one_request
    assert "online Hadamard" in describe([rot])[0] and "H100" in describe([rot])[0]
    # Llama-3.1-70B on one H200: bf16 does not fit, the 4-bit default does
    plan = _plan(model="meta-llama/Llama-3.1-70B-Instruct", gpu=find("h200"), context=8192,
                 concurrency=1, recipes=["gptq-int4-asym"], runs_dir=Path("/nonexistent"))
    assert plan.recommendation is not None and plan.recommendation.recipe == "gptq-int4-asym"
    assert "--linear-backend marlin" in [lv.flag for lv in plan.levers]
    assert [r.kernel for r in plan.speed] == ["MacheteLinearKernel"]
    assert plan.to_dict()["measured_speed"][0]["one_request"] == 1.25
