"""The Blackwell formats (issue 17): the support table against known facts of vLLM 0.32,
recipe validation, pre-flight's shape and --gpu rules, and the planner's sizes and rows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from quantize.checks import preflight
from quantize.checks.formats import GpuTarget
from quantize.errors import PreflightError, RecipeError
from quantize.model.config import ModelConfig
from quantize.planner import plan as P
from quantize.planner.gpus import find
from quantize.planner.weights import format_for, linear_bytes
from quantize.recipe.recipe import load_recipe
from quantize.recipe.schemes import KERNELS, gpu_support_level, native_schemes
from quantize.report.card.naming import scheme_tag

NEW = {"nvfp4": "NVFP4", "nvfp4a16": "NVFP4A16", "mxfp4": "MXFP4", "mxfp4a16": "MXFP4A16",
       "fp8-block": "FP8_BLOCK"}
SMOL = ModelConfig.model_validate({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 2, "num_attention_heads": 9,
    "num_key_value_heads": 3, "vocab_size": 1000, "tie_word_embeddings": True,
    "torch_dtype": "float16"})


def _cc(name: str) -> int:
    major, minor = find(name).capability
    return major * 10 + minor


# --- the support table ----------------------------------------------------------------------
@pytest.mark.parametrize(("family", "gpu", "level"), [
    ("nvfp4", "rtx5090", "native"), ("nvfp4", "b200", "native"),  # FP4 tensor cores
    ("nvfp4", "h100", "fallback"), ("nvfp4", "a100-80gb", "fallback"),  # FP4 Marlin
    ("nvfp4", "t4", "fallback"),  # Marlin FP4 from 7.5
    ("nvfp4-weight-only", "t4", "native"), ("nvfp4-weight-only", "rtx5090", "native"),
    ("mxfp4", "b200", "native"), ("mxfp4", "l40s", "fallback"),
    ("mxfp4-weight-only", "t4", "unsupported"),  # CompressedTensorsW4A4Mxfp4: min 8.0
    ("mxfp4-weight-only", "a10", "native"),
    ("fp8-block", "h200", "native"), ("fp8-block", "rtx4090", "native"),
    ("fp8-block", "a100-40gb", "fallback"), ("fp8-block", "rtx3090", "fallback"),
])
def test_support_table_known_facts(family: str, gpu: str, level: str) -> None:
    assert gpu_support_level(family, _cc(gpu)) == level


def test_catalog_carries_compute_capability() -> None:
    want = {"rtx5090": 120, "b200": 100, "h100": 90, "h200": 90, "l4": 89, "l40s": 89,
            "rtx4090": 89, "a100-80gb": 80, "a10": 86, "rtx3090": 86, "t4": 75}
    assert {name: _cc(name) for name in want} == want


def test_cpu_has_no_fp4_kernel_and_block_fp8_needs_amx() -> None:
    for family in ("nvfp4", "nvfp4-weight-only", "mxfp4", "mxfp4-weight-only"):
        assert KERNELS[family].cpu_none and "_POSSIBLE_" in (KERNELS[family].cpu_none or "")
    assert KERNELS["fp8-block"].cpu_amx and KERNELS["fp8-block"].cpu_none is None
    assert KERNELS["mxfp4"].moe_cpu and not KERNELS["nvfp4"].moe_cpu  # CPUExpertsMxfp4 only


def test_every_new_row_cites_files_of_the_installed_vllm() -> None:
    roots = sorted(Path(".venv-vllm").glob("lib/python*/site-packages/vllm/model_executor"))
    if not roots:
        pytest.skip("no .venv-vllm here (make vllm-env)")
    files = {p.name for p in roots[0].rglob("*.py")}
    for family in ("nvfp4", "nvfp4-weight-only", "mxfp4", "mxfp4-weight-only", "fp8-block"):
        rule = KERNELS[family]
        cited = re.findall(r"([\w/]+\.py)", " ".join((rule.gpu_source, rule.cpu_source,
                                                      rule.moe_source)))
        assert cited, family
        for path in cited:
            assert Path(path).name in files, f"{family}: {path} is not a vLLM 0.32 file"


def test_native_suggestions_on_hopper_have_no_fp4_activations() -> None:
    names = native_schemes(90)
    assert "FP8_DYNAMIC" in names and "FP8_BLOCK" in names and "NVFP4A16" in names
    assert "NVFP4" not in names and "MXFP4" not in names


# --- recipes ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(NEW))
def test_new_recipes_load_with_their_preset_and_tag(name: str) -> None:
    r = load_recipe(name)
    assert r.scheme == NEW[name] and r.method == "rtn" and r.ignore == ["lm_head"]
    assert r.needs_calibration == (name == "nvfp4")  # the NVFP4 global scale is calibrated
    assert scheme_tag(r.scheme, None) == {"nvfp4": "NVFP4", "nvfp4a16": "NVFP4A16",
                                          "mxfp4": "MXFP4", "mxfp4a16": "MXFP4A16",
                                          "fp8-block": "FP8-block"}[name]


def test_group_size_on_a_fixed_group_format_is_one_line_error(recipe_file) -> None:  # type: ignore[no-untyped-def]
    from quantize.recipe.recipe import load_recipe as load

    p = recipe_file("name: x\ndescription: d\nmethod: rtn\nscheme: NVFP4\ngroup_size: 32\n")
    with pytest.raises(RecipeError) as info:
        load(str(p))
    assert (info.value.path, info.value.line) == (str(p), 1)
    assert info.value.problem is not None and "fixes its own groups of 16" in info.value.problem
    assert info.value.hint is not None and "remove group_size" in info.value.hint


def test_engine_config_groups_are_compressed_tensors_presets() -> None:
    from compressed_tensors.quantization import preset_name_to_scheme

    from quantize.backends.llmcompressor import config_groups

    for name, scheme in NEW.items():
        got = config_groups(load_recipe(name), None)["group_0"]
        assert got == preset_name_to_scheme(scheme, ["Linear"])


# --- pre-flight -------------------------------------------------------------------------------
def test_block_fp8_refuses_fused_shards_vllm_rejects() -> None:
    with pytest.raises(PreflightError) as info:
        preflight.check(load_recipe("fp8-block"), SMOL)
    problem, hint = info.value.problem or "", info.value.hint or ""
    assert "q_proj: out_features 576" in problem and "fused q_proj/k_proj/v_proj" in problem
    assert "128-row FP8 block" in problem and hint.startswith("add q_proj/k_proj/v_proj to")


def test_block_fp8_refuses_inputs_its_activation_groups_cannot_split(recipe_file) -> None:  # type: ignore[no-untyped-def]
    """q/k/v kept dense, the default model's o_proj (576 wide) is next: compressed-tensors'
    dynamic groups of 128 fail on it at eval (seen on the H200), so pre-flight says so."""
    noqkv = load_recipe(str(recipe_file(
        "name: x\ndescription: d\nmethod: rtn\nscheme: FP8_BLOCK\n"
        "ignore: [lm_head, 're:.*q_proj$', 're:.*k_proj$', 're:.*v_proj$']\n")))
    with pytest.raises(PreflightError) as info:
        preflight.check(noqkv, SMOL)
    problem, hint = info.value.problem or "", info.value.hint or ""
    assert re.match(r"model\.layers\.\d+\.self_attn\.o_proj: in_features 576 is not a multiple "
                    r"of 128: block FP8 quantizes activations", problem)
    assert hint == "add o_proj to `ignore`, or use fp8-dynamic (per channel)"


def test_block_fp8_checks_tensor_parallel_shards(recipe_file) -> None:  # type: ignore[no-untyped-def]
    cfg = SMOL.updated(hidden_size=1024, intermediate_size=1152, num_attention_heads=8,
                       num_key_value_heads=8)
    preflight.check(load_recipe("fp8-block"), cfg)  # 1152 = 9 x 128 at tp 1
    with pytest.raises(PreflightError) as info:
        preflight.check(load_recipe("fp8-block"), cfg, tp=2)
    assert "gate_proj: out_features 1152 (576 per rank at --tp 2) is not a multiple of the " \
        "128-row" in (info.value.problem or "")
    down_only = load_recipe(str(recipe_file(
        "name: x\ndescription: d\nmethod: rtn\nscheme: FP8_BLOCK\ntargets: ['re:.*down_proj$']\n")))
    with pytest.raises(PreflightError) as info:
        preflight.check(down_only, cfg, tp=2)
    problem = info.value.problem or ""
    assert problem.startswith("--tp 2: ")
    assert "down_proj has in_features 1152, 576 per rank, not a multiple of the 128" in problem
    assert (info.value.hint or "").startswith("use a tp with (1152 / tp) % 128 == 0")


def test_fp4_group_must_divide_every_input() -> None:
    cfg = SMOL.updated(intermediate_size=1544)  # 1544 = 16 x 96.5: down_proj's input
    with pytest.raises(PreflightError) as info:
        preflight.check(load_recipe("nvfp4"), cfg)
    problem = info.value.problem or ""
    assert "groups of 16, which do not divide" in problem
    assert problem.endswith("down_proj's input (1544)")
    assert (info.value.hint or "").startswith("add down_proj to `ignore`")
    preflight.check(load_recipe("nvfp4"), SMOL)  # 576 and 1536: whole groups


def test_gpu_flag_warns_for_a_fallback_and_refuses_no_kernel() -> None:
    facts = preflight.check(load_recipe("nvfp4"), SMOL, gpu=GpuTarget("a100-80gb", 80))
    note = next(w for w in facts.warnings if "NVFP4" in w)
    assert "not native on a100-80gb (sm_80" in note and "FP4 Marlin, weight-only" in note
    assert "W4A16" in note and facts.gpu == {"name": "a100-80gb", "compute_capability": 80}
    assert not preflight.check(load_recipe("nvfp4"), SMOL,
                               gpu=GpuTarget("rtx5090", 120)).warnings
    with pytest.raises(PreflightError) as info:
        preflight.check(load_recipe("mxfp4a16"), SMOL, gpu=GpuTarget("t4", 75))
    assert (info.value.problem or "").startswith("MXFP4A16 (")
    assert "no vLLM kernel on t4 (sm_75)" in (info.value.problem or "")
    assert (info.value.hint or "").startswith("formats native on t4:")
    assert "NVFP4A16" in (info.value.hint or "")


# --- planner ----------------------------------------------------------------------------------
def test_fp4_and_block_sizes_count_every_scale() -> None:
    nv = format_for("NVFP4", None)
    # 4096 x 4096: codes (2 per byte) + one FP8 scale per 16 + weight and input global scales
    assert linear_bytes(4096, 4096, nv, 2) == 4096 * 2048 + 4096 * 256 + 2 * 2
    assert linear_bytes(4096, 4096, format_for("NVFP4A16", None), 2) == \
        4096 * 2048 + 4096 * 256 + 2
    assert linear_bytes(4096, 4096, format_for("MXFP4A16", None), 2) == \
        4096 * 2048 + 4096 * 128  # one E8M0 byte per 32, no global scale
    blk = format_for("FP8_BLOCK", None)
    assert linear_bytes(1000, 300, blk, 4) == 1000 * 300 + 8 * 3 * 4  # partial blocks count


def test_seed_question_rows_and_native_preference() -> None:
    base = dict(model="meta-llama/Llama-3.1-70B-Instruct", runs_dir=Path("/nonexistent"),
                recipes=["gptq-int4,nvfp4,nvfp4a16,mxfp4a16,fp8-block"])
    two = P.make_plan(P.PlanRequest(gpu=find("rtx5090"), gpus=2, **base))  # type: ignore[arg-type]
    rows = {r.recipe: r for r in two.rows}
    assert rows["nvfp4"].support == "native" and rows["nvfp4"].native_compute
    assert not rows["gptq-int4"].native_compute
    # group-16 FP8 scales: 0.5 bit per weight vs 0.25 for INT4's fp16 scale per 64
    assert rows["nvfp4"].weights_total > rows["gptq-int4"].weights_total
    assert rows["fp8-block"].status == "no-fit"
    assert two.recommendation is not None and two.recommendation.recipe == "nvfp4"
    hopper = P.make_plan(P.PlanRequest(gpu=find("h100"), gpus=2, **base))  # type: ignore[arg-type]
    rows = {r.recipe: r for r in hopper.rows}
    assert rows["nvfp4"].support == "fallback" and "FP4 Marlin" in rows["nvfp4"].gpu_note
    assert hopper.recommendation is not None and hopper.recommendation.recipe != "nvfp4"


# --- verify's support check -------------------------------------------------------------------
def _ct_config(scheme: str) -> ModelConfig:
    """config.json's quantization_config as compressed-tensors writes it for the preset."""
    from compressed_tensors.quantization import preset_name_to_scheme

    s = preset_name_to_scheme(scheme, ["Linear"])
    group = {"targets": ["Linear"], "weights": s.weights.model_dump(mode="json"),
             "input_activations": s.input_activations.model_dump(mode="json")
             if s.input_activations else None}
    return ModelConfig(quantization_config={"quant_method": "compressed-tensors",
                                            "config_groups": {"group_0": group},
                                            "ignore": ["lm_head"]})


@pytest.mark.parametrize(("scheme", "family"), [
    ("NVFP4", "nvfp4"), ("NVFP4A16", "nvfp4-weight-only"), ("MXFP4", "mxfp4"),
    ("MXFP4A16", "mxfp4-weight-only"), ("FP8_BLOCK", "fp8-block")])
def test_checkpoints_read_back_as_their_scheme_and_kernel(scheme: str, family: str) -> None:
    from quantize.model.qconfig import read_quant_config

    qc = read_quant_config(_ct_config(scheme))
    assert qc is not None
    group = qc.groups[0]
    assert group.kernel == family and group.scheme is not None and group.scheme.name == scheme


def test_cpu_verify_falls_back_for_fp4_and_block_fp8_without_amx() -> None:
    from quantize.vllm import host as H
    from quantize.vllm import support as caps

    avx512 = H.Host("py", "0.32.0", "cpu", {"avx2": True, "avx512": True, "amx_tile": False},
                    dict.fromkeys(("cpu_gemm_wna16", "onednn_scaled_mm"), True))
    amx = H.Host("py", "0.32.0", "cpu", {"avx512": True, "amx_tile": True}, {})
    for scheme in ("NVFP4", "NVFP4A16", "MXFP4", "MXFP4A16"):
        s = caps.supported(caps.checkpoint_format(_ct_config(scheme)), amx)
        assert not s.ok and "no CPU kernel" in s.reason and "_POSSIBLE_" in s.reason
    block = caps.checkpoint_format(_ct_config("FP8_BLOCK"))
    assert "block FP8 needs AMX or a GPU" in caps.supported(block, avx512).reason
    assert caps.supported(block, amx).ok
    blackwell = H.Host("py", "0.32.0", "cuda", gpus=[120])
    assert caps.supported(caps.checkpoint_format(_ct_config("NVFP4")), blackwell).ok
    turing = H.Host("py", "0.32.0", "cuda", gpus=[75])
    assert "compute capability >= 8.0" in caps.supported(
        caps.checkpoint_format(_ct_config("MXFP4A16")), turing).reason
