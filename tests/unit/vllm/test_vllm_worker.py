"""The vLLM worker's results, typed (quantize/vllm/worker.py): the JSON the caller reads keeps
its keys and their order; a probe names kernel_import_error only when the kernels failed."""

from __future__ import annotations

import json

from quantize.vllm import worker as W


def _probe(error: str | None) -> W.ProbeResult:
    return W.ProbeResult("0.32.0", "2.9.0", "CpuPlatform", "cpu", {"avx512": True}, error,
                         {"cpu_gemm_wna16": True}, [W.GpuInfo("H200", 90)], {})


def test_probe_json_keeps_its_keys_and_leaves_out_a_null_kernel_error() -> None:
    ok = W.result_json(_probe(None))
    assert list(ok) == ["vllm_version", "torch_version", "platform", "device_type", "isa",
                        "ops", "gpus", "fp8_gemm_ms"]
    assert ok["gpus"] == [{"name": "H200", "capability": 90}]
    failed = W.result_json(_probe("ImportError: no _C"))
    assert list(failed)[5] == "kernel_import_error"


def test_generate_and_score_json_are_plain_json() -> None:
    gen = W.GenerateResult("0.32.0", [W.Generation([5], [W.TokenStep(5, -0.1, {"5": -0.1})])], 1.0,
                           0.5, "compressed-tensors", "bfloat16", {"tensor_parallel_size": 1},
                           {"linear": {"A/B": {"count": 2, "example": "l.0"}}, "attention": {}},
                           {"kv_tokens": 32})
    assert json.loads(json.dumps(W.result_json(gen)))["outputs"] == [
        {"token_ids": [5], "steps": [{"token": 5, "logprob": -0.1, "top": {"5": -0.1}}]}]
    score = W.ScoreResult("0.32.0", [W.ScoredBatch([W.Scored([-1.0], [1])], 0.1, 2)], 1.0,
                          None, "bfloat16", "auto", {}, {"kv_tokens": 32}, {})
    assert list(W.result_json(score)) == ["vllm_version", "groups", "load_s", "quantization",
                                          "dtype", "kv_cache_dtype", "engine_args", "engine",
                                          "layers"]
    assert W.result_json(score)["groups"] == [
        {"outputs": [{"logprobs": [-1.0], "ranks": [1]}], "seconds": 0.1, "tokens": 2}]
