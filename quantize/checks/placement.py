"""Where the weights live while llm-compressor calibrates, and how to load them that way.

quantize.checks.resources picks the GPU tier from its estimate (resident: the whole model on the
GPU; onload / onload+offload: weights in host memory, llm-compressor's sequential pipeline
onloads one decoder layer at a time). This module adds the host tier under it:

    ram    the weights (that are not resident on the GPU) sit in host RAM
    disk   host RAM is short: as many weights as fit stay in RAM, the rest go to an offload
           folder on disk and are read back layer by layer (compressed-tensors' DiskCache)

and turns the tiers and the number of processes into `from_pretrained` arguments, the way
llm-compressor 0.14 / compressed-tensors 0.19 load models (docs: guides/big_models_and_
distributed/model_loading.md): `device_map="auto_offload"` (host RAM first, then disk) under
`compressed_tensors.offload.load_offloaded_model`, which with several processes loads on rank 0
only and shares the weights (host tensors in shared memory, GPU tensors broadcast).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from quantize.errors import NotImplementedFeature, PlacementError

GiB = 2**30
# Kept free when weights spill to disk: the engine's per-layer caches, one layer read back
# from disk and save staging need room beside the weights held in RAM. A judgement, not a
# measurement (no host here is short of RAM for a model that can be tested).
DISK_RESERVE_FRACTION = 0.15
DISK_RESERVE_MIN = 4 * GiB


@dataclass(frozen=True)
class HostPlan:
    tier: str  # "ram" | "disk"
    need: int  # bytes of host RAM the work needs with everything in RAM
    free: int  # bytes of host RAM (shared memory with several processes) available
    cpu_budget: int | None = None  # with "disk": bytes of weights to keep in RAM
    disk_bytes: int = 0  # with "disk": bytes of weights expected on disk

    def facts(self) -> dict[str, str | float | None]:
        out: dict[str, str | float | None] = {"host_tier": self.tier,
                               "host_ram_needed_gib": round(self.need / GiB, 2),
                               "host_ram_free_gib": round(self.free / GiB, 2)}
        if self.tier == "disk":
            out |= {"host_cpu_budget_bytes": self.cpu_budget,
                    "disk_offload_gib": round(self.disk_bytes / GiB, 2)}
        return out


def choose_host(need: int, weights: int, free: int, disk_free: int) -> HostPlan:
    """RAM when the whole need fits in `free`; else the weights that do not fit go to disk.

    `need` is the host RAM estimate with every weight in RAM (quantize.checks.resources), `weights`
    the weights' share of it, `free` the RAM available (with several processes: the smaller of
    free RAM and free shared memory, where compressed-tensors puts the one shared copy).
    """
    if need <= free:
        return HostPlan("ram", need, free)
    reserve = max(DISK_RESERVE_MIN, int(free * DISK_RESERVE_FRACTION))
    budget = free - reserve
    if budget <= 0:
        raise PlacementError(
            problem=f"quantizing needs about {need / GiB:.1f} GiB of host RAM and only "
                    f"{free / GiB:.1f} GiB is free, too little even to offload weights to disk "
                    f"(it keeps {reserve / GiB:.1f} GiB for the engine)",
            hint="close other programs or use a machine with more memory")
    spill = max(0, weights - budget)
    if spill * 1.1 > disk_free:
        raise PlacementError(
            problem=f"host RAM is short ({free / GiB:.1f} GiB free, about {need / GiB:.1f} GiB "
                    f"needed) and offloading the rest to disk needs about "
                    f"{spill * 1.1 / GiB:.1f} GiB where {disk_free / GiB:.1f} GiB is free",
            hint="free disk space in the run folder's file system or use a machine with more "
                 "memory")
    return HostPlan("disk", need, free, cpu_budget=budget, disk_bytes=spill)


def shm_free() -> int | None:
    """Free bytes of /dev/shm, where compressed-tensors shares host weights across ranks."""
    if not os.path.isdir("/dev/shm"):
        return None
    return int(shutil.disk_usage("/dev/shm").free)


def host_plan(need: int, weights: int, free: int, world_size: int,
              offload_dir: Path) -> HostPlan:
    """choose_host with `free` RAM, and this machine's shared memory and disk."""
    if world_size > 1:
        shm = shm_free()
        if shm is not None:
            free = min(free, shm)
    return choose_host(need, weights, free, disk_free_bytes(offload_dir))


def disk_free_bytes(folder: Path) -> int:
    """Free bytes on the file system that holds (or will hold) `folder`."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return int(shutil.disk_usage(folder).free)


# --- loading -----------------------------------------------------------------------------
class LoadArgs(TypedDict, total=False):
    """transformers' from_pretrained keyword arguments a placement sets."""

    device_map: str | None
    max_memory: dict[str, int]
    offload_folder: str


@dataclass(frozen=True)
class Load:
    """How to call from_pretrained: under load_offloaded_model or not, with these kwargs."""

    offloaded_context: bool
    kwargs: LoadArgs
    where: str  # one line for the console and the manifest


def load_plan(device: str, gpu_placement: str, host: str, world_size: int,
              cpu_budget: int | None, offload_dir: Path | None) -> Load:
    """from_pretrained arguments for a placement (pure, so every combination is tested).

    One process: resident on a GPU is `device_map="cuda"`; weights in RAM are
    `device_map=None` (llm-compressor's sequential pipeline onloads layers to the GPU).
    Several processes always load through load_offloaded_model: rank 0 reads the checkpoint,
    the others start on the meta device and receive it (GPU replicas by broadcast, host
    weights as one copy in shared memory). Disk: "auto_offload", RAM up to the budget.
    """
    dist = world_size > 1
    gpu = device != "cpu"
    if host == "disk" and not (gpu and gpu_placement == "resident"):
        if dist and not gpu:
            # fp32 calibration is cast back to 16 bits before saving, which replaces each
            # offloaded tensor; the ranks share the offload files, so they would delete them
            # under each other's feet
            raise NotImplementedFeature(
                problem=f"--gpus {world_size} on CPU with weights offloaded to disk (host RAM "
                        "is short) is not supported",
                hint="run on one process (drop --gpus) or on GPUs")
        if cpu_budget is None or offload_dir is None:
            raise ValueError("disk offload needs a cpu budget and an offload folder")
        return Load(True, {"device_map": "auto_offload", "max_memory": {"cpu": cpu_budget},
                           "offload_folder": str(offload_dir)},
                    f"host RAM up to {cpu_budget / GiB:.1f} GiB, the rest on disk "
                    f"({offload_dir})" + (", onloaded layer by layer to the GPU" if gpu else ""))
    if gpu and gpu_placement == "resident":
        return Load(dist, {"device_map": "cuda"},
                    "whole model on the GPU" + (" (a replica on each)" if dist else ""))
    where = "host RAM" + (" (one copy in shared memory)" if dist else "")
    if gpu:
        where += ", onloaded layer by layer to the GPU"
    if not dist:
        return Load(False, {"device_map": None}, where)
    # an explicit budget: without one, load_offloaded_model asks torch.accelerator for device
    # memory, which raises on a machine without an accelerator
    kwargs: LoadArgs = {"device_map": "cpu"}
    if cpu_budget:
        kwargs["max_memory"] = {"cpu": cpu_budget}
    return Load(True, kwargs, where)
