"""verify on mixture-of-experts exports: the MoE kernel rules (quantize.recipe.schemes KERNELS'
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
from quantize.recipe.recipe import load_recipe
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
def moe_exports(tmp_path_factory: pytest.TempPathFactory,
                default_tokenizer: Path) -> dict[str, Path]:
    """A tiny random Qwen3-MoE (fused experts) and data-free llm-compressor exports of it, every
    expert unfused: W4A16 symmetric and asymmetric (zero points), group 64; NVFP4A16; and two
    with dynamic per-token activations, FP8_DYNAMIC and W8A8 (INT8)."""
    import torch

    root = tmp_path_factory.mktemp("moe")
    dense = build_moe("qwen3_moe", root / "dense", default_tokenizer, dtype="float32")
    variants = {name: {"config_groups": {"g": {"targets": ["Linear"],
                                               "weights": {**W4, "symmetric": sym}}},
                       "ignore": ["lm_head", "re:.*mlp\\.gate$"]}
                for name, sym in (("w4", True), ("w4asym", False))}
    for name, scheme in (("nvfp4", "NVFP4A16"), ("fp8dyn", "FP8_DYNAMIC"), ("w8a8", "W8A8")):
        variants[name] = {"scheme": scheme, "targets": ["Linear"],
                          "ignore": ["lm_head", "re:.*mlp\\.gate$"]}
    return {"dense": dense, **oneshot_exports(dense, root, variants, dtype=torch.float32)}


@pytest.mark.parametrize("name", ["w4", "w4asym"])
def test_host_limit_runs_the_exact_decode_and_passes(moe_exports: dict[str, Path], name: str,
                                                     tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(H, "detect", lambda *a, **k: H.Host(sys.executable, "0.32.0", "cpu",
                                                             NO_AMX.isa, OPS))
    s = V.verify(moe_exports[name], out=tmp_path / "v")
    assert s.level == "decode", s
    assert s.why_not_vllm.startswith("not verifiable in vLLM on this host (")
    assert "oracle/int_wna16.py" in s.why_not_vllm and s.host_limit
    assert s.verdict == "pass", s.error
    m = s.metrics
    assert m.worst_weight_rel_diff <= 2e-3 and m.max_abs_dlogprob <= 5e-2
    # every expert projection was decoded and compared with the source's fused tensors
    assert m.layers_decoded == 2 * (4 + 3 * 8)
    assert m.source_cosine_min is not None and m.source_cosine_min >= 0.9


def test_fp4_moe_export_passes_the_exact_decode(moe_exports: dict[str, Path],
                                                tmp_path: Path) -> None:
    """NVFP4 (weight-only) experts decompress into bf16 weights; the decode check's fp32 model
    takes them (it stopped with "self and mat2 must have the same dtype" before)."""
    s = V.verify(moe_exports["nvfp4"], out=tmp_path / "v", level="decode")
    assert (s.level, s.verdict) == ("decode", "pass"), s.error
    m = s.metrics
    assert m.worst_weight_rel_diff <= 2e-3 and m.max_abs_dlogprob <= 5e-2
    assert m.source_cosine_min is not None and m.source_cosine_min >= 0.9


@pytest.fixture(scope="module")
def mixtral_export(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Path) -> Path:
    """A tiny random Mixtral, saved as Mixtral checkpoints are (`block_sparse_moe.experts.<i>.
    w1/w2/w3`), and a data-free W4A16 export of it (stored as `block_sparse_moe.experts.<i>.
    gate_proj/up_proj/down_proj`, which vLLM maps to its w1/w3/w2)."""
    import torch

    root = tmp_path_factory.mktemp("mixtral")
    dense = build_moe("mixtral", root / "dense", default_tokenizer, dtype="float32")
    variants = {"w4": {"config_groups": {"g": {"targets": ["Linear"], "weights": W4}},
                       "ignore": ["lm_head", "re:.*mlp\\.gate$"]}}
    return oneshot_exports(dense, root, variants, dtype=torch.float32)["w4"]


def _stored_names(ckpt: Path) -> set[str]:
    from safetensors import safe_open

    (f,) = ckpt.glob("*.safetensors")
    with safe_open(str(f), "pt") as fh:
        return set(fh.keys())


def test_mixtral_export_passes_the_exact_decode(mixtral_export: Path, tmp_path: Path) -> None:
    """transformers 5.17 names Mixtral's MoE block `mlp` in memory and `block_sparse_moe` in
    checkpoints (conversion_mapping.py "mixtral"); the decode check read the stored names as
    the model's and stopped with "no stored tensor for ['model.layers.0.mlp.gate.weight', ...]"."""
    names = _stored_names(mixtral_export)
    assert "model.layers.0.block_sparse_moe.experts.0.gate_proj.weight_packed" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    s = V.verify(mixtral_export, out=tmp_path / "v", level="decode")
    assert (s.level, s.verdict) == ("decode", "pass"), s.error
    m = s.metrics
    assert m.layers_decoded == 2 * (4 + 3 * 8)
    assert m.worst_weight_rel_diff == 0.0 and m.max_abs_dlogprob == 0.0
    assert m.source_cosine_min is not None and m.source_cosine_min >= 0.9


def test_mixtral_experts_are_compared_with_the_sources_w1_w2_w3(mixtral_export: Path,
                                                               tmp_path: Path) -> None:
    """One expert's rows out of order: both decoders agree on the wrong weights; the source's
    `block_sparse_moe.experts.3.w2` does not."""
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(mixtral_export, bad)
    (f,) = bad.glob("*.safetensors")
    tensors = load_file(str(f))
    key = "model.layers.1.block_sparse_moe.experts.3.down_proj.weight_packed"
    tensors[key] = tensors[key].flip(0).contiguous()
    save_file(tensors, str(f), metadata={"format": "pt"})
    s = V.verify(bad, out=tmp_path / "v", level="decode")
    assert s.verdict == "fail", s.metrics
    assert s.error.startswith("decode check failed: layer model.layers.1.mlp.experts.3."
                                 "down_proj: decoded weights have cosine"), s.error


@pytest.mark.parametrize("name", ["fp8dyn", "w8a8"])
def test_activation_quantized_moe_export_passes_the_exact_decode(
        moe_exports: dict[str, Path], name: str, tmp_path: Path) -> None:
    """Dynamic per-token activations: compressed-tensors' TOKEN strategy gave one scale to all
    the [tokens, hidden] rows an expert gets (0.12 nats mean, 0.67 max before); vLLM and our
    decode quantize each token on its own."""
    s = V.verify(moe_exports[name], out=tmp_path / "v", level="decode")
    assert (s.level, s.verdict) == ("decode", "pass"), s.error
    m = s.metrics
    assert m.worst_weight_rel_diff == 0.0 and m.max_abs_dlogprob == 0.0
    assert m.source_cosine_min is not None and m.source_cosine_min >= 0.98


def test_the_decode_check_sees_a_shared_activation_scale_on_the_experts(
        moe_exports: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the per-token fix on the loader's side, the two decodes differ in the experts'
    activation quantization alone, and the check says so."""
    from quantize.model import moe_load

    monkeypatch.setattr(moe_load, "per_token_inputs", lambda model: 0)
    s = V.verify(moe_exports["fp8dyn"], out=tmp_path / "v", level="decode")
    assert s.verdict == "fail" and "logits differ" in s.error, s.error
    assert s.metrics.worst_weight_rel_diff == 0.0


def _with_kv_scales(ckpt: Path, out: Path) -> Path:
    """`ckpt` with an FP8 KV-cache scheme: static per-tensor k_scale / v_scale on every
    attention layer, as llm-compressor's kv_cache_scheme calibration stores them."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(ckpt, out)
    (f,) = out.glob("*.safetensors")
    tensors = load_file(str(f))
    for k in [k for k in tensors if k.endswith(".self_attn.q_proj.weight")]:
        attn = k[: -len(".q_proj.weight")]
        tensors[attn + ".k_scale"] = torch.tensor([0.008])
        tensors[attn + ".v_scale"] = torch.tensor([0.005])
    save_file(tensors, str(f), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"] = {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
        "symmetric": True}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_fp8_kv_cache_moe_export_passes_the_exact_decode(
        moe_exports: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """compressed-tensors quantizes the keys and values on their way into the cache
    (modeling/kvcache.py); our decode does too, with the same scales. Without it on our side
    the check fails."""
    from quantize.model import kv_quant

    ckpt = _with_kv_scales(moe_exports["fp8dyn"], tmp_path / "kv")
    s = V.verify(ckpt, out=tmp_path / "v", level="decode")
    assert (s.level, s.verdict) == ("decode", "pass"), s.error
    assert s.metrics.max_abs_dlogprob == 0.0
    monkeypatch.setattr(kv_quant, "quantize_kv_cache", lambda *a: 0)
    s = V.verify(ckpt, out=tmp_path / "v2", level="decode")
    assert s.verdict == "fail" and "logits differ" in s.error, s.error


def test_native_gptq_moe_export_is_refused_by_the_decode_check_in_one_line(
        tmp_path: Path) -> None:
    """transformers 5.17 loads a native GPTQ/AWQ MoE checkpoint with its fused experts left at
    random init, silently; the decode check says it cannot check one, before loading."""
    from quantize.errors import VerifyError
    from quantize.stages.verify.decode_check import DecodeTolerance, verify_decode

    cfg = CONFIGS["qwen3_moe"](_Tok()).to_dict()
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 64,
                                  "sym": True, "desc_act": False, "checkpoint_format": "gptq"}
    with pytest.raises(VerifyError) as err:
        verify_decode(tmp_path, ModelConfig.model_validate(cfg), DecodeTolerance())
    assert err.value.path == str(tmp_path)
    assert err.value.problem is not None and err.value.problem.startswith(
        "the exact decode has no loader for native GPTQ mixture-of-experts checkpoints: ")
    assert "random init" in err.value.problem
    assert err.value.hint is not None and err.value.hint.startswith("verify it in vLLM on a GPU")
    assert "compressed-tensors recipe" in err.value.hint and "\n" not in str(err.value)
