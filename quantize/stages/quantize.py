"""quantize: run the recipe's engine on the model with the calibration set."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quantize.backends import QuantizeJob, get_backend
from quantize.progress import step

NAME = "quantize"


def run(job: QuantizeJob, out: Path) -> dict[str, Any]:
    backend = get_backend(job.recipe.backend)
    what = f"{job.recipe.method.upper()} {job.recipe.scheme}"
    if job.group_size:
        what += f" g{job.group_size}"
    with step(f"quantizing with {backend.name}: {what}, {len(job.samples)} calibration samples"
              f" on {job.device}"):
        return backend.quantize(job, out)
