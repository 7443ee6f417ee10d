"""verify without vLLM: format classification, the capability rules, the comparison, our own
decoder against compressed-tensors' packer, the worker protocol (timeouts, crashes, error
lines), and both levels end to end on a tiny model (the vLLM level through a stand-in worker
that decodes with transformers, so the plumbing is tested wherever vLLM is absent)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from fixtures.verify_setup import oneshot_exports

from quantize.errors import ModelError, VerifyError
from quantize.model import decode as D
from quantize.model.config import ModelConfig
from quantize.model.qconfig import Args
from quantize.stages import verify as V
from quantize.stages.verify import target as T
from quantize.stages.verify import vllm_run as VR
from quantize.vllm import host as H
from quantize.vllm import support as caps

# --- formats and rules ------------------------------------------------------------------


def checkpoint_format(cfg: dict[str, Any]) -> caps.CheckpointFormat:
    return caps.checkpoint_format(ModelConfig.model_validate(cfg))


def qconfig(weights: dict[str, Any], acts: dict[str, Any] | None = None,
            kv: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"head_dim": 64, "quantization_config": {
        "quant_method": "compressed-tensors", "kv_cache_scheme": kv,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": acts}}}}


W4G64 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64, "symmetric": True}
W4ASYM = {**W4G64, "symmetric": False}
W2G64 = {**W4G64, "num_bits": 2}
W8CH = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}
A8TOK = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
F8CH = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
F8TOK = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
F8STATIC = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
F8BLOCK = {**F8CH, "strategy": "block", "block_structure": [128, 128]}
KV = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}

OPS_ALL = dict.fromkeys(("cpu_gemm_wna16", "onednn_scaled_mm", "static_scaled_fp8_quant"), True)
AVX2 = H.Host("py", "0.32.0", "cpu", {"avx2": True, "avx512": False, "amx_tile": False},
                 {**OPS_ALL, "cpu_gemm_wna16": False, "static_scaled_fp8_quant": False})
AVX512 = H.Host("py", "0.32.0", "cpu", {"avx2": True, "avx512": True, "amx_tile": False},
                   OPS_ALL)
AMX = H.Host("py", "0.32.0", "cpu", {"avx512": True, "amx_tile": True}, OPS_ALL)


def gpu(cap: int) -> H.Host:
    return H.Host("py", "0.32.0", "cuda", gpus=[cap])


def test_formats_are_classified() -> None:
    cases = {
        "INT4 weight-only (group 64)": qconfig(W4G64),
        "INT4 asymmetric weight-only (group 64)": qconfig(W4ASYM),
        "INT8 channel weights, dynamic INT8 activations": qconfig(W8CH, A8TOK),
        "FP8 channel weights, dynamic FP8 activations": qconfig(F8CH, F8TOK),
        "FP8 channel weights, dynamic FP8 activations + fp8 KV cache": qconfig(F8CH, F8TOK, KV),
        "FP8 channel weights, static FP8 activations": qconfig(F8CH, F8STATIC),
        "dense": {},
    }
    for label, cfg in cases.items():
        assert checkpoint_format(cfg).label == label


def test_other_quant_methods_are_refused() -> None:
    # native gptq/awq (backend gptqmodel/autoawq) are handled:
    # tests/unit/backends/test_backend_engines.py
    with pytest.raises(ModelError) as err:
        checkpoint_format({"quantization_config": {"quant_method": "bitsandbytes"}})
    assert err.value.problem == "quantization_config.quant_method is 'bitsandbytes'"
    assert err.value.hint is not None and "compressed-tensors" in err.value.hint


@pytest.mark.parametrize(("host", "cfg", "reason"), [
    (AVX2, qconfig(W4G64), r"needs AVX-512 or a GPU \(the CPU build lacks cpu_gemm_wna16\)"),
    (AVX2, qconfig(F8CH, F8STATIC), r"static FP8 activations needs AVX-512 or a GPU"),
    (AVX2, qconfig(F8CH, F8TOK, KV), r"FP8 KV cache needs AVX-512 or AMX or a GPU"),
    (AVX512, qconfig(W2G64), r"4-bit integer weights only \(this is 2-bit\)"),
    (AVX512, qconfig({**W8CH, "strategy": "group", "group_size": 64}), r"this is 8-bit"),
    (AVX512, qconfig(F8BLOCK, F8TOK), r"block FP8 needs AMX or a GPU"),
    (AVX512, qconfig(F8CH), r"FP8 weight-only needs AMX"),
    (gpu(70), qconfig(W4G64), r"compute capability >= 7.5 \(GPU is sm_70\)"),
    (gpu(75), qconfig(F8CH, F8TOK), r"FP8 needs compute capability >= 8.0"),
    (gpu(90), qconfig(W2G64), r"2-bit integer weights have no vLLM CUDA kernel"),
])
def test_unsupported_formats_say_why(host: H.Host, cfg: dict[str, Any], reason: str) -> None:
    s = caps.supported(checkpoint_format(cfg), host)
    assert not s.ok
    assert s.reason.startswith("not verifiable on this host: ")
    assert re.search(reason, s.reason), s.reason


@pytest.mark.parametrize(("host", "cfg"), [
    (AVX2, qconfig(W8CH, A8TOK)), (AVX2, qconfig(F8CH, F8TOK)), (AVX2, {}),
    (AVX512, qconfig(W4G64)), (AVX512, qconfig(W4ASYM)), (AVX512, qconfig(F8CH, F8TOK, KV)),
    (AVX512, qconfig(F8CH, F8STATIC)), (AMX, qconfig(F8BLOCK, F8TOK)),
    (gpu(80), qconfig(W4G64)), (gpu(89), qconfig(F8CH, F8TOK, KV)),
])
def test_supported_formats(host: H.Host, cfg: dict[str, Any]) -> None:
    assert caps.supported(checkpoint_format(cfg), host).ok


def test_an_emulated_fp8_gemm_sends_fp8_w8a8_to_the_decode_check() -> None:
    """The probe's FP8 and bf16 times of one 128x512x512 product, measured on an AMX host whose
    torch 2.13 runs torch._scaled_mm emulated (vLLM's CPU FP8 W8A8 kernel): 637.1 / 0.187 ms."""
    import dataclasses

    slow = dataclasses.replace(AMX, fp8_gemm_ms={"fp8": 637.1, "bf16": 0.187})
    s = caps.supported(checkpoint_format(qconfig(F8CH, F8TOK)), slow)
    assert not s.ok and "emulated" in s.reason and "(3407x;" in s.reason, s.reason
    fast = dataclasses.replace(AMX, fp8_gemm_ms={"fp8": 0.5, "bf16": 0.187})
    assert caps.supported(checkpoint_format(qconfig(F8CH, F8TOK)), fast).ok
    assert caps.supported(checkpoint_format(qconfig(F8CH, F8TOK)), AMX).ok  # not measured
    for other in (qconfig(W8CH, A8TOK), qconfig(W4G64)):  # INT kernels are not affected
        assert caps.supported(checkpoint_format(other), slow).ok


def test_online_hadamard_needs_hadacore_which_the_cpu_build_lacks() -> None:
    cfg = qconfig(W4ASYM)
    cfg["quantization_config"]["transform_config"] = {"config_groups": {"v": {
        "type": "hadamard", "head_dim": 64,
        "apply": [{"location": "input", "targets": ["Linear"]},
                  {"location": "weight_input", "targets": ["Linear"], "inverse": True}]}}}
    fmt = checkpoint_format(cfg)
    s = caps.supported(fmt, AVX512)
    assert not s.ok and "Hadacore" in s.reason and "on a GPU" in s.reason
    with_op = H.Host("py", "0.32.0", "cpu", AVX512.isa, {**OPS_ALL, "hadacore_transform": True})
    assert caps.supported(fmt, with_op).ok
    assert caps.supported(fmt, gpu(90)).ok and caps.supported(fmt, gpu(80)).ok
    old = caps.supported(fmt, gpu(75))  # Hadacore is built for sm_80 and later
    assert not old.ok and "sm_75" in old.reason and "Hadacore" in old.reason, old.reason
    # rotations fused into the weights alone need nothing at run time
    cfg["quantization_config"]["transform_config"]["config_groups"]["v"]["apply"].pop(0)
    assert caps.supported(checkpoint_format(cfg), AVX512).ok


def test_kv_cache_override_makes_avx2_verifiable() -> None:
    fmt = checkpoint_format(qconfig(F8CH, F8TOK, KV))
    assert not caps.supported(fmt, AVX2, "auto").ok
    assert caps.supported(fmt, AVX2, "bfloat16").ok
    assert not caps.supported(checkpoint_format(qconfig(F8CH, F8TOK)), AVX2, "fp8").ok


@pytest.mark.parametrize(("cfg", "device", "flag"), [
    ({**qconfig(W8CH, A8TOK), "dtype": "float16"}, "cpu", "--dtype bfloat16"),
    ({**qconfig(W8CH, A8TOK), "torch_dtype": "float32"}, "cpu", "--dtype bfloat16"),
    ({**qconfig(F8CH, F8TOK), "dtype": "float16"}, "cpu", None),
    ({**qconfig(W8CH, A8TOK), "dtype": "bfloat16"}, "cpu", None),  # its own dtype runs
    ({**qconfig(W4G64), "dtype": "float16"}, "cpu", None),
    ({**qconfig(W8CH, A8TOK), "dtype": "float16"}, "cuda", None),
])
def test_serving_dtype_names_the_flag_only_where_the_own_dtype_cannot_run(
        cfg: dict[str, Any], device: str, flag: str | None) -> None:
    need = caps.serving_dtype(checkpoint_format(cfg), device)
    assert (need.flag if need else None) == flag
    if need and cfg.get("dtype") == "float16" and "INT8" in need.reason:
        assert need.reason == ("vLLM CPU runs INT8 W8A8 only at --dtype bfloat16; this export "
                               "declares float16")


def test_no_vllm_env_is_not_verifiable_and_says_how_to_fix() -> None:
    host = H.Host(None, problem="no vLLM environment: run `make vllm-env`, or pass "
                                   "--vllm-python")
    s = caps.supported(checkpoint_format({}), host)
    assert not s.ok and "make vllm-env" in s.reason


def test_find_vllm_python_rejects_a_missing_path(tmp_path: Path) -> None:
    with pytest.raises(VerifyError) as err:
        H.find_vllm_python(tmp_path / "nope" / "python")
    assert err.value.problem == f"--vllm-python {tmp_path / 'nope' / 'python'} does not exist"
    assert err.value.hint is not None and "`make vllm-env`" in err.value.hint


# --- comparing ------------------------------------------------------------------------------
def _rows(*tops: tuple[int, float]) -> Any:
    """Log-prob rows over a 10-token vocabulary with `tok` at `lp`, the rest spread."""
    import torch

    rows = torch.full((len(tops), 10), -8.0)
    for i, (tok, lp) in enumerate(tops):
        rows[i, tok] = lp
    return rows


def _vllm(*steps: tuple[int, float]) -> dict[str, Any]:
    return {"token_ids": [t for t, _ in steps],
            "steps": [{"token": t, "logprob": lp, "top": {}} for t, lp in steps]}


def test_compare_identical_passes() -> None:
    m = V.compare([_vllm((1, -0.1), (2, -0.2))], [_rows((1, -0.1), (2, -0.2))], V.Thresholds())
    assert m.agreement == 1.0 and m.mean_abs_dlogprob == 0 and not m.failures
    assert m.greedy_prefix_match == [2]


def test_compare_near_tie_disagreement_is_tolerated() -> None:
    rows = _rows((1, -0.5), (2, -0.1))
    rows[1, 3] = -0.05  # transformers prefers token 3 by 0.05 nats over vLLM's token 2
    m = V.compare([_vllm((1, -0.5), (2, -0.1))], [rows], V.Thresholds(min_agreement=0.5))
    assert m.agreement == 0.5 and m.greedy_prefix_match == [1] and not m.failures


def test_compare_real_disagreement_fails() -> None:
    rows = _rows((1, -0.1), (5, -0.01))  # vLLM's token 2 sits at -8 nats in transformers
    m = V.compare([_vllm((1, -0.1), (2, -0.1))], [rows], V.Thresholds(min_agreement=0.5))
    assert any("not near-ties" in f for f in m.failures)
    assert any("mean |Δlogprob|" in f for f in m.failures)


# --- our decoder against compressed-tensors' packer ----------------------------------------
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_unpack_matches_compressed_tensors_pack(bits: int) -> None:
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = torch.Generator().manual_seed(bits)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = torch.randint(lo, hi + 1, (6, 40), generator=g, dtype=torch.int8)
    assert torch.equal(D._unpack(pack_to_int32(q, bits, packed_dim=1), bits, 40, 1) + lo, q)
    assert torch.equal(D._unpack(pack_to_int32(q, bits, packed_dim=0), bits, 6, 0) + lo, q)


def test_decode_grouped_asymmetric_with_g_idx() -> None:
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (4, 8), generator=g, dtype=torch.int8)
    zp = torch.randint(-8, 8, (4, 2), generator=g, dtype=torch.int8)
    scale = torch.rand(4, 2, generator=g) + 0.1
    g_idx = torch.tensor([1, 0, 1, 0, 0, 1, 1, 0])
    t = {"weight_packed": pack_to_int32(q, 4), "weight_scale": scale,
         "weight_zero_point": pack_to_int32(zp, 4, packed_dim=0),
         "weight_shape": torch.tensor([4, 8]), "weight_g_idx": g_idx}
    w = D.decode_weight(t, Args(4, strategy="group", group_size=4))
    expect = (q.float() - zp.float()[:, g_idx]) * scale[:, g_idx]
    assert torch.allclose(w, expect)


def test_decode_channel_int8_and_fp8() -> None:
    import torch

    q = torch.tensor([[1, -2], [3, 127]], dtype=torch.int8)
    s = torch.tensor([[0.5], [2.0]])
    w = D.decode_weight({"weight": q, "weight_scale": s}, Args(8, strategy="channel"))
    assert torch.equal(w, torch.tensor([[0.5, -1.0], [6.0, 254.0]]))
    f = torch.tensor([[1.5, -448.0]]).to(torch.float8_e4m3fn)
    w = D.decode_weight({"weight": f, "weight_scale": torch.tensor([[0.25]])},
                        Args(8, "float", strategy="channel"))
    assert torch.equal(w, torch.tensor([[0.375, -112.0]]))


# --- the worker protocol ------------------------------------------------------------------
def test_worker_quotes_the_import_error_of_a_python_without_vllm(tmp_path: Path) -> None:
    res = H.run_worker(Path(sys.executable), {"op": "generate", "model": "x", "prompts": [],
                                                 "max_tokens": 1}, tmp_path, "w", 120)
    assert res["ok"] is False
    assert res["error"] == "ModuleNotFoundError: No module named 'vllm'"
    assert Path(res["log"]).is_file()


def test_worker_rejects_unknown_ops(tmp_path: Path) -> None:
    res = H.run_worker(Path(sys.executable), {"op": "dance"}, tmp_path, "w", 60)
    assert res["ok"] is False and "unknown op 'dance'" in res["error"]


def test_worker_timeout_kills_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slow = tmp_path / "slow.py"
    slow.write_text("import time\ntime.sleep(60)\n")
    monkeypatch.setattr(H, "WORKER", slow)
    res = H.run_worker(Path(sys.executable), {"op": "probe"}, tmp_path, "w", 1)
    assert res["ok"] is False and res["error"].startswith("timed out after 1s")


def test_worker_crash_quotes_the_last_error_line(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    crash = tmp_path / "crash.py"
    crash.write_text("import sys\nprint('INFO loading')\n"
                     "print('RuntimeError: cpu_gemm_wna16 is not registered')\n"
                     "print('INFO cleanup')\nsys.exit(7)\n")
    monkeypatch.setattr(H, "WORKER", crash)
    res = H.run_worker(Path(sys.executable), {"op": "probe"}, tmp_path, "w", 60)
    assert res["error"] == ("the vLLM process exited with status 7 without a result: "
                            "RuntimeError: cpu_gemm_wna16 is not registered")


def test_error_line_names_the_root_cause() -> None:
    from quantize.vllm import worker as vllm_worker

    try:
        try:
            raise KeyError("model.layers.0.mlp.down_proj.weight")
        except KeyError as inner:
            raise RuntimeError("Engine core initialization failed.\nSee above.") from inner
    except RuntimeError as exc:
        line = vllm_worker.error_line(exc)
    assert line == ("KeyError: 'model.layers.0.mlp.down_proj.weight' (raised as RuntimeError: "
                    "Engine core initialization failed.)")


def test_error_line_keeps_a_list_of_reasons() -> None:
    from quantize.vllm import worker as vllm_worker

    exc = ValueError("Failed to find a kernel that can implement the WNA16 linear layer. "
                     "Reasons: \n A cannot implement due to: x\n B cannot implement due to: y\n")
    assert vllm_worker.error_line(exc) == (
        "ValueError: Failed to find a kernel that can implement the WNA16 linear layer. "
        "Reasons: A cannot implement due to: x | B cannot implement due to: y")


def test_detect_without_vllm_reports_the_problem(tmp_path: Path) -> None:
    host = H.detect(sys.executable, workdir=tmp_path, use_cache=False)
    assert host.problem is not None and "vLLM does not import" in host.problem
    assert "No module named 'vllm'" in host.problem


# --- end to end on a tiny model -------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Path) -> dict[str, Path]:
    """A tiny random Llama (the default model's tokenizer) and two llm-compressor exports of
    it: W8A8 INT8 (dynamic activations) and W4A16 asymmetric group 32 (packed, zero points).
    Each export's manifest names the dense model, as the export stage writes it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    root = tmp_path_factory.mktemp("tiny")
    tok = AutoTokenizer.from_pretrained(default_tokenizer)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                      vocab_size=len(tok), tie_word_embeddings=True,
                      architectures=["LlamaForCausalLM"])
    dense = root / "dense"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(dense)
    tok.save_pretrained(dense)
    common = {"targets": ["Linear"], "ignore": ["lm_head"]}
    return {"dense": dense, **oneshot_exports(dense, root, {
        "w8a8": {**common, "scheme": "W8A8"},
        "w4asym": {**common, "config_groups": {"g": {
            "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": False,
                                               "strategy": "group", "group_size": 32}}}}})}


@pytest.mark.parametrize("name", ["w8a8", "w4asym"])
def test_decode_level_passes_on_a_sound_export(tiny: dict[str, Path], name: str,
                                               tmp_path: Path) -> None:
    s = V.verify(tiny[name], level="decode", out=tmp_path / "v")
    assert (s.level, s.verdict) == ("decode", "pass"), s.error
    m = s.metrics
    assert m.layers_decoded == 14 and m.worst_weight_rel_diff <= 2e-3
    assert m.source_cosine_min >= m.source_cosine_floor
    saved = json.loads((tmp_path / "v" / "verify.json").read_text())
    assert saved["level"] == "decode" and "decode level was asked for" in saved["why_not_vllm"]
    assert saved["passed"] is True and saved["result"].startswith("not loadable in this host")
    assert "# verify: PASS (decode level)" in (tmp_path / "v" / "verify.md").read_text()


def test_decode_level_catches_a_decoder_mismatch(tiny: dict[str, Path], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    real = D.decode_weight

    def off_by_a_bit(t: dict[str, Any], wargs: Args | None) -> Any:
        return real(t, wargs) * 1.01

    monkeypatch.setattr(D, "decode_weight", off_by_a_bit)
    s = V.verify(tiny["w8a8"], level="decode", out=tmp_path / "v")
    assert s.verdict == "fail"
    assert "weights differ from the stored integers × scales" in s.error


def test_decode_level_catches_a_consistent_misread(tiny: dict[str, Path],
                                                   tmp_path: Path) -> None:
    """Rows stored in the wrong order: both decoders read the same wrong weights, so they
    agree with each other; the source model's weights do not."""
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(tiny["w8a8"], bad)
    (f,) = bad.glob("*.safetensors")
    tensors = load_file(str(f))
    key = "model.layers.1.mlp.up_proj.weight"
    tensors[key] = tensors[key].flip(0).contiguous()
    save_file(tensors, str(f), metadata={"format": "pt"})
    s = V.verify(bad, level="decode", out=tmp_path / "v")
    assert s.verdict == "fail", s.metrics
    assert s.error.startswith("decode check failed: layer model.layers.1.mlp.up_proj: "
                                 "decoded weights have cosine")
    assert "the stored weights look corrupt" in s.error


def test_run_folder_writes_verify_folder(tiny: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny["w8a8"], run / "export")
    s = V.verify(run, level="decode")
    assert s.out == str(run / "verify")
    assert json.loads((run / "verify" / "verify.json").read_text())["verdict"] == "pass"


def test_target_must_be_a_run_or_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(VerifyError) as err:
        V.verify(tmp_path)
    assert err.value.path == str(tmp_path)
    assert err.value.problem is not None and err.value.problem.startswith(
        "is neither a run folder (with export/) nor a checkpoint folder")
    assert err.value.hint is not None and "`runs/<name>`" in err.value.hint


# A stand-in for the vLLM worker: stdlib only, it answers the request with the result JSON
# the test prepared (in $STAND_IN_ANSWER), so the whole subprocess protocol runs.
STAND_IN_WORKER = """
import json, os, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
json.load(open(args["--request"]))
with open(args["--result"], "w") as f:
    f.write(open(os.environ["STAND_IN_ANSWER"]).read())
"""


def greedy_answer(ckpt: Path, garble: bool = False) -> dict[str, Any]:
    """What vLLM would answer if it computed exactly what transformers computes (or, with
    `garble`, always picked the least likely token)."""
    import torch

    model = V.load_hf(ckpt)
    outs = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: a second spinning thread only costs on a busy box
    try:
        for p in V.prompt_ids(ckpt):
            ids, steps = list(p), []
            for _ in range(VR.MAX_TOKENS):
                with torch.no_grad():
                    lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1)
                tok = int(lp.argmin() if garble else lp.argmax())
                steps.append({"token": tok, "logprob": float(lp[tok]), "top": {}})
                ids.append(tok)
            outs.append({"token_ids": ids[len(p):], "steps": steps})
    finally:
        torch.set_num_threads(threads)
    return {"ok": True, "vllm_version": "stand-in", "quantization": "compressed-tensors",
            "outputs": outs, "layers": {"linear": {"X/Y/Z": {"count": 14, "example": "q"}}},
            "load_s": 0, "generate_s": 0}


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """vLLM replaced by the stand-in worker; returns the answer file to fill."""
    worker = tmp_path / "stand_in_worker.py"
    worker.write_text(STAND_IN_WORKER)
    answer = tmp_path / "answer.json"
    monkeypatch.setenv("STAND_IN_ANSWER", str(answer))
    monkeypatch.setattr(H, "WORKER", worker)
    monkeypatch.setattr(T, "PROMPTS", T.PROMPTS[:3])
    monkeypatch.setattr(VR, "MAX_TOKENS", 6)
    monkeypatch.setattr(H, "detect", lambda *a, **k: H.Host(sys.executable, "stand-in",
                                                             "cpu", {"avx512": True},
                                                             OPS_ALL))
    return answer


def test_vllm_level_protocol_passes_when_engines_agree(tiny: dict[str, Path], stand_in: Path,
                                                       tmp_path: Path) -> None:
    stand_in.write_text(json.dumps(greedy_answer(tiny["w8a8"])))
    s = V.verify(tiny["w8a8"], out=tmp_path / "v")
    assert (s.level, s.verdict) == ("vllm", "pass"), s.error
    assert s.metrics.agreement == 1.0 and s.metrics.steps == 3 * 6
    assert s.metrics.mean_abs_dlogprob < 1e-4
    assert s.serve_command.startswith("VLLM_CPU_KVCACHE_SPACE=1 vllm serve ")
    assert "--dtype bfloat16" in s.serve_command
    assert s.vllm is not None and s.vllm.layers["linear"]["X/Y/Z"].count == 14
    req = json.loads((tmp_path / "v" / "logs" / "vllm.request.json").read_text())
    assert req["prompts"][0] == V.prompt_ids(tiny["w8a8"])[0] and req["max_tokens"] == 6
    assert "# verify: PASS (vllm level)" in (tmp_path / "v" / "verify.md").read_text()


def test_vllm_level_fails_when_engines_disagree(tiny: dict[str, Path], stand_in: Path,
                                                tmp_path: Path) -> None:
    stand_in.write_text(json.dumps(greedy_answer(tiny["w8a8"], garble=True)))
    s = V.verify(tiny["w8a8"], out=tmp_path / "v")
    assert s.verdict == "fail"
    assert s.error.startswith("vLLM disagrees with transformers: greedy agreement 0.00%")


def test_vllm_level_load_failure_quotes_vllm(tiny: dict[str, Path], stand_in: Path,
                                             tmp_path: Path) -> None:
    H.WORKER.write_text("raise ValueError('Following weights were not initialized from "
                           "checkpoint: {model.norm.weight}')\n")
    s = V.verify(tiny["w8a8"], out=tmp_path / "v")
    assert s.verdict == "fail"
    assert s.error == ("vLLM could not load the checkpoint: the vLLM process exited with "
                          "status 1 without a result: ValueError: Following weights were not "
                          "initialized from checkpoint: {model.norm.weight}")


def test_level_vllm_without_vllm_is_an_error(tiny: dict[str, Path], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(H, "detect", lambda *a, **k: H.Host(None, problem="no vLLM "
                                                             "environment: run `make "
                                                             "vllm-env`"))
    with pytest.raises(VerifyError) as err:
        V.verify(tiny["w8a8"], level="vllm", out=tmp_path / "v")
    assert err.value.problem == "--level vllm: no vLLM environment: run `make vllm-env`"


def test_tp_on_the_cpu_backend_falls_back_to_decode(tiny: dict[str, Path], stand_in: Path,
                                                    tmp_path: Path) -> None:
    s = V.verify(tiny["w8a8"], tp=2, out=tmp_path / "v")
    assert s.level == "decode" and s.verdict == "pass"
    assert "--tp 2 on the CPU backend" in s.why_not_vllm


def test_vllm_level_serves_at_the_checkpoints_own_dtype_where_it_runs(
        tiny: dict[str, Path], stand_in: Path, tmp_path: Path) -> None:
    """A bf16 INT8 export needs no --dtype; the request leaves vLLM's auto in place."""
    import shutil

    ckpt = tmp_path / "bf16"
    shutil.copytree(tiny["w8a8"], ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    (ckpt / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    stand_in.write_text(json.dumps(greedy_answer(tiny["w8a8"])))
    s = V.verify(ckpt, out=tmp_path / "v")
    assert s.verdict == "pass", s.error
    assert "--dtype" not in s.serve_command and "serve_dtype" not in s
    assert "dtype" not in json.loads((tmp_path / "v" / "logs" / "vllm.request.json").read_text())


def test_run_folder_is_a_recorded_stage(tiny: dict[str, Path], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a run folder verify records stages.verify, its inputs naming the export's key (what
    publish checks); a second call with the same inputs reuses it, --rerun runs again."""
    import shutil

    from quantize.run.files import hash_tree
    from quantize.run.manifest import RunFolder
    from quantize.stages.verify import stage
    from tests.fixtures.manifests import write_manifest

    run = tmp_path / "run"
    shutil.copytree(tiny["w8a8"], run / "export")
    export = {"key": "e" * 64, "status": "done", "inputs": {}, "summary": {},
              "outputs": hash_tree(run / "export")}
    write_manifest(run, {"stages": {"export": export}})
    s = V.verify(run, level="decode")
    assert (s.verdict, s.out) == ("pass", str(run / "verify"))
    manifest = RunFolder(run).read()
    rec = manifest.stage("verify")
    assert rec is not None and rec.inputs["export"] == manifest.stages["export"].key
    assert rec.inputs["level"] == "decode" and rec.summary["verdict"] == "pass"
    assert RunFolder(run).verified_stage(manifest, "verify") is not None

    def must_not_run(*a: Any, **k: Any) -> Any:
        raise AssertionError("verify ran again")

    monkeypatch.setattr(stage, "run", must_not_run)
    again = V.verify(run, level="decode")
    assert again.verdict == "pass" and again.duration_s == s.duration_s
    assert RunFolder(run).read().stages["verify"].started == rec.started
    with pytest.raises(AssertionError, match="verify ran again"):
        V.verify(run, level="decode", rerun=True)
    with pytest.raises(AssertionError, match="verify ran again"):  # an input changed
        V.verify(run, level="decode", tp=2)
