"""Which engine scores an eval, and why.

- `hf`: transformers + lm-eval in this process, on a dense model (a quantized export is
  decoded to dense fp32 on CPU). Exact, and the only engine without the vLLM environment.
- `vllm`: each model in its own vLLM process in the vLLM environment (`make vllm-env`), the
  kernels and KV cache vLLM serves with; scores come from prompt log-probabilities
  (quantize.stages.eval.vllm_engine).
- `auto`: vLLM when the recipe quantizes the KV cache, or when the dense model would not fit
  the memory this host has; otherwise hf. transformers does simulate a compressed-tensors
  `kv_cache_scheme` (compressed-tensors attaches a QuantizedKVCache to each attention layer
  that fake-quantizes K and V with the checkpoint's k_scale/v_scale; measured in
  eval/README.md), but only vLLM stores the cache in FP8 and attends over it with its own
  kernel, which is what a user deploys.

The choice is made before any model is loaded; `--engine vllm` without a usable vLLM, a
format this host's vLLM cannot run, or a `--tp` larger than the devices it sees are refused
here in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from quantize.checks.resources import weight_bytes_on
from quantize.errors import EvalError
from quantize.model.config import read_config, weight_bytes

GiB = 2**30
HF_OVERHEAD = 1.5  # activations, logits and the allocator around the dense weights
KV_DTYPES = ("auto", "fp8", "bfloat16", "float16")


@dataclass(frozen=True)
class EvalEngineRequest:
    """What the user asked for: CLI over recipe over suite; None = not given."""

    engine: str | None = None  # hf | vllm | auto
    tp: int = 1
    kv_cache_dtype: str = "auto"
    vllm_python: str | None = None

    def check(self) -> None:
        if self.engine not in (None, "hf", "vllm", "auto"):
            raise EvalError(problem=f"unknown engine {self.engine!r}", hint="use hf, vllm or auto")
        if self.kv_cache_dtype not in KV_DTYPES:
            raise EvalError(problem=f"unknown --kv-cache-dtype {self.kv_cache_dtype!r}",
                            hint=f"use one of {', '.join(KV_DTYPES)}")
        if self.engine == "hf" and (self.tp != 1 or self.kv_cache_dtype != "auto"):
            raise EvalError(problem="--tp and --kv-cache-dtype apply to --engine vllm only",
                            hint="drop them: transformers evaluates on one device with a dense "
                                 "KV cache")


class EngineKey(TypedDict):
    """The engine's part of the eval stage key and the baseline cache key (hashed as is)."""

    engine: str
    tp: int
    kv_cache_dtype: str
    vllm_version: str | None
    vllm_device: str


@dataclass(frozen=True)
class EngineChoice:
    """The engine an eval runs with, why, and the vLLM settings (recorded in the manifest and
    part of the eval stage key)."""

    name: str  # hf | vllm
    requested: str  # hf | vllm | auto
    reason: str
    tp: int = 1
    kv_cache_dtype: str = "auto"
    vllm_python: str | None = None
    vllm_version: str | None = None
    device: str = "cpu"  # where vLLM runs: cpu | cuda

    def key(self) -> EngineKey:
        """What changes the numbers (not the reason, not where the python lives)."""
        return EngineKey(engine=self.name, tp=self.tp, kv_cache_dtype=self.kv_cache_dtype,
                         vllm_version=self.vllm_version, vllm_device=self.device)


def requested_engine(cli: str | None, recipe: str | None, suite: str | None) -> str:
    """`--engine`, else the recipe's eval.engine, else the suite's engine, else auto."""
    return cli or recipe or suite or "auto"


def dense_eval_bytes(model_path: Path, device: str) -> int:
    """Memory transformers needs to evaluate the dense model: its weights (fp32 on CPU, as
    the hf engine loads them there; 16-bit on a GPU) plus working room."""
    config = read_config(model_path)
    stored = sum(p.stat().st_size for p in model_path.glob("*.safetensors")) or sum(
        p.stat().st_size for p in model_path.glob("*.bin"))
    params = stored // weight_bytes(config)
    return int(weight_bytes_on(params, device) * HF_OVERHEAD)


def free_bytes(device: str) -> int:
    from quantize.checks.resources import gpu_free_bytes, host_free_bytes

    return gpu_free_bytes() if device == "cuda" else host_free_bytes()


def auto_rule(kv_quantized: bool, need: int, free: int, vllm_problem: str | None
              ) -> tuple[str, str]:
    """auto's choice and its reason. `vllm_problem`: why vLLM cannot be used (None: it can)."""
    fits = f"{need / GiB:.1f} GiB of {free / GiB:.1f} GiB free"
    if kv_quantized:
        if vllm_problem is None:
            return "vllm", ("the recipe quantizes the KV cache: vLLM runs the real FP8 cache "
                            "(transformers only fake-quantizes K/V)")
        return "hf", (f"the recipe quantizes the KV cache, but {vllm_problem}: transformers "
                      "scores it with K/V fake-quantized (compressed-tensors), not vLLM's cache")
    if need > free:
        if vllm_problem is None:
            return "vllm", f"the dense model does not fit in transformers ({fits})"
        raise EvalError(problem=f"evaluating in transformers needs the dense model ({fits}) "
                                f"and vLLM cannot be used ({vllm_problem})",
                        hint="run `make vllm-env` or use a machine with more memory")
    return "hf", f"the KV cache is not quantized and the dense model fits ({fits})"


def visible_devices(host: Any) -> int:
    """Devices vLLM can shard over on this host: its GPUs, or one CPU."""
    return len(host.gpus) if host.device == "cuda" else 1


def check_tp(tp: int, host: Any) -> None:
    n = visible_devices(host)
    if tp > n:
        where = f"{n} GPU(s)" if host.device == "cuda" else "the CPU backend (1 device)"
        raise EvalError(problem=f"--tp {tp} is larger than the devices vLLM sees on this host "
                                f"({where})", hint=f"use --tp {n} or a host with {tp} GPUs")


def vllm_problem(host: Any, candidate: Path, kv_cache_dtype: str) -> str | None:
    """Why this host's vLLM cannot score the candidate (None when it can)."""
    from quantize.vllm import support

    if host.vllm_python is None or host.problem:
        return str(host.problem)
    fmt = support.checkpoint_format(read_config(candidate))
    ok = support.supported(fmt, host, kv_cache_dtype)
    return None if ok.ok else ok.reason.removeprefix("not verifiable on this host: ")


def choose(req: EvalEngineRequest, candidate: Path, model_path: Path, kv_quantized: bool,
           device: str, host: Any = None) -> EngineChoice:
    """Decide the engine before anything is loaded; refuse what cannot run in one line."""
    from quantize.vllm import host as vhost

    req.check()
    requested = req.engine or "auto"
    if requested == "hf":
        return EngineChoice("hf", "hf", "asked for (--engine hf or eval.engine: hf)")
    need, free = dense_eval_bytes(model_path, device), free_bytes(device)
    if requested == "auto" and not kv_quantized and need <= free:  # no vLLM probe needed
        name, reason = auto_rule(False, need, free, None)
        return _hf(req, requested, reason)
    if host is None:
        try:
            host = vhost.detect(req.vllm_python)
        except Exception as exc:  # a bad --vllm-python: a vLLM problem like any other
            host = vhost.Host(None, problem=str(exc))
    problem = vllm_problem(host, candidate, req.kv_cache_dtype)
    if requested == "vllm":
        if host.vllm_python is None or host.problem:
            raise EvalError(problem=f"--engine vllm: {host.problem or 'no vLLM environment'}",
                            hint="run `make vllm-env` (or use --engine hf)")
        if problem:
            raise EvalError(problem=f"--engine vllm: this host's vLLM cannot run the "
                                    f"candidate ({problem})", hint="use --engine hf")
        name, reason = "vllm", "asked for (--engine vllm or eval.engine: vllm)"
    else:
        name, reason = auto_rule(kv_quantized, need, free, problem)
    if name == "hf":
        return _hf(req, requested, reason)
    check_tp(req.tp, host)
    return EngineChoice("vllm", requested, reason, req.tp, req.kv_cache_dtype,
                        host.vllm_python, host.vllm_version, host.device)


def _hf(req: EvalEngineRequest, requested: str, reason: str) -> EngineChoice:
    if req.tp != 1 or req.kv_cache_dtype != "auto":
        raise EvalError(problem=f"auto chose transformers ({reason})",
                        hint="--tp and --kv-cache-dtype need --engine vllm")
    return EngineChoice("hf", requested, reason)
