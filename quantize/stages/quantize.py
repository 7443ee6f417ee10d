"""quantize: run the recipe's engine on the model with the calibration set."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Iterator
from pathlib import Path

from quantize.backends import QuantizeJob, get_backend
from quantize.progress import step
from quantize.recipe.methods import METHODS
from quantize.run.results import QuantizeSummary

NAME = "quantize"


def run(job: QuantizeJob, out: Path) -> QuantizeSummary:
    mixed = None
    if job.recipe.mixed_precision is not None:  # which layers get 8 bits, on this model
        from quantize.fit.mixed import allocate
        from quantize.stages.calibrate import fingerprint

        resident = job.placement == "resident" and job.host_tier == "ram"
        recipe, mixed = allocate(job.model_path, job.recipe, job.samples, job.device,
                                 resident, out / "mixed", fingerprint(job.samples))
        job = dataclasses.replace(job, recipe=recipe)
    backend = get_backend(job.recipe.backend)
    what = f"{METHODS[job.recipe.method].label} {job.recipe.scheme}"
    if job.group_size:
        what += f" g{job.group_size}"
    with step(f"quantizing with {backend.name}: {what}, {len(job.samples)} calibration samples"
              f" on {job.device}"), _log_write_errors_raise():
        summary = QuantizeSummary.model_validate(backend.quantize(job, out))
    summary.peak_rss_gib = peak_rss_gib()  # `quantize compare` shows it per engine
    if mixed is not None:
        summary.mixed = mixed
    return summary


@contextlib.contextmanager
def _log_write_errors_raise() -> Iterator[None]:
    """Engines add their log files through loguru (llm-compressor: <run>/logs/), which by
    default catches a failed write and prints a traceback to stderr for every later line: a
    full disk buried the one-line error under them. Log files added during the stage raise
    instead, so the stage stops and the error is one line (quantize.run.files.disk_error)."""
    try:
        from loguru import logger
    except ImportError:  # no engine that logs through loguru
        yield
        return
    logger.add = functools.partial(logger.add, catch=False)  # type: ignore[method-assign]
    try:
        yield
    finally:
        del logger.add  # the class's method again


def peak_rss_gib() -> float | None:
    """The largest resident memory of this process (or of a finished child, e.g. torchrun's)
    so far, in GiB: in a `quantize run`, the quantize stage's peak (calibration before it is
    small). None where the platform does not report it."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    kib = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
              resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    per_unit = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return round(kib * per_unit / 2**30, 2)
