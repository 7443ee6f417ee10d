"""`quantize plan`: which recipe lets a model serve a context to N users on given GPUs.

For each recipe (and the unquantized baseline) the planner computes, from config.json alone:

* weight memory, per tensor, in the compressed-tensors format the export stage writes
  (planner/weights.py);
* KV-cache bytes per token for GQA/MQA/MHA, MLA and sliding-window layers (planner/kv.py);
* vLLM's KV budget: the card's share minus weights, the profile run's activation peak and
  non-torch memory, with constants calibrated against published vLLM start-up logs
  (planner/memory.py);
* KV tokens in whole blocks and the largest concurrency at the requested context, then the
  recommendation (planner/rows.py, planner/recommend.py).

KV memory grows linearly with context length and with concurrency: bytes = per-token bytes x
tokens x sequences. Nothing in it is quadratic (attention *compute* is, the cache is not).

This module is the planner's entry point: `make_plan` for `quantize plan`, and the names the
tests and other commands use, re-exported from the modules that define them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from quantize.errors import PlanError
from quantize.model.config import Shape, model_shape
from quantize.planner.kv import BLOCK, kv_bytes_per_token, kv_description, request_bytes
from quantize.planner.levers import Lever, boundary, levers, margin
from quantize.planner.memory import (
    CONTEXT_GIB,
    CUDAGRAPH_GIB,
    GIB,
    PROFILES,
    Memory,
    predict,
    serve_defaults,
    vllm_memory,
)
from quantize.planner.recommend import Row, gpu_support, recommend, recommendable
from quantize.planner.rows import BASELINE, TP_CANDIDATES, PlanRequest, RowBuilder
from quantize.planner.sources import CONFIGS, ModelSource, find_runs, load_source
from quantize.planner.speed import SpeedRow, describe
from quantize.planner.weights import (
    LayerPlan,
    WeightFormat,
    estimate_weights,
    format_for,
    linear_bytes,
    meta,
    recipe_layers,
)

__all__ = [
    "BLOCK", "CONFIGS", "GIB", "TP_CANDIDATES", "LayerPlan", "Memory", "Plan", "PlanRequest",
    "Row", "Shape", "WeightFormat", "estimate_weights", "format_for", "gpu_support",
    "kv_bytes_per_token", "kv_description", "linear_bytes", "load_source", "make_plan", "meta",
    "model_shape", "predict", "recipe_layers", "request_bytes", "vllm_memory",
]


@dataclass
class Plan:
    request: PlanRequest
    source: ModelSource
    shape: Shape
    rows: list[Row]
    recommendation: Row | None
    recommendation_kind: str  # "fits" | "partial" | "none"
    batched: int
    notes: list[str]
    kv_model: str
    hints: list[str] = field(default_factory=list)
    levers: list[Lever] = field(default_factory=list)  # for `lever_row` (planner.levers)
    lever_row: Row | None = None
    speed: list[SpeedRow] = field(default_factory=list)  # the recommendation's, measured

    def to_dict(self) -> dict[str, Any]:
        """The `--json` document."""
        req = self.request
        return {
            "model": {"spec": req.model, "name": self.source.name, "origin": self.source.origin,
                      "architecture": asdict(self.shape)},
            "gpu": req.gpu.model_dump(),
            "gpus": req.gpus, "context": req.context, "concurrency": req.concurrency,
            "gpu_memory_utilization": req.util, "max_num_batched_tokens": self.batched,
            "max_num_seqs": req.seqs, "cpu_offload_gb": req.cpu_offload_gib,
            "enforce_eager": req.enforce_eager, "vllm_profile": asdict(PROFILES[req.profile]),
            "kv_model": self.kv_model,
            "rows": [_row_dict(r, req.concurrency) for r in self.rows],
            "recommendation": _row_dict(self.recommendation, req.concurrency)
            if self.recommendation else None,
            "recommendation_kind": self.recommendation_kind,
            "boundary": boundary(self.recommendation.memory, req.concurrency)
            if self.recommendation else None,
            "levers": {"row": self.lever_row.recipe if self.lever_row else None,
                       "options": [asdict(lv) for lv in self.levers]},
            "measured_speed": [r.model_dump() for r in self.speed],
            "hints": self.hints,
            "notes": self.notes,
        }


def _row_dict(row: Row, concurrency: int) -> dict[str, Any]:
    d = asdict(row)
    if row.memory is not None:
        d["memory"]["max_sequences"] = row.memory.max_sequences
        d["margin"] = margin(row.memory, concurrency)
    return d


def _recipe_list(names: Iterable[str]) -> list[str]:
    from quantize.recipe.recipe import available

    out: list[str] = []
    for name in names:
        for part in (p.strip() for p in name.split(",")):
            if part == "all":
                out.extend(available("recipes"))
            elif part and part != BASELINE:
                out.append(part)
    return list(dict.fromkeys(out))


def make_plan(req: PlanRequest) -> Plan:
    from quantize.recipe.recipe import load_recipe

    if req.profile not in PROFILES:
        raise PlanError(problem=f"unknown vLLM profile {req.profile!r}",
                        hint=f"known: {', '.join(PROFILES)}")
    if not 0.05 <= req.util <= 1.0:
        raise PlanError(problem=f"--gpu-memory-utilization {req.util} is outside (0.05, 1]",
                        hint="vLLM takes a fraction of the card, e.g. 0.9")
    if req.gpus < 1 or req.context < 1 or req.concurrency < 1:
        raise PlanError(problem="--gpus, --max-model-len and --concurrency must be positive")
    source = load_source(req.model)
    model = meta(source.config)
    shape = model_shape(source.config, model.config)
    profile = PROFILES[req.profile]
    t_default, _ = serve_defaults(req.gpu)
    batched = max(req.max_num_batched_tokens or t_default, req.seqs)
    runs = find_runs(req.runs_dir, source.name, req.model)
    if source.run is not None:
        runs = [source.run, *[r for r in runs if r.path != source.run.path]]
    builder = RowBuilder(req, source, model, shape, profile, batched, runs)
    rows = [builder.baseline()]
    for name in _recipe_list(req.recipes):
        rows.append(builder.recipe_row(load_recipe(name)))
    rec, kind = recommend(rows)
    notes = builder.notes + _general_notes(req, shape, batched)
    kv_model = kv_description(shape, req.gpus, "the recipe's (model dtype unless fp8)")
    lever_row = rec if rec is not None and kind == "fits" else _closest(rows)
    inputs = builder.lever_inputs(lever_row) if lever_row is not None else None
    speed = builder.speed(rec) if rec is not None else []
    found = levers(lever_row, inputs, req.concurrency) if lever_row and inputs else []
    if lever_row is rec and rec is not None:
        found += [Lever(f"--linear-backend {r.linear_backend}", describe([r])[0], None)
                  for r in speed if r.linear_backend]
    return Plan(req, source, shape, rows, rec, kind, batched, list(dict.fromkeys(notes)),
                kv_model, builder.hints(rows, rec, kind), found,
                lever_row if inputs else None, [r for r in speed if not r.linear_backend])


def _closest(rows: list[Row]) -> Row | None:
    """The row nearest to serving everyone when none does: the most sequences (then the most
    accurate), among rows whose kernels run on the GPU and whose weights fit."""
    near = [r for r in rows if r.memory is not None and r.status in ("partial", "no-kv")
            and recommendable(r)]
    return max(near, key=lambda r: (r.memory.max_concurrency if r.memory else 0, r.accuracy),
               default=None)


def _general_notes(req: PlanRequest, shape: Shape, batched: int) -> list[str]:
    notes = []
    gpu = req.gpu
    head = req.util * gpu.memory_gib + (0 if req.enforce_eager else CUDAGRAPH_GIB) + CONTEXT_GIB
    if head > gpu.memory_gib:
        outside = gpu.memory_gib * (1 - req.util)
        notes.append(f"--gpu-memory-utilization {req.util} leaves {outside:.2f} GiB outside "
                     f"vLLM's budget, less than the ~{CUDAGRAPH_GIB + CONTEXT_GIB:.1f} GiB of CUDA "
                     "graphs and CUDA context that live there: start-up may run out of memory; "
                     "lower it")
    if shape.max_position and req.context > shape.max_position:
        notes.append(f"--max-model-len {req.context} exceeds the model's max_position_embeddings "
                     f"({shape.max_position}); vLLM refuses it unless you override the limit")
    return notes
