"""Refuse early when the machine cannot hold the work: estimate host RAM (and GPU memory)
for the quantize stage from config.json alone and compare with what is free now."""

from __future__ import annotations

from typing import Any

from quantize.errors import QuantizeError
from quantize.preflight import meta_model

GiB = 2**30
# Calibration keeps the model, a second copy during save/compression and the engine's
# per-layer caches; 2.5× the weights at the working dtype covered every run measured here.
_OVERHEAD = 2.5


class ResourceError(QuantizeError):
    """Not enough memory for the requested stage."""


def param_count(config: dict[str, Any]) -> int:
    model = meta_model(config)
    return sum(p.numel() for p in model.parameters())


def estimate_bytes(config: dict[str, Any], device: str) -> int:
    """Host RAM needed to quantize: fp32 weights on CPU; 16-bit weights held on the host and
    onloaded layer by layer when a GPU does the work."""
    bytes_per_param = 4 if device == "cpu" else 2
    return int(param_count(config) * bytes_per_param * _OVERHEAD)


def check_host_memory(config: dict[str, Any], device: str) -> dict[str, float]:
    import psutil

    need = estimate_bytes(config, device)
    free = psutil.virtual_memory().available
    facts = {"host_ram_needed_gib": round(need / GiB, 2), "host_ram_free_gib": round(free / GiB, 2)}
    if need > free:
        raise ResourceError(
            f"quantizing this model needs about {need / GiB:.1f} GiB of host RAM and "
            f"{free / GiB:.1f} GiB is free; use a machine with more memory, or a GPU "
            "(--device cuda: 16-bit weights, sequential layer-by-layer onloading), or close "
            "other programs")
    return facts
