"""The stages of a run, each declared once: its name (the run folder's subfolder, the manifest
key, the CLI command and the Makefile target), what it does in one line (the command's help),
how it is wired (its inputs and execute: quantize.pipeline.wiring) and what it writes before it
runs (the disk pre-check: quantize.pipeline.disk). The pipeline runs them in this order, the
CLI and `--rerun` list them from here, and tests/unit/pipeline/test_stages.py checks that each
has its command and Makefile target. Adding a stage is one entry here, its wiring function,
its disk function and its stage module (quantize/stages/<name>.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import quantize.pipeline.disk as disk
import quantize.pipeline.wiring as wiring
from quantize.checks.resources import DiskNeed
from quantize.errors import QuantizeError


@dataclass(frozen=True)
class Stage:
    name: str
    help: str
    plan: Callable[[wiring.PipelineView], wiring.Plan]
    disk: Callable[[disk.DiskContext], list[DiskNeed]]
    # the CLI command takes a RECIPE (and runs every stage up to this one) or a RUN folder
    # (continues that run up to this one)
    takes: Literal["recipe", "run"] = "recipe"


PIPELINE: tuple[Stage, ...] = (
    Stage("calibrate", "Build the tokenized, fingerprinted calibration set for RECIPE.",
          wiring.calibrate, disk.calibrate_disk),
    Stage("quantize", "Calibrate (if needed) and quantize with the recipe's engine.",
          wiring.quantize, disk.quantize_disk),
    Stage("export", "Everything up to the vLLM-loadable checkpoint in <run>/export.",
          wiring.export, disk.export_disk),
    Stage("eval", "Perplexity and accuracy of RUN_DIR's export vs its baseline, with recovery "
          "per metric (runs the stages before it first if they are not finished). RUN_DIR may "
          "also be an export folder on its own: it is then evaluated and gated, reports in "
          "--out.", wiring.eval, disk.eval_disk, takes="run"),
    Stage("gate", "Exit 0 when every blocking threshold holds for RUN_DIR, else 3 with the "
          "table.", wiring.gate, disk.gate_disk, takes="run"),
)


def names() -> tuple[str, ...]:
    return tuple(st.name for st in PIPELINE)


def upto(name: str) -> tuple[Stage, ...]:
    """The stages a run up to `name` goes through, in order."""
    order = names()
    if name not in order:
        raise QuantizeError(problem=f"unknown stage {name!r}",
                            hint=f"use one of {', '.join(order)}")
    return PIPELINE[: order.index(name) + 1]
