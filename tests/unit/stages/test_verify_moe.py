"""verify on mixture-of-experts exports: the MoE kernel rules (quantize.spec.schemes KERNELS'
MoE fields, read from vLLM 0.32's fused_moe sources) and the host-limit path: when this
host's vLLM has no fused-MoE kernel for the export, verify says so, runs the exact decode
and passes on a sound export."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from fixtures.moe import CONFIGS, build_moe
from fixtures.verify_setup import oneshot_exports

from quantize.checks.preflight import moe_kernel_warning
from quantize.model.config import ModelConfig
from quantize.spec.recipe import load_recipe
from quantize.stages import verify as V
from quantize.vllm import host as H
from quantize.vllm.moe_support import moe_problem
from quantize.vllm.support import checkpoint_format

OPS = dict.fromkeys(("cpu_gemm_wna16", "onednn_scaled_mm", "static_scaled_fp8_quant"), True)
NO_AMX = H.Host("py", "0.32.0", "cpu", {"avx2": True, "avx512": True, "amx_tile": False}, OPS)
AMX = H.Host("py", "0.32.0", "cpu", {"avx512": True, "amx_tile": True}, OPS)
GPU = H.Host("py", "0.32.0", "cuda", gpus=[90])

W4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64, "symmetric": True}
W4ASYM = {**W4, "symmetric": False}
W8CH = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}
A8 = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
F8CH = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
F8TOK = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
F8BLOCK = {**F8CH, "strategy": "block", "block_structure": [128, 128]}
F8BTOK = {**F8TOK, "strategy": "group", "group_size": 128}


class _Tok:
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 2

    def __len__(self) -> int:
        return 512


def moe_config(arch: str, weights: dict[str, Any], acts: dict[str, Any] | None = None
               ) -> ModelConfig:
    cfg = CONFIGS[arch](_Tok()).to_dict()
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": weights, "input_activations": acts}}}
    return ModelConfig.model_validate(cfg)


def problem(arch: str, host: H.Host, weights: dict[str, Any],
            acts: dict[str, Any] | None = None) -> str | None:
    cfg = moe_config(arch, weights, acts)
    return moe_problem(checkpoint_format(cfg), cfg, host)


@pytest.mark.parametrize(("arch", "host", "w", "a", "says"), [
    # this host's kind: AVX-512 without AMX has no quantized fused-MoE kernel at all
    ("qwen3_moe", NO_AMX, W4, None, "need AMX or the zentorch_fused_moe op"),
    ("qwen3_moe", NO_AMX, W4, None, "oracle/int_wna16.py"),
    ("qwen3_moe", NO_AMX, W8CH, A8, "oracle/int8.py"),
    # with AMX: symmetric 4-bit only, block FP8 only, softmax top-k and SiLU only
    ("qwen3_moe", AMX, W4ASYM, None, "zero points"),
    ("mixtral", AMX, F8CH, F8TOK, "block-scaled"),
    ("mixtral", AMX, F8CH, F8TOK, "oracle/fp8.py"),
    ("deepseek_v3", AMX, W4, None, "not grouped-topk"),
    ("gpt_oss", AMX, W4, None, "SiLU experts only"),
])
def test_moe_cpu_limits_say_why_and_cite_vllm(arch: str, host: H.Host, w: dict[str, Any],
                                              a: dict[str, Any] | None, says: str) -> None:
    why = problem(arch, host, w, a)
    assert why is not None and says in why


@pytest.mark.parametrize(("arch", "host", "w", "a"), [
    ("qwen3_moe", AMX, W4, None),  # CPUExpertsInt4
    ("mixtral", AMX, W8CH, A8),  # CPUExpertsInt8
    ("qwen3_moe", AMX, F8BLOCK, F8BTOK),  # CPUExpertsFp8
    ("qwen3_moe", GPU, W4ASYM, None),  # Marlin/Triton on a GPU
    ("deepseek_v3", GPU, F8CH, F8TOK),
])
def test_moe_kernels_that_exist(arch: str, host: H.Host, w: dict[str, Any],
                                a: dict[str, Any] | None) -> None:
    assert problem(arch, host, w, a) is None


def test_dense_models_have_no_moe_limit() -> None:
    cfg = ModelConfig.model_validate({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_hidden_layers": 1, "vocab_size": 64,
        "quantization_config": moe_config("qwen3_moe", W4).quantization_config})
    assert moe_problem(checkpoint_format(cfg), cfg, NO_AMX) is None


def test_preflight_warns_before_calibration_when_the_target_has_no_moe_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    cfg = CONFIGS["qwen3_moe"](_Tok())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    config = ModelConfig.model_validate(cfg.to_dict())
    monkeypatch.setattr(H, "cpu_flags", lambda: ["avx512f"])  # no AMX
    note = moe_kernel_warning(load_recipe("gptq-int4"), config, model, gpu=False)
    assert note is not None and "no kernel for the MoE experts of W4A16" in note
    assert "exact decode" in note
    assert moe_kernel_warning(load_recipe("gptq-int4"), config, model, gpu=True) is None
    monkeypatch.setattr(H, "cpu_flags", lambda: ["avx512f", "amx_tile"])
    assert moe_kernel_warning(load_recipe("gptq-int4"), config, model, gpu=False) is None
    note = moe_kernel_warning(load_recipe("awq-int4"), config, model, gpu=False)
    assert note is not None and "zero points" in note


@pytest.fixture(scope="module")
def moe_exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random Qwen3-MoE (fused experts) and two data-free llm-compressor exports of it:
    W4A16 symmetric and asymmetric (zero points), group 64, every expert unfused."""
    import torch

    from quantize.model.source import default_model_dir

    root = tmp_path_factory.mktemp("moe")
    dense = build_moe("qwen3_moe", root / "dense", default_model_dir(), dtype="float32")
    variants = {name: {"config_groups": {"g": {"targets": ["Linear"],
                                               "weights": {**W4, "symmetric": sym}}},
                       "ignore": ["lm_head", "re:.*mlp\\.gate$"]}
                for name, sym in (("w4", True), ("w4asym", False))}
    return {"dense": dense, **oneshot_exports(dense, root, variants, dtype=torch.float32)}


@pytest.mark.parametrize("name", ["w4", "w4asym"])
def test_host_limit_runs_the_exact_decode_and_passes(moe_exports: dict[str, Path], name: str,
                                                     tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(H, "detect", lambda *a, **k: H.Host(sys.executable, "0.32.0", "cpu",
                                                             NO_AMX.isa, OPS))
    s = V.verify(moe_exports[name], out=tmp_path / "v")
    assert s["level"] == "decode", s
    assert s["why_not_vllm"].startswith("not verifiable in vLLM on this host (")
    assert "oracle/int_wna16.py" in s["why_not_vllm"] and s["host_limit"]
    assert s["verdict"] == "pass", s.get("error")
    m = s["metrics"]
    assert m["worst_weight_rel_diff"] <= 2e-3 and m["max_abs_dlogprob"] <= 5e-2
    # every expert projection was decoded and compared with the source's fused tensors
    assert m["layers_decoded"] == 2 * (4 + 3 * 8)
    assert m["source_cosine_min"] is not None and m["source_cosine_min"] >= 0.9
