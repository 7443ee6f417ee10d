"""The full level: vLLM, in its own environment and a fresh subprocess, loads the checkpoint
and decodes greedily from the fixed prompts; transformers scores the same tokens."""

from __future__ import annotations

import shlex
import time
from pathlib import Path

import quantize.stages.verify.target as target
from quantize.errors import VerifyError
from quantize.stages.verify.result import LevelResult, VllmLoadInfo
from quantize.stages.verify.scoring import Thresholds, compare, load_hf, score
from quantize.vllm import host as vhost
from quantize.vllm.protocol import Generated, GenerateRequest, generate, size_kv

MAX_TOKENS = 16
TOP_K = 5


def engine_request(ckpt: Path, prompts: list[list[int]], host: vhost.Host, tp: int,
                   kv_cache_dtype: str, dtype: str | None = None) -> GenerateRequest:
    """The worker's generate request. `dtype`: a `--dtype` the checkpoint needs on this host
    (quantize.vllm.support.serving_dtype); else vLLM's auto (the checkpoint's own)."""
    req = GenerateRequest(model=str(ckpt.resolve()), prompts=prompts, max_tokens=MAX_TOKENS,
                          logprobs=TOP_K, tp=tp, kv_cache_dtype=kv_cache_dtype,
                          max_model_len=512, enforce_eager=True)
    if dtype:
        req.dtype = dtype
    size_kv(req, host.device)
    return req


def serve_command(ckpt: Path, req: GenerateRequest, host: vhost.Host) -> str:
    """The `vllm serve` line that loads the checkpoint as verify did (the flags it needs)."""
    space = req.kv_cache_space_gib if req.kv_cache_space_gib is not None else 1
    env = f"VLLM_CPU_KVCACHE_SPACE={space} " if host.device == "cpu" else ""
    args = [f"vllm serve {shlex.quote(str(ckpt.resolve()))}"]
    if req.dtype:
        args.append(f"--dtype {req.dtype}")
    if (req.tp or 1) > 1:
        args.append(f"--tensor-parallel-size {req.tp}")
    if req.kv_cache_dtype != "auto":
        args.append(f"--kv-cache-dtype {req.kv_cache_dtype}")
    args.append(f"--max-model-len {req.max_model_len}")
    if host.device == "cpu":
        args.append("--enforce-eager")
    return env + " ".join(args)


def verify_vllm(ckpt: Path, out: Path, host: vhost.Host, *, tp: int, kv_cache_dtype: str,
                timeout_s: float, th: Thresholds, dtype: str | None = None) -> LevelResult:
    assert host.vllm_python is not None
    prompts = target.prompt_ids(ckpt)
    req = engine_request(ckpt, prompts, host, tp, kv_cache_dtype, dtype)
    res = generate(Path(host.vllm_python), req, out / "logs", "vllm", timeout_s)
    result = LevelResult(serve_command=serve_command(ckpt, req, host))
    if not res.ok:
        result.verdict = "fail"
        result.error = f"vLLM could not load the checkpoint: {res.error}"
        result.vllm_log = _rel(res.log, out)
        return result
    t0 = time.perf_counter()
    try:
        model = load_hf(ckpt)
    except VerifyError as exc:  # vLLM loaded what transformers cannot: no reference
        result.verdict = "fail"
        result.error = f"vLLM loaded it, but {exc}"
        result.vllm_log = _rel(res.log, out)
        return result
    rows = [score(model, p, o.token_ids) for p, o in zip(prompts, res.outputs, strict=True)]
    metrics = compare(res.outputs, rows, th)
    result.verdict = "fail" if metrics.failures else "pass"
    result.vllm = VllmLoadInfo(vllm_version=res.vllm_version, quantization=res.quantization,
                               dtype=res.dtype, layers=res.layers, load_s=res.load_s,
                               generate_s=res.generate_s, engine_args=res.engine_args)
    result.vllm_log = _rel(res.log, out)
    result.metrics = metrics
    result.thresholds = dict(th.__dict__)
    result.reference_s = round(time.perf_counter() - t0, 2)
    result.samples = _samples(ckpt, prompts, res.outputs)
    if metrics.failures:
        result.error = "vLLM disagrees with transformers: " + "; ".join(metrics.failures)
    return result


def _samples(ckpt: Path, prompts: list[list[int]], outputs: list[Generated]) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    return [str(tok.decode(p)) + "⟨" + str(tok.decode(o.token_ids)) + "⟩"
            for p, o in zip(prompts[:3], outputs[:3], strict=False)]


def _rel(path: str | None, base: Path) -> str | None:
    if not path:
        return None
    try:
        return str(Path(path).relative_to(base))
    except ValueError:
        return path
