"""Phase timers around the engine's and the pipeline's functions, by monkeypatching.

Each region synchronizes the GPU on entry and exit, so GPU work is charged to the region
that launched it; nested regions are subtracted from their parent (self time), so the
phases add up to the run's wall time. A sync costs tens of microseconds; a run has a few
thousand region entries, so the timers add well under a second.
"""

from __future__ import annotations

import functools
import importlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any


class Prof:
    def __init__(self) -> None:
        self.self_s: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.gptq_losses: list[float] = []
        # regions entered from other threads (the pipeline's background model hash): their
        # own time, outside the main thread's wall-time decomposition
        self.background_s: dict[str, float] = defaultdict(float)
        self._stack: list[list[Any]] = []  # [name, segment start]
        self._sync: Callable[[], None] = _sync_fn()

    def enter(self, name: str) -> None:
        self._sync()
        now = time.perf_counter()
        if self._stack:
            top = self._stack[-1]
            self.self_s[top[0]] += now - top[1]
        self._stack.append([name, now])
        self.calls[name] += 1

    def exit(self) -> None:
        self._sync()
        now = time.perf_counter()
        name, start = self._stack.pop()
        self.self_s[name] += now - start
        if self._stack:
            self._stack[-1][1] = now

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is not threading.main_thread():
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.background_s[name] += time.perf_counter() - t0
            self.enter(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self.exit()

        timed._bench_wrapped = True  # type: ignore[attr-defined]
        return timed

    def report(self) -> dict[str, Any]:
        return {"phases_s": {k: round(v, 3) for k, v in sorted(self.self_s.items(),
                                                               key=lambda kv: -kv[1])},
                "background_s": {k: round(v, 3) for k, v in self.background_s.items()},
                "calls": dict(self.calls)}


def _sync_fn() -> Callable[[], None]:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.synchronize
    return lambda: None


# (module, attribute path, region). Missing targets are skipped and listed, so an engine
# upgrade that renames a function shows up in the result instead of failing the run.
TARGETS: list[tuple[str, str, str]] = [
    ("transformers.modeling_utils", "PreTrainedModel.from_pretrained", "load_model"),
    ("transformers.modeling_utils", "PreTrainedModel.save_pretrained", "save_write"),
    ("transformers", "AutoTokenizer.from_pretrained", "load_tokenizer"),
    ("datasets", "Dataset.from_dict", "dataset"),
    # fused experts to per-expert Linears: the pipeline's own per-layer pass (right after
    # loading) and the one oneshot runs on a fused model
    ("quantize.model.moe", "linearize", "linearize"),
    ("llmcompressor.entrypoints.oneshot", "linearize_moe", "linearize"),
    ("llmcompressor.pipelines.sequential.pipeline", "trace_subgraphs", "trace"),
    ("llmcompressor.pipelines.sequential.helpers", "Subgraph.forward", "forward"),
    ("llmcompressor.pipelines.cache", "IntermediatesCache.from_dataloader", "act_cache_init"),
    ("llmcompressor.pipelines.cache", "IntermediatesCache.fetch", "act_fetch"),
    ("llmcompressor.pipelines.cache", "IntermediatesCache.update", "act_store"),
    ("llmcompressor.core.session_functions", "LifecycleCallbacks.calibration_start",
     "calibration_start"),
    ("llmcompressor.core.session_functions", "LifecycleCallbacks.calibration_end",
     "calibration_end"),
    ("llmcompressor.core.session_functions", "LifecycleCallbacks.sequential_epoch_end",
     "epoch_end"),
    ("llmcompressor.core.session", "CompressionSession.initialize", "session_init"),
    ("llmcompressor.core.session", "CompressionSession.finalize", "session_finalize"),
    ("llmcompressor.modifiers.gptq.base", "GPTQModifier.calibrate_module", "hessian"),
    ("llmcompressor.modifiers.gptq.base", "GPTQModifier.compress_modules", "gptq_solve"),
    ("llmcompressor.modifiers.transform.awq.base", "AWQModifier._apply_smoothing",
     "awq_search"),
    ("llmcompressor.modifiers.transform.smoothquant.base",
     "SmoothQuantModifier._apply_smoothing", "smoothquant_apply"),
    ("compressed_tensors.compressors.model_compressors.model_compressor",
     "ModelCompressor.compress_model", "compress"),
    # the pipeline's own work
    ("quantize.pipeline", "model_fingerprint", "q_model_hash"),
    # the main thread waiting for the background model hash (only what did not overlap)
    ("quantize.pipeline", "Pipeline.fingerprint", "q_model_hash"),
    ("quantize.run.stage", "hash_tree", "q_hash_outputs"),
    ("quantize.run.stage", "check_tree", "q_check_outputs"),
    ("quantize.pipeline", "write_manifest", "q_manifest"),
    ("quantize.pipeline", "check_architecture", "q_check_arch"),
    ("quantize.checks.preflight", "check", "q_preflight"),
    ("quantize.model.source", "check_model_dir", "q_check_model"),
    ("quantize.stages.calibrate", "run", "q_calibrate"),
    ("quantize.stages.calibrate", "load", "q_calib_load"),
    ("quantize.stages.export", "run", "q_export"),
    ("quantize.stages.export", "hash_tree", "q_hash_outputs"),
    ("quantize.backends._llmc_compat", "apply", "q_compat"),
]


def _resolve(module: str, path: str) -> tuple[Any, str, Any]:
    owner: Any = importlib.import_module(module)
    parts = path.split(".")
    for p in parts[:-1]:
        owner = getattr(owner, p)
    raw = owner.__dict__[parts[-1]] if isinstance(owner, type) else getattr(owner, parts[-1])
    return owner, parts[-1], raw


def install(prof: Prof) -> list[str]:
    """Wrap every target; return those that could not be found."""
    missing = []
    for module, path, region in TARGETS:
        try:
            owner, attr, raw = _resolve(module, path)
        except (ImportError, AttributeError, KeyError):
            missing.append(f"{module}:{path}")
            continue
        if isinstance(raw, classmethod):
            setattr(owner, attr, classmethod(prof.wrap(region, raw.__func__)))
        elif isinstance(raw, staticmethod):
            setattr(owner, attr, staticmethod(prof.wrap(region, raw.__func__)))
        elif not getattr(raw, "_bench_wrapped", False):
            setattr(owner, attr, prof.wrap(region, raw))
    _capture_gptq_losses(prof)
    return missing


def _capture_gptq_losses(prof: Prof) -> None:
    """Record each module's GPTQ loss: the evidence that a setting leaves quality alone."""
    try:
        base = importlib.import_module("llmcompressor.modifiers.gptq.base")
    except ImportError:
        return
    orig = getattr(base, "quantize_weight")  # noqa: B009 (a module attribute mypy cannot see)

    @functools.wraps(orig)
    def quantize_weight(*args: Any, **kwargs: Any) -> Any:
        out = orig(*args, **kwargs)
        losses = out[1]
        prof.gptq_losses.extend(float(x) for x in losses.reshape(-1).tolist())
        return out

    setattr(base, "quantize_weight", quantize_weight)  # noqa: B010


def hooks_report(prof: Prof) -> dict[str, Any]:
    out = prof.report()
    if prof.gptq_losses:
        out["gptq_losses"] = prof.gptq_losses
        out["gptq_loss_sum"] = sum(prof.gptq_losses)
    return out


def group_phases(phases: dict[str, float]) -> dict[str, float]:
    """Fold the fine regions into the phases the results table reports."""
    groups = {
        "load": ("load_model", "load_tokenizer"),
        "linearize": ("linearize",),
        "data": ("dataset", "q_calibrate", "q_calib_load", "tokenize"),
        "trace": ("trace",),
        "forward": ("forward",),
        "act_cache": ("act_cache_init", "act_fetch", "act_store"),
        "hessian/stats": ("hessian",),
        "solve/search": ("gptq_solve", "awq_search", "smoothquant_apply", "epoch_end",
                         "calibration_start", "calibration_end"),
        "init/finalize": ("session_init", "session_finalize"),
        "compress+save": ("compress", "save_write"),
        "pipeline": ("q_model_hash", "q_hash_outputs", "q_check_outputs", "q_manifest",
                     "q_preflight", "q_check_model", "q_check_arch", "q_export", "q_compat"),
    }
    out: dict[str, float] = defaultdict(float)
    seen = set()
    for group, names in groups.items():
        for n in names:
            if n in phases:
                out[group] += phases[n]
                seen.add(n)
    out["other"] = sum(v for k, v in phases.items() if k not in seen)
    return {k: round(v, 2) for k, v in out.items()}


def torch_profile_forward(path: str, skip: int = 40, count: int = 8) -> None:
    """Run the `count` layer forwards after the first `skip` under torch.profiler and append
    each one's table of kernels (by GPU time) to `path`: what the forward phase is made of."""
    import torch
    from llmcompressor.pipelines.sequential import helpers
    from torch.profiler import ProfilerActivity, profile

    orig = helpers.Subgraph.forward
    seen = [0]

    @functools.wraps(orig)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        n = seen[0]
        seen[0] += 1
        if not skip <= n < skip + count:
            return orig(self, *args, **kwargs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            out = orig(self, *args, **kwargs)
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        try:
            avg = p.key_averages()
            try:
                table = avg.table(sort_by="device_time_total", row_limit=25)
            except (KeyError, AttributeError, ValueError):
                table = avg.table(sort_by="cuda_time_total", row_limit=25)
        except Exception as exc:  # a profiler failure must not end the run
            table = f"profiler table failed: {exc!r}"
        with open(path, "a") as f:
            f.write(f"## layer forward call {n}: {wall * 1e3:.1f} ms wall (profiled)\n{table}\n")
        return out

    helpers.Subgraph.forward = forward
