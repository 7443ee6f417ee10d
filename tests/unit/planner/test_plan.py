"""quantize plan: weight formats, the KV formula, vLLM's KV budget against published start-up
logs, the GPU catalog, run folders and the CLI."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from quantize.cli import main
from quantize.errors import PlanError
from quantize.planner import plan as P
from quantize.planner.gpus import catalog, find
from quantize.recipe.recipe import Recipe, available, load_recipe

GIB = 1 << 30


def _shape(**kw: object) -> P.Shape:
    base: dict[str, object] = dict(
        model_type="llama", hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8,
        head_dim=128, vocab=128256, max_position=131072, dtype_bytes=2,
        layer_kinds=("full",) * 80, sliding_window=None, mla_latent=0, experts=0,
        experts_per_token=0, moe_intermediate=0, shared_intermediate=0, dense_mlp_layers=0)
    base.update(kw)
    return P.Shape(**base)  # type: ignore[arg-type]


def _recipe(scheme: str, group: int | None = None, **kw: object) -> Recipe:
    return Recipe(name="probe", description="probe", method="rtn", scheme=scheme,  # type: ignore[arg-type]
                  group_size=group, **kw)  # type: ignore[arg-type]


# --- KV cache formula ---------------------------------------------------------------------
def test_gqa_kv_per_token_splits_heads_over_gpus() -> None:
    s = _shape()
    assert P.kv_bytes_per_token(s, 1, 2) == 2 * 80 * 8 * 128 * 2
    assert P.kv_bytes_per_token(s, 2, 2) == 2 * 80 * 4 * 128 * 2
    assert P.kv_bytes_per_token(s, 1, 1) == 2 * 80 * 8 * 128  # fp8 KV halves it
    # more GPUs than KV heads: vLLM replicates one head per GPU
    assert P.kv_bytes_per_token(s, 16, 2) == 2 * 80 * 1 * 128 * 2


def test_mqa_and_head_dim_not_hidden_over_heads() -> None:
    mqa = _shape(kv_heads=1, layers=2, layer_kinds=("full", "full"))
    assert P.kv_bytes_per_token(mqa, 4, 2) == 2 * 2 * 1 * 128 * 2
    qwen3_32b = _shape(hidden=5120, heads=64, head_dim=128, layers=64, layer_kinds=("full",) * 64)
    assert P.kv_bytes_per_token(qwen3_32b, 1, 2) == 2 * 64 * 8 * 128 * 2  # not 5120 / 64 = 80
    assert "head_dim != hidden/heads" in P.kv_description(qwen3_32b, 1, "bf16")


def test_mla_latent_kv_is_replicated_and_has_no_factor_two() -> None:
    s = _shape(mla_latent=512 + 64, layers=61, layer_kinds=("full",) * 61, heads=128, kv_heads=128)
    assert P.kv_bytes_per_token(s, 1, 2) == 576 * 61 * 2
    assert P.kv_bytes_per_token(s, 8, 2) == 576 * 61 * 2
    assert "MLA latent" in P.kv_description(s, 8, "bf16")


def test_sliding_window_layers_hold_window_minus_one_plus_batch() -> None:
    kinds = ("sliding", "full") * 2
    s = _shape(layers=4, layer_kinds=kinds, sliding_window=4096)
    per_layer = 2 * 8 * 128 * 2
    got = P.request_bytes(s, 1, 2, context=32768, batched=2048)
    swa_tokens = math.ceil((4096 - 1 + 2048) / 16) * 16
    assert got == per_layer * (2 * 32768 + 2 * swa_tokens)
    # context below the window: no saving
    assert P.request_bytes(s, 1, 2, 4000, 2048) == per_layer * 4 * 4000


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4096), st.integers(1, 64), st.sampled_from([1, 2, 4, 8]))
def test_kv_memory_is_linear_in_context_and_concurrency(blocks: int, seqs: int, tp: int) -> None:
    """Folklore says quadratic; the cache is per-token bytes x tokens x sequences."""
    s = _shape()
    context = blocks * P.BLOCK
    one = P.request_bytes(s, tp, 2, context, 8192)
    assert one == P.kv_bytes_per_token(s, tp, 2) * context
    assert P.request_bytes(s, tp, 2, 2 * context, 8192) == 2 * one
    assert seqs * one == seqs * context * P.kv_bytes_per_token(s, tp, 2)


# --- weight formats against compressed-tensors' own compressor -------------------------------
@pytest.mark.parametrize(("preset", "group", "out", "inp"), [
    ("W4A16", 64, 96, 256), ("W4A16_ASYM", 64, 100, 384), ("W4A16_ASYM", 32, 24, 96),
    ("W2A16", 32, 96, 256), ("W8A16", 128, 64, 256), ("W8A8", None, 96, 256),
    ("FP8_DYNAMIC", None, 72, 128),
])
def test_linear_bytes_match_compressed_tensors(preset: str, group: int | None, out: int,
                                               inp: int) -> None:
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )

    model = torch.nn.Sequential(torch.nn.Linear(inp, out, bias=False)).to(torch.float16)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group:
        assert scheme.weights is not None
        scheme.weights.group_size = group
    apply_quantization_config(model, QuantizationConfig(config_groups={"g": scheme}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("weight_scale"):
                param.fill_(0.01)
    ModelCompressor.from_pretrained_model(model).compress_model(model)
    real = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert P.linear_bytes(out, inp, P.format_for(preset, group), 2) == real


def test_fp8_block_format_counts_fp32_block_scales() -> None:
    fmt = P.WeightFormat("fp8-block", 8, block=(128, 128))
    assert P.linear_bytes(300, 7168, fmt, 2) == 300 * 7168 + 3 * 56 * 4


def test_tied_embeddings_counted_once_and_ignored_layers_at_model_dtype() -> None:
    src = P.load_source("Qwen/Qwen3-0.6B")  # tie_word_embeddings: true
    model = P.meta(src.config)
    base = P.estimate_weights(model, 2, P.LayerPlan({}, None))
    params = sum(p.numel() for p in model.parameters())  # tied listed once
    assert base.total == params * 2
    recipe = load_recipe("gptq-int4")
    q = P.estimate_weights(model, 2, P.recipe_layers(model, recipe, 64))
    embed = model.get_input_embeddings().weight.numel() * 2
    assert q.total - q.quantized >= embed  # lm_head ignored, tied to the embedding: once
    assert q.total < base.total / 2


def test_an_override_without_group_size_gets_the_group_pre_flight_and_the_engine_use() -> None:
    """A per-channel recipe (W8A8) with a grouped override (W4A16, no group_size): the engine
    writes compressed-tensors' preset group (128), so plan must count 128-groups too."""
    from quantize.model.layers import PRESET_GROUP_SIZE

    model = P.meta(P.load_source("Qwen/Qwen3-0.6B").config)
    recipe = _recipe("W8A8", overrides=[{"targets": ["re:.*mlp.down_proj"],
                                         "scheme": "W4A16"}])
    formats = P.recipe_layers(model, recipe, None).formats
    down = {f for n, f in formats.items() if n.endswith("down_proj")}
    assert {f.group for f in down} == {PRESET_GROUP_SIZE}
    assert {f.group for n, f in formats.items() if n.endswith("q_proj")} == {None}


def test_moe_experts_are_quantized_and_mla_projections_replicated() -> None:
    src = P.load_source("deepseek-ai/DeepSeek-V2-Lite-Chat")
    model = P.meta(src.config)
    recipe = load_recipe("rtn-int4")
    q = P.estimate_weights(model, 2, P.recipe_layers(model, recipe, 64))
    base = P.estimate_weights(model, 2, P.LayerPlan({}, None))
    assert 0.25 < q.total / base.total < 0.4  # experts are most of the model: ~4.5 bits
    assert base.replicated > 0 and base.per_rank(2) > base.total / 2



@pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_moe"])
def test_fused_experts_count_one_scale_per_output_row(arch: str) -> None:
    """Per-channel formats store one scale per output row, so an expert tensor's layout
    matters: gpt-oss stores `down_proj` as [E, in, out] (`is_transposed`), Qwen3-MoE as
    [E, out, in]. The estimate counts each expert projection as the Linear the export writes
    (it had read gpt-oss's down_proj as 64 outputs instead of 128: 2,048 bytes short of the
    tiny model's fp8-dynamic export, exact now)."""
    from fixtures.moe import CONFIGS
    from transformers import AutoModelForCausalLM

    from quantize.planner.weights import linear_bytes

    class Tok:
        bos_token_id, eos_token_id, pad_token_id = 1, 2, 2

        def __len__(self) -> int:
            return 512

    cfg = CONFIGS[arch](Tok())
    import torch

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    plan = P.recipe_layers(model, load_recipe("fp8-dynamic"), None)
    fmt = next(f for name, f in plan.formats.items() if ".experts.0." in name)
    dense_experts = P.LayerPlan({n: f for n, f in plan.formats.items() if ".experts." not in n},
                                None, experts_by_name=True)
    hidden = cfg.hidden_size
    inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    per_layer = experts * (2 * linear_bytes(inter, hidden, fmt, 2)
                           + linear_bytes(hidden, inter, fmt, 2)
                           - 3 * inter * hidden * 2)
    got = P.estimate_weights(model, 2, plan).total - P.estimate_weights(model, 2,
                                                                       dense_experts).total
    assert got == cfg.num_hidden_layers * per_layer


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_unquantized_estimate_is_the_checkpoints_bytes(arch: str, tmp_path: Path,
                                                       default_tokenizer: Path) -> None:
    """The planner's estimate of a model as it stands is the tensor bytes of the bf16
    checkpoint transformers writes after loading it (as every export is written), to the
    byte, for every tiny MoE fixture: stored buffers count (DeepSeek-V3's router
    `e_score_correction_bias`, which from_pretrained keeps in fp32; the estimate was 64 bytes
    short) and rotary tables do not."""
    import struct

    import torch
    from fixtures.moe import build_moe
    from transformers import AutoModelForCausalLM

    from quantize.model.config import read_config

    src = build_moe(arch, tmp_path / arch, default_tokenizer)
    ckpt = tmp_path / "saved"
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(ckpt)
    stored = 0
    for f in ckpt.glob("*.safetensors"):
        with open(f, "rb") as fh:
            (header,) = struct.unpack("<Q", fh.read(8))
        stored += f.stat().st_size - 8 - header
    model = P.meta(read_config(ckpt))
    assert P.estimate_weights(model, 2, P.LayerPlan({}, None)).total == stored

# --- vLLM's KV budget against published start-up logs -------------------------------------
# Every row: a vLLM start-up log that prints `GPU KV cache size: N tokens` (and usually the
# memory breakdown). `cal` marks the rows the VllmProfile constants were fitted on; the rest
# are held out. Sources:
#   P19 = llm-d-incubation/llm-d-planner accuracy/results/v0.19.0/logs/<file> (vLLM 0.19.0,
#         `vllm serve`, H100 79.19 GiB, gpu_memory_utilization 0.95, enable_prefix_caching off)
#   B11 = llm-d/llm-d-benchmark config_explorer/empirical-vllm-memory-results.md (vLLM 0.11,
#         H100 79.18 GiB, util 0.9, max-model-len 16000, reports KV GiB, block size 128)
#   LMC = LMCache/LMCache pull request #1769 (docs FAQ table, H100, util 0.9)
#   V0  = vllm-project/vllm#10517 (RTX 3090, vLLM V0 0.6: chunked prefill off, so the profile
#         run is max_model_len tokens)
def _ckpt(scheme: str, group: int | None = None) -> Recipe:
    """A published checkpoint's format as a recipe (RedHatAI W8A8 / FP8-dynamic / W4A16)."""
    return _recipe(scheme, group)


L8 = "meta-llama/Llama-3.1-8B-Instruct"
L70 = "meta-llama/Llama-3.3-70B-Instruct"
L70_31 = "meta-llama/Llama-3.1-70B-Instruct"
Q7 = "Qwen/Qwen2.5-7B-Instruct"
Q72 = "Qwen/Qwen2.5-72B-Instruct"
MIXTRAL = "mistralai/Mixtral-8x7B-Instruct-v0.1"
DSV2L = "deepseek-ai/DeepSeek-V2-Lite-Chat"
PUBLISHED = [
    # (source, model, gpu, kwargs, checkpoint format, reported tokens, reported KV GiB, cal)
    ("P19 meta-llama-llama-3-1-8b--h100-80gb--tp1pp1dp1--16384.log", L8,
     "h100", dict(util=.95, context=16384), None, 476_016, 58.11, True),
    ("P19 meta-llama-llama-3-1-8b---h100-80gb--tp2pp1dp1--8192.log", L8,
     "h100", dict(util=.95, context=8192, tp=2), None, 1_044_688, 63.76, True),
    ("P19 meta-llama---h100-80gb--tp1pp1dp1--8192-dtbf16-kvfp8.log", L8,
     "h100", dict(util=.95, context=8192, kv_fp8=True), None, 952_032, 58.11, False),
    ("P19 w8a8-redhatai-llam--h100-80gb--tp1pp1dp1--8192-dtf16.log", L8,
     "h100", dict(util=.95, context=8192), ("W8A8", None), 529_200, 64.60, False),
    ("P19 w4a16-redhatai-lla--h100-80gb--tp1pp1dp1--8192-dtf16.log", L8,
     "h100", dict(util=.95, context=8192), ("W4A16", 128), 554_704, 67.71, False),
    ("P19 qwen-qwen2-5-7b-instruct--h100-80gb--tp1pp1dp1--8192.log", Q7,
     "h100", dict(util=.95, context=8192), None, 1_096_000, 58.53, True),
    ("P19 qwen-qwen2-5-7b-instruct--h100-80gb--tp2pp1dp1--8192.log", Q7,
     "h100", dict(util=.95, context=8192, tp=2), None, 2_390_592, 63.84, False),
    ("P19 qwen-qwen2---h100-80gb--tp1pp1dp1--8192-dtbf16-kvfp8.log", Q7,
     "h100", dict(util=.95, context=8192, kv_fp8=True), None, 2_192_000, 58.53, False),
    ("P19 w8a8-redhatai-qwen2-5-7b--h100-80gb--tp1pp1dp1--8192.log", Q7,
     "h100", dict(util=.95, context=8192), ("W8A8", None), 1_210_272, 64.64, False),
    ("P19 fp8dyn-redhatai-qwen2-5---h100-80gb--tp1pp1dp1--8192.log", Q7,
     "h100", dict(util=.95, context=8192), ("FP8_DYNAMIC", None), 1_210_304, 64.64, False),
    ("P19 fp8dyn-llama-3-3-70b--h100-80gb--tp2pp1dp1--8192.log", L70,
     "h100", dict(util=.95, context=8192, tp=2), ("FP8_DYNAMIC", None), 244_304, 37.28, False),
    ("P19 fp8dyn-llama-3-3-70b--h100-80gb--tp4pp1dp1--8192.log", L70,
     "h100", dict(util=.95, context=8192, tp=4), ("FP8_DYNAMIC", None), 708_992, 54.09, False),
    ("P19 redhatai-llama-3-3-70b-i--h100-80gb--tp2pp1dp1--8192.log", L70,
     "h100", dict(util=.95, context=8192, tp=2), ("W8A8", None), 244_304, 37.28, False),
    ("P19 qwen-qwen2-5-72b-instruc--h100-80gb--tp2pp1dp1--8192.log", Q72,
     "h100", dict(util=.95, context=8192, tp=2), None, 19_920, 3.04, False),
    ("P19 qwen-qwen3-8b--h100-80gb--tp1pp1dp1--8192.log", "Qwen/Qwen3-8B",
     "h100", dict(util=.95, context=8192), None, 418_688, 57.50, False),
    ("P19 qwen-qwen3-30b-a3b--h100-80gb--tp1pp1dp1--8192.log", "Qwen/Qwen3-30B-A3B",
     "h100", dict(util=.95, context=8192), None, 168_288, 15.41, False),
    ("P19 mistralai-mixtral-8x7b-i--h100-80gb--tp2pp1dp1--8192.log", MIXTRAL,
     "h100", dict(util=.95, context=8192, tp=2), None, 465_936, 28.44, False),
    ("P19 deepseek-ai-deepseek-v2---h100-80gb--tp1pp1dp1--8192.log", DSV2L,
     "h100", dict(util=.95, context=8192), None, 1_505_552, 43.61, False),
    ("P19 google-gemma-2-9b-it--h100-80gb--tp1pp1dp1--8192.log", "google/gemma-2-9b-it",
     "h100", dict(util=.95, context=8192), None, 168_880, 54.12, True),
    ("P19 codellama-codellama-7b-h--h100-80gb--tp1pp1dp1--8192.log", "codellama/CodeLlama-7b-hf",
     "h100", dict(util=.95, context=8192), None, 126_256, 61.66, True),
    ("LMC Qwen/Qwen3-8B", "Qwen/Qwen3-8B",
     "h100", dict(util=.9, context=40960, profile="0.11"), None, 366_400, 50.32, False),
    ("LMC Qwen/Qwen3-32B tp=2", "Qwen/Qwen3-32B",
     "h100", dict(util=.9, context=40960, tp=2, profile="0.11"), None, 275_760, 33.66, False),
    ("LMC meta-llama/Llama-3.1-70B tp=4", L70_31,
     "h100", dict(util=.9, context=131072, tp=4, profile="0.11"), None, 420_208, 32.06, False),
    ("B11 Llama-3.1-8B", L8,
     "h100", dict(util=.9, context=16000, profile="0.11"), None, None, 51.38, True),
    ("B11 Qwen3-0.6B", "Qwen/Qwen3-0.6B",
     "h100", dict(util=.9, context=16000, profile="0.11"), None, None, 64.45, True),
    ("B11 Qwen3-32B tp=1", "Qwen/Qwen3-32B",
     "h100", dict(util=.9, context=16000, profile="0.11"), None, None, 4.45, True),
    ("B11 Qwen3-32B tp=2", "Qwen/Qwen3-32B",
     "h100", dict(util=.9, context=16000, tp=2, profile="0.11"), None, None, 34.49, True),
    ("B11 Llama-3.3-70B-FP8 tp=2", L70,
     "h100", dict(util=.9, context=16000, tp=2, profile="0.11"), ("FP8_DYNAMIC", None), None,
     32.00, False),
    ("V0 vllm-project/vllm#10517 (20k)", L8,
     "rtx3090", dict(util=.9, context=20000, batched=20000, seqs=256), None, 1952 * 16, 3.81,
     False),
    ("V0 vllm-project/vllm#10517 (29k)", L8,
     "rtx3090", dict(util=.9, context=29000, batched=29000, seqs=256), None, 1478 * 16, 2.89,
     False),
]
TOLERANCE = 0.05


def _predict(row: tuple) -> tuple[P.Memory, int | None, float]:  # type: ignore[type-arg]
    _, model, gpu, kw, ckpt, tokens, gib, _ = row
    recipe = _ckpt(*ckpt) if ckpt else None
    # logs of vLLM 0.19 (and 0.11 where a row names it): the profile fitted to them
    return P.predict(model, find(gpu), recipe=recipe, **{"profile": "0.19", **kw}), tokens, gib


@pytest.mark.parametrize("row", PUBLISHED, ids=[r[0].split()[-1][:60] for r in PUBLISHED])
def test_kv_capacity_matches_published_vllm_logs(row: tuple) -> None:  # type: ignore[type-arg]
    mem, tokens, gib = _predict(row)
    if tokens is not None:
        assert mem.kv_tokens == pytest.approx(tokens, rel=TOLERANCE)
    assert mem.available / GIB == pytest.approx(gib, rel=TOLERANCE)


def test_kv_tokens_are_whole_blocks_of_the_budget() -> None:
    mem = P.predict("meta-llama/Llama-3.1-8B-Instruct", find("h100"), util=.95, context=8192)
    assert mem.kv_tokens % P.BLOCK == 0
    assert mem.kv_tokens * mem.kv_bytes_per_token <= mem.available
    assert (mem.kv_tokens + P.BLOCK) * mem.kv_bytes_per_token > mem.available


# --- GPU catalog ----------------------------------------------------------------------------
def test_catalog_covers_common_cards() -> None:
    names = set(catalog())
    for need in ("rtx4090", "rtx5090", "l4", "l40s", "a100-40gb", "a100-80gb", "h100", "h200",
                 "b200"):
        assert need in names
    assert find("RTX 5090").name == "rtx5090"
    assert find("A100").name == "a100-80gb"
    assert not find("a100-40gb").fp8 and find("h100").fp8


def test_unknown_gpu_names_the_fix() -> None:
    with pytest.raises(PlanError) as info:
        find("rtx5900")
    assert info.value.problem == "unknown GPU 'rtx5900'"
    hint = info.value.hint or ""
    assert hint.startswith("did you mean 'rtx5090'? known: ") and "--gpu-file" in hint


def test_user_gpu_file_extends_and_overrides(tmp_path: Path) -> None:
    f = tmp_path / "gpus.yaml"
    f.write_text(yaml.safe_dump({"gpus": [
        {"name": "mi-card", "memory_gib": 60.0, "compute_capability": "9.0", "fp8": True},
        {"name": "h100", "memory_gib": 70.0, "compute_capability": "9.0", "fp8": True}]}))
    assert find("mi-card", f).memory_gib == 60.0
    assert find("h100", f).memory_gib == 70.0
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus:\n  - name: x\n    memory_gib: -1\n    compute_capability: '9.0'\n"
                   "    fp8: true\n")
    with pytest.raises(PlanError) as info:
        find("x", bad)
    assert (info.value.path, info.value.line) == (str(bad), 3)
    assert (info.value.problem or "").startswith("gpus.0.memory_gib: ")


def test_fp8_on_cards_without_fp8_runs_weight_only() -> None:
    ok, note = P.gpu_support(load_recipe("fp8-dynamic"), find("a100-80gb"), experts=False)
    assert ok and "weight-only" in note
    ok, note = P.gpu_support(load_recipe("fp8-dynamic"), find("a100-80gb"), experts=True)
    assert not ok and "MoE" in note
    assert P.gpu_support(load_recipe("fp8-dynamic"), find("h100"), experts=True) == (True, "")


def test_rotated_recipes_need_hadacore() -> None:
    """The online Hadamard runs in vLLM's Hadacore kernel, built for sm_80 and later."""
    ok, note = P.gpu_support(load_recipe("gptq-int4-rotated"), find("t4"), experts=False)
    assert not ok and "Hadacore" in note and "sm_75" in note
    assert P.gpu_support(load_recipe("gptq-int4-rotated"), find("l4"), experts=False)[0]
    assert P.gpu_support(load_recipe("gptq-int4-asym"), find("t4"), experts=False)[0]


# --- planning end to end --------------------------------------------------------------------
def _plan(**kw: object) -> P.Plan:
    defaults: dict[str, object] = dict(model="meta-llama/Llama-3.1-70B-Instruct",
                                       gpu=find("rtx5090"), runs_dir=Path("/nonexistent"))
    defaults.update(kw)
    return P.make_plan(P.PlanRequest(**defaults))  # type: ignore[arg-type]


def test_seed_question_llama70b_on_rtx5090s() -> None:
    one = _plan(gpus=1)
    assert one.recommendation is None  # nothing usable starts on one 32 GB card
    two = _plan(gpus=2)
    rec = two.recommendation
    assert rec is not None and two.recommendation_kind == "partial"
    # at equal fit (1 sequence each) the card's native FP4 W4A4 format comes first (issue 17)
    assert rec.scheme.split()[1] == "NVFP4" and rec.memory is not None
    assert 1 <= rec.memory.max_sequences < 16
    assert rec.serve is not None and "--tensor-parallel-size 2" in rec.serve
    by_name = {r.recipe: r for r in two.rows}
    assert by_name["none"].status == "no-fit" and by_name["fp8-dynamic"].status == "no-fit"
    assert all(r.min_tp is None or r.min_tp > 2 for r in two.rows)
    assert any("--kv-cache-dtype fp8" in h for h in two.hints)


def test_more_context_means_proportionally_fewer_sequences() -> None:
    short = _plan(model="meta-llama/Llama-3.1-8B-Instruct", gpu=find("h100"), context=8192,
                  recipes=["fp8-dynamic"])
    long = _plan(model="meta-llama/Llama-3.1-8B-Instruct", gpu=find("h100"), context=32768,
                 recipes=["fp8-dynamic"])
    a, b = short.rows[1].memory, long.rows[1].memory
    assert a is not None and b is not None
    assert a.request_bytes * 4 == b.request_bytes
    assert a.max_concurrency == pytest.approx(4 * b.max_concurrency, rel=0.01)


def _copy_run(src: Path, dst: Path, recipe: str, gate: dict | None) -> Path:  # type: ignore[type-arg]
    dst.mkdir(parents=True)
    manifest = json.loads((src / "manifest.json").read_text())
    manifest["recipe"]["name"] = recipe
    (dst / "manifest.json").write_text(json.dumps(manifest))
    shutil.copytree(src / "export", dst / "export", ignore=shutil.ignore_patterns("*.safetensors"))
    (dst / "export" / "model.safetensors").write_bytes(b"\0" * 12345)
    if gate is not None:
        (dst / "gate").mkdir()
        (dst / "gate" / "gate.json").write_text(json.dumps(gate))
    return dst


@pytest.fixture
def fake_runs(tmp_path: Path) -> Path:
    """Run folders shaped like the pipeline's, for the default model, without weights."""
    src = tmp_path / "src"
    (src / "export").mkdir(parents=True)
    cfg = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
           "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30,
           "vocab_size": 49152, "head_dim": 64, "tie_word_embeddings": True,
           "max_position_embeddings": 8192, "torch_dtype": "float16",
           "quantization_config": {"quant_method": "compressed-tensors"}}
    (src / "export" / "config.json").write_text(json.dumps(cfg))
    (src / "manifest.json").write_text(json.dumps({
        "model": {"source": "default", "path": "/x/SmolLM2-135M-Instruct-fp16"},
        "recipe": {"name": "gptq-int4"}, "stages": {}}))
    runs = tmp_path / "runs"
    row = {"name": "wiki", "baseline": 10.0, "candidate": 10.5, "threshold": 0.9}
    _copy_run(src, runs / "m-gptq", "gptq-int4",
              {"verdict": "pass", "rows": [{**row, "recovery": 0.93, "verdict": "pass"}]})
    _copy_run(src, runs / "m-fp8", "fp8-dynamic",
              {"verdict": "fail", "rows": [{**row, "recovery": 0.5, "verdict": "fail"}]})
    _copy_run(src, runs / "m-awq", "awq-int4", {"rows": "garbage"})
    return runs


def test_run_folder_uses_exported_size_and_measured_recovery(fake_runs: Path) -> None:
    plan = _plan(model=str(fake_runs / "m-gptq"), gpu=find("rtx4090"), context=4096,
                 concurrency=4, runs_dir=fake_runs)
    rows = {r.recipe: r for r in plan.rows}
    assert rows["gptq-int4"].weights_total == 12345
    assert rows["gptq-int4"].accuracy == 0.93
    assert rows["gptq-int4"].accuracy_source.startswith("measured")
    assert rows["fp8-dynamic"].gate_verdict == "fail"
    assert rows["awq-int4"].accuracy_source == "prior"  # malformed gate.json is ignored
    assert any("no pass/fail verdict" in n for n in plan.notes)
    assert plan.recommendation is not None
    assert plan.recommendation.recipe not in ("fp8-dynamic", "rtn-int2")


def test_model_folder_needs_only_config_json(tmp_path: Path) -> None:
    src = json.loads(next(P.CONFIGS.glob("Qwen--Qwen3-8B.json")).read_text())
    (tmp_path / "config.json").write_text(json.dumps(src))
    plan = _plan(model=str(tmp_path), gpu=find("l40s"), recipes=["gptq-int4"], context=8192)
    assert plan.source.origin.startswith("folder:") and plan.rows[1].memory is not None


def test_unknown_model_and_offline_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(PlanError) as info:
        P.load_source("not a model!")
    assert (info.value.problem or "").startswith("model 'not a model!' is not a folder")
    assert info.value.hint is not None and info.value.hint.startswith("built-in: ")

    def offline(*a: object, **k: object) -> str:
        raise OSError("We couldn't connect to the Hub")

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(PlanError) as info:
        P.load_source("org/unknown-model")
    assert info.value.problem == ("cannot get config.json of 'org/unknown-model' from the Hub "
                                  "(We couldn't connect to the Hub)")
    assert info.value.hint is not None and "a local folder with config.json" in info.value.hint


def test_bad_options_are_clear_errors() -> None:
    with pytest.raises(PlanError) as info:
        _plan(util=1.5)
    assert info.value.problem == "--gpu-memory-utilization 1.5 is outside (0.05, 1]"
    assert info.value.hint is not None and "e.g. 0.9" in info.value.hint
    with pytest.raises(PlanError) as info:
        _plan(profile="0.1")
    assert info.value.problem == "unknown vLLM profile '0.1'"
    assert info.value.hint is not None and info.value.hint.startswith("known: ")


def test_recipes_that_do_not_apply_are_marked(tmp_path: Path) -> None:
    odd = tmp_path / "odd-group.yaml"
    odd.write_text(yaml.safe_dump({"name": "odd-group", "description": "g48", "method": "rtn",
                                   "scheme": "W4A16", "group_size": 48, "ignore": ["lm_head"]}))
    plan = _plan(model="Qwen/Qwen3-8B", gpu=find("h100"), recipes=[str(odd)])
    row = plan.rows[1]
    assert row.status == "n/a" and "group_size 48 does not divide" in row.reason


# --- CLI ------------------------------------------------------------------------------------
def test_cli_text_and_json() -> None:
    runner = CliRunner()
    args = ["plan", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "l4", "--max-model-len", "8192",
            "--concurrency", "4", "--recipes", "gptq-int4,fp8-dynamic", "--runs", "/nonexistent"]
    text = runner.invoke(main, args)
    assert text.exit_code == 0, text.output
    assert "Recommendation:" in text.output and "vllm serve" in text.output
    assert "KV grows linearly" in text.output
    js = runner.invoke(main, [*args, "--json"])
    assert js.exit_code == 0, js.output
    data = json.loads(js.output)
    assert [r["recipe"] for r in data["rows"]] == ["none", "gptq-int4", "fp8-dynamic"]
    assert data["recommendation"]["memory"]["max_sequences"] >= 4
    assert data["rows"][1]["kv_bytes_per_token_by_dtype"]["fp8"] * 2 == \
        data["rows"][1]["kv_bytes_per_token_by_dtype"]["auto"]


def test_cli_unknown_gpu_exits_2() -> None:
    out = CliRunner().invoke(main, ["plan", "default", "--gpu", "tpu-v9"])
    assert out.exit_code == 2 and "unknown GPU 'tpu-v9'" in out.output


# --- weight sizes against real exports of the default model ---------------------------------
def _proxy(recipe: Recipe) -> dict:  # type: ignore[type-arg]
    """The same on-disk format without a slow method: size depends on scheme, group, targets,
    ignore and kv_cache, not on GPTQ/AWQ/SmoothQuant."""
    data = recipe.model_dump(mode="json", exclude={"gptq", "awq", "smoothquant", "eval"})
    data.update(name=f"proxy-{recipe.name}", method="rtn", backend="llmcompressor",
                calibration={"builtin": "wiki", "num_samples": 2, "seq_len": 64})
    return data


@pytest.mark.slow
@pytest.mark.parametrize("name", available("recipes"))
def test_weight_estimate_matches_real_export(name: str, tmp_path: Path) -> None:
    recipe = load_recipe(name)
    yml = tmp_path / f"proxy-{name}.yaml"
    yml.write_text(yaml.safe_dump(_proxy(recipe)))
    out = tmp_path / "run"
    exe = Path(sys.executable).with_name("quantize")  # the venv's console script
    proc = subprocess.run([str(exe), "export", str(yml), "-o", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    real = sum(p.stat().st_size for p in (out / "export").glob("*.safetensors"))
    src = P.load_source("default")
    model = P.meta(src.config)
    proxy = load_recipe(str(yml))
    from quantize.model.layers import resolve_group_size, targeted_layers

    group = resolve_group_size(proxy, targeted_layers(model, proxy.targets, proxy.ignore))
    est = P.estimate_weights(model, 2, P.recipe_layers(model, proxy, group)).total
    assert est == pytest.approx(real, rel=0.02)


def test_a_gpu_file_with_a_string_for_a_boolean_is_refused(tmp_path: Path) -> None:
    """GPU files are as strictly typed as recipes: `fp8: "yes"` is no boolean."""
    from quantize.planner.gpus import catalog

    f = tmp_path / "gpus.yaml"
    f.write_text('gpus:\n  - name: my-card\n    memory_gib: 24\n    compute_capability: "8.9"\n'
                 '    fp8: "yes"\n')
    with pytest.raises(PlanError) as info:
        catalog(f)
    assert "fp8" in str(info.value) and "\n" not in str(info.value)
    f.write_text(f.read_text().replace('"yes"', "true"))
    assert catalog(f)["my-card"].fp8 is True
