"""Runs INSIDE the vLLM environment, beside worker.py (standard library and vllm only): the
engine a worker process builds once and every op of that process reuses, what the engine says
about itself once started (KV-cache size, the memory profile it sized the cache from, the
kernel each layer got), and the throughput op (output tokens per second at a number of
concurrent requests).

The memory profile is read from vLLM's own GPU worker after start-up
(vllm/v1/worker/gpu_worker.py `determine_available_memory`): the budget it requested
(total x gpu_memory_utilization), the weights, the profile run's activation peak, the non-torch
increase, the CUDA-graph estimate and the KV bytes left; `quantize plan` predicts the same
quantities (quantize/planner/memory.py), so a run can be compared with its plan term by term.
"""

from __future__ import annotations

import importlib.util
import math
import os
import random
import time
from typing import Any

_ENGINES: dict[str, tuple[Any, dict[str, Any]]] = {}


def prepare_env(device_hint: str | None = None) -> None:
    """Environment settings a vLLM build needs before it is imported: FlashInfer's sampler is
    vLLM's default on CUDA, and its import fails where flashinfer is not installed
    (v1/sample/ops/topk_topp_sampler.py), so it is turned off there."""
    if importlib.util.find_spec("flashinfer") is None:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


def engine(req: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The LLM for the request's engine settings; built once per process and settings."""
    import json

    # The CPU backend sizes its KV cache from this (GiB); it refuses to start without it.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(req.get("kv_cache_space_gib", 1)))
    kwargs: dict[str, Any] = {
        "model": req["model"], "tokenizer": req["model"],
        "tensor_parallel_size": int(req.get("tp", 1)),
        "kv_cache_dtype": req.get("kv_cache_dtype", "auto"),
        "max_model_len": int(req.get("max_model_len", 512)),
        "enforce_eager": bool(req.get("enforce_eager", True)),
        "seed": 0, "dtype": req.get("dtype", "auto"),
    }
    if req.get("kv_cache_gib") and _cuda():
        kwargs.update(_sized_to_model(req["model"], float(req["kv_cache_gib"])))
    kwargs.update(req.get("engine_args", {}))
    key = json.dumps(kwargs, sort_keys=True)
    if key not in _ENGINES:
        from vllm import LLM

        _ENGINES[key] = (LLM(**kwargs), kwargs)
    return _ENGINES[key]


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


# Besides weights and KV cache: CUDA context, activations of a check's short sequences, cuBLAS
# workspaces (a verify or eval request, not a serving configuration).
_HEADROOM_GIB = 3.0


def _sized_to_model(model: str, kv_gib: float) -> dict[str, Any]:
    """A GPU check needs the model and a small KV cache, not 90 % of the card: a fixed KV
    size (`kv_cache_memory_bytes`, which also skips vLLM's memory profiling, so that other
    processes on the GPU cannot disturb it: v1/worker/gpu_worker.py) and a
    gpu_memory_utilization just large enough for vLLM's start-up check of free memory
    (v1/worker/utils.py request_memory)."""
    import glob

    import torch

    weights = sum(os.path.getsize(p) for p in glob.glob(os.path.join(model, "*.safetensors")))
    total = torch.cuda.mem_get_info()[1]
    need = weights * 1.1 + (kv_gib + _HEADROOM_GIB) * 2**30
    return {"kv_cache_memory_bytes": int(kv_gib * 2**30),
            "gpu_memory_utilization": round(min(0.9, max(0.05, need / total)), 4)}


def facts(llm: Any) -> dict[str, Any]:
    """What the started engine reports: KV blocks and tokens, the concurrency vLLM logs for
    max_model_len, the scheduler limits and CUDA graphs it runs with, and (GPU) the memory
    profile. Each part is best effort: a vLLM that moved an attribute loses that part only."""
    out: dict[str, Any] = {}
    try:
        cfg = llm.llm_engine.vllm_config
        cc, mc, sc = cfg.cache_config, cfg.model_config, cfg.scheduler_config
        blocks, size, mml = int(cc.num_gpu_blocks or 0), int(cc.block_size), mc.max_model_len
        per_request = math.ceil(mml / size)
        out.update(num_gpu_blocks=blocks, block_size=size, max_model_len=mml,
                   kv_tokens=blocks * size, kv_cache_dtype=str(cc.cache_dtype),
                   max_concurrency=round(blocks / per_request, 4),
                   gpu_memory_utilization=cc.gpu_memory_utilization,
                   max_num_batched_tokens=sc.max_num_batched_tokens,
                   max_num_seqs=sc.max_num_seqs,
                   cpu_offload_gb=getattr(getattr(getattr(cfg, "offload_config", None),
                                                  "uva", None), "cpu_offload_gb", None))
        comp = cfg.compilation_config
        sizes = list(getattr(comp, "cudagraph_capture_sizes", None) or [])
        out.update(cudagraph_mode=str(getattr(comp, "cudagraph_mode", "")),
                   cudagraph_sizes=len(sizes), cudagraph_max_size=max(sizes, default=0))
    except Exception as exc:  # a report, never a reason to fail
        out["config_error"] = f"{type(exc).__name__}: {exc}"[:300]
    try:
        memory = llm.collective_rpc(_memory_profile)[0]
        if memory:
            out["memory"] = memory
    except Exception as exc:
        out["memory_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


_PROFILE = (("requested", "requested_memory"), ("non_torch", "non_torch_memory"),
            ("activation_peak", "peak_activation_memory"),
            ("cudagraph_estimate", "cudagraph_memory_estimate"),
            ("available_kv", "available_kv_cache_memory_bytes"))


def _memory_profile(worker: Any) -> dict[str, int]:
    """Runs on vLLM's worker: the numbers determine_available_memory sized the cache from
    (bytes; absent on a CPU worker)."""
    out = {k: int(v) for k, attr in _PROFILE if (v := getattr(worker, attr, None)) is not None}
    runner = getattr(worker, "model_runner", None)
    weights = getattr(runner, "model_memory_usage", None)
    if weights is not None:
        out["weights"] = int(weights)
    return out


def describe_model(model: Any) -> dict[str, dict[str, dict[str, Any]]]:
    """Which quantization method, scheme and kernel class vLLM bound to each layer.

    Returns {"linear": {"Method/Scheme/Kernel": {"count": n, "example": layer}},
    "attention": {...}}; class names only, so it survives vLLM refactors.
    """
    linear: dict[str, dict[str, Any]] = {}
    attention: dict[str, dict[str, Any]] = {}
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
        for attr in ("kernel", "linear_kernel", "fp8_linear", "w8a8_block_fp8_linear",
                     "moe_kernel", "fused_experts"):
            kern = getattr(holder, attr, None)
            if kern is not None and not isinstance(kern, (bool, int, float, str)):
                parts.append(getattr(kern, "__name__", None) or type(kern).__name__)
                break
        _count(linear, "/".join(parts), name)
    return {"linear": linear, "attention": attention}


def _count(table: dict[str, dict[str, Any]], key: str, name: str) -> None:
    entry = table.setdefault(key, {"count": 0, "example": name})
    entry["count"] += 1


def score_group(llm: Any, seqs: list[list[int]], starts: list[int]
                ) -> list[tuple[list[float], list[int]]]:
    """Each sequence's log-probabilities and ranks from its start on (worker.score says how a
    sequence is sent)."""
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
        outputs.append((lps, ranks))
    return outputs


def throughput(llm: Any, req: dict[str, Any]) -> dict[str, Any]:
    """Output tokens per second for `requests` concurrent requests of `prompt_tokens` random
    token ids each, `output_tokens` generated greedily past EOS (the timing, not the text, is
    measured), after a warm-up of two short requests; the best of `repeats` runs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    n, p_len = int(req.get("requests", 1)), int(req.get("prompt_tokens", 512))
    o_len, repeats = int(req.get("output_tokens", 256)), int(req.get("repeats", 1))
    vocab = int(req.get("vocab", 32000))
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(100, vocab) for _ in range(p_len)])
               for _ in range(n)]
    warm = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    llm.generate(prompts[:2], warm, use_tqdm=False)
    params = SamplingParams(max_tokens=o_len, ignore_eos=True, temperature=0.0)
    best = float("inf")
    tokens = 0
    for _ in range(max(1, repeats)):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - t)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"requests": n, "prompt_tokens": p_len, "output_tokens": o_len,
            "seconds": round(best, 4), "out_tok_s": round(tokens / best, 2)}
