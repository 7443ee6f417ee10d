"""Runs INSIDE the separate vLLM environment: imports only the standard library and vllm
(and torch, which vllm brings and which answers the ISA and kernel-registry questions).

    python vllm_worker.py --request REQUEST.json|- --result RESULT.json

The request is JSON (a file, or `-` for stdin); the result is JSON written atomically to
--result. Ops:

- `probe`: vLLM's version and platform, the CPU ISA torch sees (AVX-512, AMX, ...), the
  custom kernels this build registered, the GPU compute capabilities, the CPU's FP8 GEMM time.
- `generate`: load `model`, decode greedily from token-id prompts; return the ids with each
  chosen token's log-probability and top-k, vLLM's quantization method and layer kernels.
- `score`: load `model`; for each token-id sequence, each token's log-probability and rank
  from `score_from` on (what eval's perplexity and multiple-choice scores come from).

Exit status 0 when the result says `ok: true`; on failure it holds vLLM's own error line.
One process per checkpoint (after a failed load vLLM's global state is not clean).
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

# Custom ops whose presence decides which quantized formats a CPU build can run.
_CPU_OPS = ("cpu_gemm_wna16", "onednn_scaled_mm", "int8_scaled_mm", "static_scaled_fp8_quant",
            "dynamic_scaled_fp8_quant", "dynamic_scaled_int8_quant", "cpu_attention_with_kv_cache",
            "fp8_scaled_mm_cpu", "cpu_has_amx_fp8")


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


class ScoreGroup(TypedDict):
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
    engine_args: EngineArgs
    max_tokens: int  # generate
    logprobs: int
    prompts: list[list[int]]
    groups: list[ScoreGroup]  # score


# --- the results (written as JSON by main) ------------------------------------------------
class LayerCount(TypedDict):
    """One row of describe_model's tables (a plain dict: vLLM pickles it when tp > 1)."""
    count: int
    example: str


@dataclass
class Gpu:
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
    gpus: list[Gpu]
    fp8_gemm_ms: dict[str, float]  # CPU: one 128x512x512 product, FP8 (_scaled_mm) and bf16


@dataclass
class Step:
    token: int
    logprob: float
    top: dict[str, float]


@dataclass
class Generated:
    token_ids: list[int]
    steps: list[Step]


@dataclass
class GenerateResult:
    vllm_version: str
    outputs: list[Generated]
    load_s: float
    generate_s: float
    quantization: str | None
    dtype: str
    engine_args: EngineArgs
    layers: dict[str, dict[str, LayerCount]] | dict[str, str]  # or {"error": line}


@dataclass
class Scored:
    logprobs: list[float]
    ranks: list[int]


@dataclass
class ScoredGroup:
    outputs: list[Scored]
    seconds: float
    tokens: int


@dataclass
class ScoreResult:
    vllm_version: str
    groups: list[ScoredGroup]
    load_s: float
    quantization: str | None
    dtype: str
    kv_cache_dtype: str
    engine_args: EngineArgs


Result = ProbeResult | GenerateResult | ScoreResult


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
            gpus.append(Gpu(torch.cuda.get_device_name(i), major * 10 + minor))
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


def describe_model(model: Any) -> dict[str, dict[str, LayerCount]]:
    """Which quantization method, scheme and kernel class vLLM bound to each layer.

    Returns {"linear": {"Method/Scheme/Kernel": {"count": n, "example": layer}},
    "attention": {...}}; class names only, so it survives vLLM refactors.
    """
    linear: dict[str, LayerCount] = {}
    attention: dict[str, LayerCount] = {}
    for name, mod in model.named_modules():
        qm = getattr(mod, "quant_method", None)
        impl = getattr(mod, "impl", None)
        if impl is not None and hasattr(mod, "kv_cache_dtype"):  # an attention layer
            backend: Any = getattr(mod, "attn_backend", None)
            name_of = getattr(backend, "get_name", None)
            parts = [name_of() if callable(name_of) else type(impl).__name__,
                     f"kv_cache_dtype={mod.kv_cache_dtype}"]
            if qm is not None:
                parts.append(type(qm).__name__)
            _count(attention, "/".join(parts), name)
            continue
        if qm is None:
            continue
        parts = [type(qm).__name__]
        scheme = getattr(mod, "scheme", None)
        if scheme is not None:
            parts.append(type(scheme).__name__)
        holder = scheme if scheme is not None else qm
        for attr in ("kernel", "linear_kernel", "fp8_linear", "w8a8_block_fp8_linear"):
            kern = getattr(holder, attr, None)
            if kern is not None:
                parts.append(type(kern).__name__)
                break
        _count(linear, "/".join(parts), name)
    return {"linear": linear, "attention": attention}


def _count(table: dict[str, LayerCount], key: str, name: str) -> None:
    entry = table.setdefault(key, {"count": 0, "example": name})
    entry["count"] += 1


def generate(req: Request) -> GenerateResult:
    if int(req.get("tp", 1)) > 1:
        # With several workers describe_model travels to them pickled.
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm, kwargs = _engine(req)
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
            steps.append(Step(int(tok), float(lp[tok].logprob),
                              {str(k): float(v.logprob) for k, v in lp.items()}))
        outputs.append(Generated([int(t) for t in comp.token_ids], steps))
    engine = llm.llm_engine
    mcfg = getattr(getattr(engine, "vllm_config", None), "model_config", None) or getattr(
        engine, "model_config", None)
    layers: dict[str, dict[str, LayerCount]] | dict[str, str]
    try:
        layers = llm.apply_model(describe_model)[0]
    except Exception as exc:  # introspection is a report, never a reason to fail the load
        layers = {"error": error_line(exc)}
    return GenerateResult(vllm.__version__, outputs, round(load_s, 2), round(gen_s, 2),
                          getattr(mcfg, "quantization", None),
                          str(getattr(mcfg, "dtype", "")).replace("torch.", ""),
                          _echo(kwargs), layers)


def _echo(kwargs: EngineArgs) -> EngineArgs:
    """The engine arguments a result reports (all but the model paths)."""
    return cast(EngineArgs, {k: v for k, v in kwargs.items() if k not in ("model", "tokenizer")})


def _engine(req: Request) -> tuple[Any, EngineArgs]:
    """An LLM built from the request's engine settings (shared by generate and score)."""
    # The CPU backend sizes its KV cache from this (GiB); it refuses to start without it.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(req.get("kv_cache_space_gib", 1)))
    from vllm import LLM

    kwargs: EngineArgs = {
        "model": req["model"], "tokenizer": req["model"],
        "tensor_parallel_size": int(req.get("tp", 1)),
        "kv_cache_dtype": req.get("kv_cache_dtype", "auto"),
        "max_model_len": int(req.get("max_model_len", 512)),
        "enforce_eager": bool(req.get("enforce_eager", True)),
        "seed": 0, "dtype": req.get("dtype", "auto"),
    }
    kwargs.update(req.get("engine_args", {}))
    return LLM(**kwargs), kwargs


def _score_group(llm: Any, seqs: list[list[int]], starts: list[int]) -> list[Scored]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=s[:-1]) for s in seqs]
    params = [SamplingParams(temperature=0.0, max_tokens=1, logprobs=0, prompt_logprobs=0,
                             allowed_token_ids=[s[-1]], ignore_eos=True) for s in seqs]
    results = llm.generate(prompts, params, use_tqdm=False)
    outputs = []
    for seq, start, res in zip(seqs, starts, results, strict=True):
        steps = list(res.prompt_logprobs or [None])  # position 0 has none
        gen = res.outputs[0]
        if not gen.token_ids or gen.token_ids[0] != seq[-1] or not gen.logprobs:
            raise RuntimeError(f"vLLM did not return the forced last token {seq[-1]}")
        steps.append(gen.logprobs[0])
        lps, ranks = [], []
        for pos in range(max(start, 1), len(seq)):
            entry = steps[pos][seq[pos]]
            lps.append(float(entry.logprob))
            ranks.append(int(entry.rank) if entry.rank is not None else -1)
        outputs.append(Scored(lps, ranks))
    return outputs


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
    llm, kwargs = _engine(req)
    load_s = time.perf_counter() - t0
    groups = req["groups"]
    first = next((g["sequences"][0] for g in groups if g["sequences"]), None)
    if first is not None:  # the first batch pays one-off kernel set-up: keep it off the clock
        _score_group(llm, [list(map(int, first[:16]))], [1])
    out_groups = []
    for g in groups:
        seqs = [list(map(int, s)) for s in g["sequences"]]
        t1 = time.perf_counter()
        outputs = _score_group(llm, seqs, [int(x) for x in g["score_from"]])
        out_groups.append(ScoredGroup(outputs, round(time.perf_counter() - t1, 3),
                                      sum(len(s) for s in seqs)))
    engine = llm.llm_engine
    mcfg = getattr(getattr(engine, "vllm_config", None), "model_config", None)
    ccfg = getattr(getattr(engine, "vllm_config", None), "cache_config", None)
    return ScoreResult(vllm.__version__, out_groups, round(load_s, 2),
                       getattr(mcfg, "quantization", None),
                       str(getattr(mcfg, "dtype", "")).replace("torch.", ""),
                       str(getattr(ccfg, "cache_dtype", "")), _echo(kwargs))


OPS: dict[str, Callable[[Request], Result]] = {"probe": probe, "generate": generate,
                                              "score": score}


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
