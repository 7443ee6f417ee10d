"""Data-parallel calibration: the quantize stage under `torchrun`, with llm-compressor's own
DDP support (no scheduler of ours).

The parent process writes the job to a JSON file and runs

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        -m quantize.backends._ddp_worker JOB.json

Every rank loads the model through compressed-tensors' `load_offloaded_model` (rank 0 reads
the checkpoint, the others receive it), takes a contiguous slice of the calibration samples
and runs `oneshot`; llm-compressor's modifiers synchronise across ranks (GPTQ: each rank
accumulates Hessians on its slice, they are reduced to the rank that solves each module, and
the results are broadcast; AWQ / SmoothQuant / observers: all-reduced statistics). Every rank
calls `save_pretrained`, which writes on rank 0 only, into the stage's `.partial` folder; the
pipeline renames it into place after the launcher returns, as for one process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from quantize.backends import QuantizeJob
from quantize.errors import NotImplementedFeature, QuantizationError, QuantizeError
from quantize.recipe.recipe import Recipe

# Which recipes llm-compressor 0.14.0.1 calibrates data-parallel, per device, and why not.
# GPU (NCCL): GPTQModifier (weight-parallel solve, modifiers/gptq/base.py compress_modules),
# AWQModifier (all-reduced activation sums and losses, modifiers/transform/awq/base.py),
# SmoothQuantModifier (all-reduced min/max, smoothquant/base.py), QuantizationModifier
# (observer statistics all-reduced, weight qparams split, quantization/base.py).
GPU_METHODS = ("gptq", "awq", "rtn")
# CPU (gloo, for tests): only what was checked bit for bit against one process here.
CPU_METHODS = ("gptq",)
_CPU_WHY = {
    "awq": "llm-compressor's AWQ all-reduce moves its statistics to an accelerator "
           "(awq/base.py _allreduce_data_sum) and fails without one",
    "rtn": "not checked on CPU against one process",
    "smoothquant": "on CPU all ranks share one copy of the weights in shared memory and "
                   "SmoothQuant rescales it in place on every rank",
}
# A rank may wait this long at a collective while another solves its modules.
TIMEOUT_S = 4 * 3600


def check_support(recipe: Recipe, device: str, world_size: int,
                  visible_gpus: int | None = None) -> None:
    """Refuse, before any calibration, what cannot run data-parallel; one line each."""
    if world_size < 1:
        raise QuantizeError(problem=f"--gpus {world_size} is not positive",
                            hint="give a positive number of GPUs")
    if world_size == 1:
        return
    if recipe.backend != "llmcompressor":
        raise NotImplementedFeature(
            problem=f"--gpus {world_size}: backend {recipe.backend} has no distributed "
                    "calibration here",
            hint="only backend llmcompressor runs data-parallel (drop --gpus, or use a recipe "
                 "with backend: llmcompressor)")
    if not recipe.needs_calibration:
        raise NotImplementedFeature(
            problem=f"recipe {recipe.name} needs no calibration data, so --gpus {world_size} "
                    "has nothing to split across processes",
            hint="drop --gpus (distributed calibration serves recipes that calibrate: gptq, "
                 "awq, and rtn with static activation or KV-cache scales)")
    if device != "cpu":
        if visible_gpus is not None and world_size > visible_gpus:
            raise QuantizeError(
                problem=f"--gpus {world_size} but {visible_gpus} CUDA GPU(s) are visible",
                hint=f"use --gpus {max(visible_gpus, 1)} or fewer, or check "
                     "CUDA_VISIBLE_DEVICES")
        if recipe.method not in GPU_METHODS:
            raise NotImplementedFeature(
                problem=f"method {recipe.method} has no distributed calibration in "
                        "llm-compressor",
                hint=f"--gpus supports {', '.join(GPU_METHODS)}")
        return
    problem = _CPU_WHY["smoothquant"] if recipe.smoothquant is not None else (
        None if recipe.method in CPU_METHODS else _CPU_WHY.get(recipe.method, "unsupported"))
    if problem:
        what = "smoothquant" if recipe.smoothquant is not None else f"method {recipe.method}"
        raise NotImplementedFeature(
            problem=f"--gpus {world_size} on CPU (gloo) supports method "
                    f"{', '.join(CPU_METHODS)} without smoothquant; {what}: {problem}",
            hint="use a GPU machine, or drop --gpus")


def check_samples(n: int, world_size: int) -> None:
    if world_size > 1 and n < world_size:
        raise QuantizeError(
            problem=f"--gpus {world_size} needs at least {world_size} calibration samples "
                    f"(one per process) and the set has {n}",
            hint="raise num_samples in the calibration spec or use fewer GPUs")


def partition(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """Contiguous slice [start, end) of n samples for a rank, sizes differing by at most one
    (the split llm-compressor's datasets/utils.py get_rank_partition makes)."""
    return n * rank // world_size, n * (rank + 1) // world_size


def shares(n: int, world_size: int) -> list[int]:
    """How many of n samples each rank calibrates on."""
    return [b - a for a, b in (partition(n, r, world_size) for r in range(world_size))]


# --- the job file ------------------------------------------------------------------------
def job_to_dict(job: QuantizeJob, out: Path) -> dict[str, Any]:
    return {"model_path": str(job.model_path), "recipe": job.recipe.model_dump(mode="json"),
            "group_size": job.group_size, "samples": job.samples, "device": job.device,
            "batch_size": job.batch_size, "placement": job.placement,
            "world_size": job.world_size, "host_tier": job.host_tier,
            "cpu_budget": job.cpu_budget,
            "offload_dir": str(job.offload_dir) if job.offload_dir else None,
            "out": str(out)}


def job_from_dict(d: dict[str, Any]) -> tuple[QuantizeJob, Path]:
    job = QuantizeJob(Path(d["model_path"]), Recipe.model_validate(d["recipe"]),
                      d["group_size"], d["samples"], d["device"], d["batch_size"],
                      placement=d["placement"], world_size=d["world_size"],
                      host_tier=d["host_tier"], cpu_budget=d["cpu_budget"],
                      offload_dir=Path(d["offload_dir"]) if d["offload_dir"] else None)
    return job, Path(d["out"])


# --- the launcher ------------------------------------------------------------------------
def torchrun_command(world_size: int, job_file: Path) -> list[str]:
    # --standalone: a private rendezvous on a free local port, so two runs cannot collide
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(world_size), "-m", "quantize.backends._ddp_worker",
            str(job_file)]


def _child_env(job: QuantizeJob) -> dict[str, str]:
    env = dict(os.environ)
    # torchrun sets OMP_NUM_THREADS=1 for every rank; on CPU share the cores instead
    if job.device == "cpu" and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // job.world_size))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def launch(job: QuantizeJob, out: Path) -> dict[str, Any]:
    """Run the job on `job.world_size` processes; rank 0 writes the checkpoint into `out`."""
    log_dir = out.parent / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / "torchrun.log"
    with tempfile.TemporaryDirectory(prefix="quantize-ddp-") as tmp:
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps(job_to_dict(job, out)))
        t0 = time.perf_counter()
        if job.offload_dir is not None:  # what a killed run left behind
            shutil.rmtree(job.offload_dir, ignore_errors=True)
        try:
            with log.open("w") as f:
                rc = subprocess.run(torchrun_command(job.world_size, job_file), stdout=f,
                                    stderr=subprocess.STDOUT, env=_child_env(job)).returncode
        finally:
            if job.offload_dir is not None:  # a copy of the weights: never left behind
                shutil.rmtree(job.offload_dir, ignore_errors=True)
        result_file = Path(tmp) / "result.json"
        if rc != 0 or not result_file.is_file():
            raise _failure(Path(tmp), rc, log)
        summary: dict[str, Any] = json.loads(result_file.read_text())
    summary["torchrun_s"] = round(time.perf_counter() - t0, 1)
    return summary


def _failure(tmp: Path, rc: int, log: Path) -> QuantizationError:
    """The first failing rank's own error line (each rank writes error-<rank>.json)."""
    errors = [json.loads(p.read_text()) for p in tmp.glob("error-*.json")]
    if errors:  # the first to fail is the cause; the others lost their peer
        e = min(errors, key=lambda x: x["time"])
        return QuantizationError(problem=f"distributed quantization failed on rank {e['rank']}: "
                                 f"{e['error']} (all ranks' output: {log})")
    return QuantizationError(problem=f"distributed quantization failed (torchrun exit status "
                             f"{rc}) before any rank reported an error", hint=f"see {log}")


def visible_gpus(device: str) -> int | None:
    if device == "cpu":
        return None
    import torch

    return int(torch.cuda.device_count())
