"""Runs INSIDE the separate vLLM environment: imports only the standard library and vllm
(and torch, which vllm brings and which answers the ISA and kernel-registry questions).

    python worker.py --request REQUEST.json|- --result RESULT.json

The request is JSON (a file, or `-` for stdin); the result is JSON written atomically to
--result. Ops:

- `probe`: vLLM's version and platform, the CPU ISA torch sees (AVX-512, AMX, ...), the
  custom kernels this build registered, the GPU compute capabilities, the CPU's FP8 GEMM time.
- `generate`: load `model`, decode greedily from token-id prompts; return the ids with each
  chosen token's log-probability and top-k, vLLM's quantization method and layer kernels.
- `score`: load `model`; for each token-id sequence, each token's log-probability and rank
  from `score_from` on (what eval's perplexity and multiple-choice scores come from).
- `throughput`: load `model`; output tokens per second for `requests` concurrent requests
  (serving.throughput).
- `batch`: load `model` once and run each of `steps` (generate, score, throughput requests
  without engine settings of their own) on it; one result per step.

Every loading op also returns `engine`: what vLLM reports once started (KV-cache blocks and
tokens, the concurrency it logs, the memory profile it sized the cache from; serving.facts).
Exit status 0 when the result says `ok: true`; on failure it holds vLLM's own error line.
One process per checkpoint (after a failed load vLLM's global state is not clean); the ops of
one process share its engine (serving.engine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TypedDict, cast

if __package__ in (None, ""):  # run as a script in the vLLM environment: serving.py beside it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
from quantize.vllm import serving  # standard library and vllm only

# Custom ops whose presence decides which quantized formats a CPU build can run.
_CPU_OPS = ("cpu_gemm_wna16", "onednn_scaled_mm", "int8_scaled_mm", "static_scaled_fp8_quant",
            "dynamic_scaled_fp8_quant", "dynamic_scaled_int8_quant", "cpu_attention_with_kv_cache",
            "fp8_scaled_mm_cpu", "cpu_has_amx_fp8", "hadacore_transform")


# --- the request (the JSON document the caller writes) ------------------------------------
class EngineArgs(TypedDict, total=False):
    """vLLM's LLM(...) keyword arguments the worker sets (a request may add its own)."""
    model: str
    tokenizer: str
    tensor_parallel_size: int
    kv_cache_dtype: str
    max_model_len: int
    enforce_eager: bool
    seed: int
    dtype: str


class ScoreBatch(TypedDict):
    sequences: list[list[int]]
    score_from: list[int]


class Request(TypedDict, total=False):
    """The request JSON: `op` and what that op reads."""
    op: str
    model: str
    tp: int
    kv_cache_dtype: str
    max_model_len: int
    enforce_eager: bool
    dtype: str
    kv_cache_space_gib: float
    kv_cache_gib: float  # GPU: the KV cache's size, and a memory share sized to the model
    engine_args: EngineArgs
    max_tokens: int  # generate
    logprobs: int
    prompts: list[list[int]]
    groups: list[ScoreBatch]  # score
    runs: list[dict[str, int]]  # throughput
    steps: list[dict[str, Any]]  # batch


# --- the results (written as JSON by main) ------------------------------------------------
class LayerCount(TypedDict):
    """One row of describe_model's tables (a plain dict: vLLM pickles it when tp > 1)."""
    count: int
    example: str


@dataclass
class GpuInfo:
    name: str
    capability: int


@dataclass
class ProbeResult:
    vllm_version: str
    torch_version: str
    platform: str
    device_type: str
    isa: dict[str, bool]
    kernel_import_error: str | None  # left out of the JSON when the kernels imported
    ops: dict[str, bool]
    gpus: list[GpuInfo]
    fp8_gemm_ms: dict[str, float]  # CPU: one 128x512x512 product, FP8 (_scaled_mm) and bf16


@dataclass
class TokenStep:
    token: int
    logprob: float
    top: dict[str, float]


@dataclass
class Generation:
    token_ids: list[int]
    steps: list[TokenStep]


@dataclass
class GenerateResult:
    vllm_version: str
    outputs: list[Generation]
    load_s: float
    generate_s: float
    quantization: str | None
    dtype: str
    engine_args: EngineArgs
    layers: dict[str, dict[str, LayerCount]] | dict[str, str]  # or {"error": line}
    engine: dict[str, Any]  # serving.facts: KV cache, memory profile


@dataclass
class Scored:
    logprobs: list[float]
    ranks: list[int]


@dataclass
class ScoredBatch:
    outputs: list[Scored]
    seconds: float
    tokens: int


@dataclass
class ScoreResult:
    vllm_version: str
    groups: list[ScoredBatch]
    load_s: float
    quantization: str | None
    dtype: str
    kv_cache_dtype: str
    engine_args: EngineArgs
    engine: dict[str, Any]  # serving.facts: KV cache, memory profile
    layers: dict[str, dict[str, LayerCount]] | dict[str, str]  # the kernels, as generate's


@dataclass
class ThroughputResult:
    vllm_version: str
    load_s: float
    runs: list[dict[str, Any]]  # serving.throughput, one per entry of `runs`
    engine_args: EngineArgs
    engine: dict[str, Any]


@dataclass
class BatchResult:
    vllm_version: str
    load_s: float
    steps: list[dict[str, Any]]  # each step's result JSON


Result = ProbeResult | GenerateResult | ScoreResult | ThroughputResult | BatchResult


def result_json(result: Result) -> dict[str, Any]:
    """A result as the JSON the caller reads (kernel_import_error only when they failed)."""
    out = asdict(result)
    if isinstance(result, ProbeResult) and result.kernel_import_error is None:
        del out["kernel_import_error"]
    return out


def _root_cause(exc: BaseException) -> BaseException:
    seen = set()
    while id(exc) not in seen and (exc.__cause__ or exc.__context__) is not None:
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return exc


def error_line(exc: BaseException) -> str:
    """`Type: first line` of the innermost exception and of the outer one (vLLM wraps)."""

    def line(e: BaseException) -> str:
        text = [t.strip() for t in str(e).strip().splitlines() if t.strip()]
        if not text:
            return type(e).__name__
        first = text[0]
        if first.endswith(":") and len(text) > 1:  # "...Reasons:" then one reason a line
            first = (first + " " + " | ".join(text[1:]))[:600]
        return f"{type(e).__name__}: {first}"

    root = _root_cause(exc)
    if root is exc:
        return line(exc)
    return f"{line(root)} (raised as {line(exc)})"


def probe(_req: Request) -> ProbeResult:
    import torch
    import vllm
    from vllm.platforms import current_platform

    isa = {}
    for name in ("avx512", "avx512_vnni", "avx512_bf16", "amx_tile", "avx2"):
        fn = getattr(torch.cpu, f"_is_{name}_supported", None)
        if fn is not None:
            try:
                isa[name] = bool(fn())
            except Exception:  # an ISA query that this torch cannot answer
                isa[name] = False
    kernel_error = None
    try:
        current_platform.import_kernels()
    except Exception as exc:
        kernel_error = error_line(exc)
    namespace = torch.ops._C
    ops = {op: _has_op(namespace, op) for op in _CPU_OPS}
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            gpus.append(GpuInfo(torch.cuda.get_device_name(i), major * 10 + minor))
    device = getattr(current_platform, "device_type", "unknown")
    return ProbeResult(vllm.__version__, torch.__version__, type(current_platform).__name__,
                       device, isa, kernel_error, ops, gpus,
                       _fp8_gemm_ms(torch) if device == "cpu" else {})


def _fp8_gemm_ms(torch: Any) -> dict[str, float]:
    """vLLM's CPU FP8 W8A8 kernel is torch._scaled_mm, which some CPUs run emulated (~500x
    bf16's time seen on an AMX host, torch 2.13): one small product of each, timed."""
    a, b, one, out = torch.randn(128, 512), torch.randn(512, 512).t(), torch.ones(()), {}
    f8 = torch.float8_e4m3fn
    runs = {"bf16": lambda: a.bfloat16() @ b.bfloat16(), "fp8": lambda: torch._scaled_mm(
        a.to(f8), b.to(f8), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)}
    try:
        for name, fn in runs.items():  # after a warm-up, the fastest of 3 (1 in FP8)
            fn()
            best = float("inf")
            for _ in range(3 if name == "bf16" else 1):
                t = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t)
            out[name] = round(best * 1000, 3)
    except Exception:  # no FP8 GEMM in this torch: the load decides
        return {}
    return out


def _has_op(namespace: Any, op: str) -> bool:
    try:
        getattr(namespace, op)
    except (AttributeError, RuntimeError):
        return False
    return True


def generate(req: Request) -> GenerateResult:
    if int(req.get("tp", 1)) > 1:
        # With several workers describe_model travels to them pickled.
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm, kwargs = serving.engine(dict(req))
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=int(req["max_tokens"]),
                            logprobs=int(req.get("logprobs", 5)), ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in req["prompts"]]
    t1 = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.perf_counter() - t1
    outputs = []
    for res in results:
        comp = res.outputs[0]
        steps = []
        for tok, lp in zip(comp.token_ids, comp.logprobs or [], strict=False):
            steps.append(TokenStep(int(tok), float(lp[tok].logprob),
                              {str(k): float(v.logprob) for k, v in lp.items()}))
        outputs.append(Generation([int(t) for t in comp.token_ids], steps))
    engine = llm.llm_engine
    mcfg = getattr(getattr(engine, "vllm_config", None), "model_config", None) or getattr(
        engine, "model_config", None)
    return GenerateResult(vllm.__version__, outputs, round(load_s, 2), round(gen_s, 2),
                          getattr(mcfg, "quantization", None),
                          str(getattr(mcfg, "dtype", "")).replace("torch.", ""),
                          _echo(kwargs), _layers(llm), serving.facts(llm))


def _layers(llm: Any) -> dict[str, dict[str, LayerCount]] | dict[str, str]:
    """The kernel vLLM bound to each layer (serving.describe_model), or why not."""
    try:
        return cast(dict[str, dict[str, LayerCount]], llm.apply_model(serving.describe_model)[0])
    except Exception as exc:  # introspection is a report, never a reason to fail the load
        return {"error": error_line(exc)}


def _echo(kwargs: dict[str, Any]) -> EngineArgs:
    """The engine arguments a result reports (all but the model paths)."""
    return cast(EngineArgs, {k: v for k, v in kwargs.items() if k not in ("model", "tokenizer")})


def score(req: Request) -> ScoreResult:
    """Log-probabilities of given tokens, per group of sequences (one group per metric, timed
    on its own after a warm-up). A sequence of n tokens is sent as its first n-1 (prompt
    log-probabilities: token i given the tokens before it, from the raw logits) and its last
    token is forced as the one generated token (`allowed_token_ids`; its log-probability is
    also from the raw logits, before that restriction: vLLM's default logprobs_mode
    `raw_logprobs`, v1/sample/sampler.py). So a window may fill every position of
    max_model_len, which a prompt may not (v1/engine/input_processor.py)."""
    import vllm

    t0 = time.perf_counter()
    llm, kwargs = serving.engine(dict(req))
    load_s = time.perf_counter() - t0
    groups = req["groups"]
    first = next((g["sequences"][0] for g in groups if g["sequences"]), None)
    if first is not None:  # the first batch pays one-off kernel set-up: keep it off the clock
        serving.score_group(llm, [list(map(int, first[:16]))], [1])
    out_groups = []
    for g in groups:
        seqs = [list(map(int, s)) for s in g["sequences"]]
        t1 = time.perf_counter()
        outputs = [Scored(lps, ranks) for lps, ranks in
                   serving.score_group(llm, seqs, [int(x) for x in g["score_from"]])]
        out_groups.append(ScoredBatch(outputs, round(time.perf_counter() - t1, 3),
                                      sum(len(s) for s in seqs)))
    engine = llm.llm_engine
    mcfg = getattr(getattr(engine, "vllm_config", None), "model_config", None)
    ccfg = getattr(getattr(engine, "vllm_config", None), "cache_config", None)
    return ScoreResult(vllm.__version__, out_groups, round(load_s, 2),
                       getattr(mcfg, "quantization", None),
                       str(getattr(mcfg, "dtype", "")).replace("torch.", ""),
                       str(getattr(ccfg, "cache_dtype", "")), _echo(kwargs),
                       serving.facts(llm), _layers(llm))


def throughput(req: Request) -> ThroughputResult:
    """Output tokens per second, once per entry of `runs` ({requests, prompt_tokens,
    output_tokens, repeats}), on one engine."""
    import vllm

    t0 = time.perf_counter()
    llm, kwargs = serving.engine(dict(req))
    load_s = time.perf_counter() - t0
    runs = [serving.throughput(llm, dict(r)) for r in req.get("runs", [{}])]
    return ThroughputResult(vllm.__version__, round(load_s, 2), runs, _echo(kwargs),
                            serving.facts(llm))


_ENGINE_KEYS = ("model", "tp", "kv_cache_dtype", "max_model_len", "enforce_eager", "dtype",
                "kv_cache_space_gib", "kv_cache_gib", "engine_args")


def batch(req: Request) -> BatchResult:
    """Each step on the engine the batch's settings build (a step's own settings are
    ignored: one process, one engine)."""
    import vllm

    t0 = time.perf_counter()
    serving.engine(dict(req))
    load_s = time.perf_counter() - t0
    shared = {k: v for k, v in req.items() if k in _ENGINE_KEYS}
    steps: list[dict[str, Any]] = []
    for step in req.get("steps", []):
        op = OPS.get(step.get("op", ""))
        if op is None or op in (batch, probe):
            raise ValueError(f"batch step op {step.get('op')!r}: generate, score or throughput")
        steps.append(result_json(op(cast(Request, {**step, **shared}))))
    return BatchResult(vllm.__version__, round(load_s, 2), steps)


OPS: dict[str, Callable[[Request], Result]] = {"probe": probe, "generate": generate,
                                              "score": score, "throughput": throughput,
                                              "batch": batch}


def _write(path: str, data: dict[str, Any]) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".result.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--request", required=True, help="request JSON file, or - for stdin")
    ap.add_argument("--result", required=True, help="where to write the result JSON")
    args = ap.parse_args(argv)
    # Before vllm is imported. In-process engine: exceptions reach us directly (no engine
    # subprocess that re-imports this script) and the model can be inspected in place.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    serving.prepare_env()
    t0 = time.perf_counter()
    try:
        if args.request == "-":
            req = json.load(sys.stdin)
        else:
            with open(args.request) as f:
                req = json.load(f)
        op = OPS.get(req.get("op", ""))
        if op is None:
            raise ValueError(f"unknown op {req.get('op')!r}; known: {sorted(OPS)}")
        result = {"ok": True, **result_json(op(req))}
    except BaseException as exc:  # report everything, including SystemExit from vLLM
        result = {"ok": False, "error": error_line(exc), "error_type": type(exc).__name__,
                  "traceback": traceback.format_exc()[-6000:]}
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    _write(args.result, result)
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM may leave non-daemon threads behind; the result is written, so exit now.
    os._exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
