"""The rows of a plan: each recipe (and the baseline) sized, fitted on the requested GPUs,
tried at larger tensor-parallel sizes, and given its `vllm serve` command."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantize.errors import PreflightError
from quantize.model.config import Shape
from quantize.planner.gpus import Gpu
from quantize.planner.kv import kv_bytes_per_token
from quantize.planner.levers import LeverInputs
from quantize.planner.memory import (
    DEFAULT_PROFILE,
    GIB,
    Memory,
    VllmProfile,
    resident_extra,
    vllm_memory,
)
from quantize.planner.recommend import (
    Row,
    gpu_support,
    prior_recovery,
    recommendable,
    support_level,
    tp_problem,
)
from quantize.planner.sources import ModelSource, RunInfo
from quantize.planner.speed import SpeedRow, measured
from quantize.planner.weights import (
    LayerPlan,
    WeightEstimate,
    estimate_weights,
    published_layers,
    published_quant,
    recipe_layers,
)
from quantize.recipe.recipe import Recipe
from quantize.recipe.schemes import SCHEMES

TP_CANDIDATES = (1, 2, 4, 8)
BASELINE = "none"


@dataclass
class PlanRequest:
    model: str
    gpu: Gpu
    gpus: int = 1
    context: int = 32768
    concurrency: int = 16
    recipes: list[str] = field(default_factory=lambda: ["all"])
    util: float = 0.9
    kv_cache_dtype: str = "auto"  # auto: the recipe's (fp8 for kv_cache: fp8), else model dtype
    max_num_batched_tokens: int | None = None
    runs_dir: Path = Path("runs")
    profile: str = DEFAULT_PROFILE
    # levers (`vllm serve` flags): weights kept in host memory, the scheduler's sequence limit
    # (default: --concurrency), no CUDA graphs
    cpu_offload_gib: float = 0.0
    max_num_seqs: int | None = None
    enforce_eager: bool = False

    @property
    def seqs(self) -> int:
        return self.max_num_seqs or self.concurrency


@dataclass
class RowBuilder:
    """Everything the rows of one plan share: the request, the model (meta device) and its
    shape, the profile, the batch size and the runs found; collects notes as rows are made."""

    req: PlanRequest
    source: ModelSource
    model: Any  # the meta-device transformers model
    shape: Shape
    profile: VllmProfile
    batched: int
    runs: list[RunInfo]
    notes: list[str] = field(default_factory=list)
    loaded: dict[str, Recipe] = field(default_factory=dict)

    def hints(self, rows: list[Row], rec: Row | None, kind: str) -> list[str]:
        """What would make the request fit: fp8 KV for the chosen recipe, more GPUs."""
        out = []
        if rec is not None and kind == "partial" and rec.kv_dtype != "fp8":
            est = self._estimate(self.loaded.get(rec.recipe))
            if est is not None:
                mem = vllm_memory(self.shape, self._resident(est, self.req.gpus), self.req.gpu,
                                  self.req.gpus, self.req.util, self.req.context, self.batched,
                                  self.req.seqs, 1, self.profile, self.req.cpu_offload_gib,
                                  self.req.enforce_eager)
                out.append(f"--kv-cache-dtype fp8 halves the KV bytes: {rec.recipe} would hold "
                           f"{mem.max_sequences} sequences at TP={self.req.gpus}")
        full = [r for r in rows if r.min_tp and recommendable(r)]
        if kind != "fits" and full:
            best = min(full, key=lambda r: (r.min_tp or 0, -r.accuracy))
            out.append(f"{best.recipe} serves all {self.req.concurrency} sequences with "
                       f"--gpus {best.min_tp} ({best.min_tp_sequences} fit there)")
        elif kind != "fits":
            out.append(f"no recipe serves {self.req.concurrency} x {self.req.context:,} tokens "
                       f"on up to {TP_CANDIDATES[-1]} x {self.req.gpu.name}; lower "
                       "--max-model-len or --concurrency")
        return out

    def _group(self, recipe: Recipe) -> int | None:
        """The recipe's resolved group size; PreflightError when it does not apply."""
        from quantize.model.layers import resolve_group_size, targeted_layers

        layers = targeted_layers(self.model, recipe.targets, recipe.ignore)
        if not layers:
            raise PreflightError(problem="the recipe's targets match no layer of this model")
        return resolve_group_size(recipe, layers)

    def _estimate(self, recipe: Recipe | None) -> WeightEstimate | None:
        if recipe is None:
            return estimate_weights(self.model, self.shape.dtype_bytes, self._baseline_plan()[0])
        try:
            group = self._group(recipe)
        except PreflightError:
            return None
        return estimate_weights(self.model, self.shape.dtype_bytes,
                                recipe_layers(self.model, recipe, group, self.shape.dtype_bytes))

    def kv_dtype(self, recipe: Recipe | None) -> tuple[str, int]:
        if self.req.kv_cache_dtype == "fp8" or (recipe is not None and recipe.kv_cache == "fp8"):
            return "fp8", 1
        return "auto (model dtype)", self.shape.dtype_bytes

    def _baseline_plan(self) -> tuple[LayerPlan, str]:
        qc = published_quant(self.source.config)
        if qc is not None:
            return published_layers(self.model, qc)
        return LayerPlan({}, None), f"unquantized ({self.shape.dtype_bytes * 8}-bit)"

    def baseline(self) -> Row:
        plan, label = self._baseline_plan()
        est = estimate_weights(self.model, self.shape.dtype_bytes, plan)
        return self._row(BASELINE, label, None, est, "estimated from config.json", None, None)

    def recipe_row(self, recipe: Recipe) -> Row:
        self.loaded[recipe.name] = recipe
        info = SCHEMES[recipe.scheme]
        label = f"{recipe.method} {recipe.scheme}" + (" +kv-fp8" if recipe.kv_cache else "")
        try:
            group = self._group(recipe)
        except PreflightError as exc:
            return self._na(recipe, label, f"recipe does not apply: {exc}")
        est = estimate_weights(self.model, self.shape.dtype_bytes,
                               recipe_layers(self.model, recipe, group, self.shape.dtype_bytes))
        run = next((r for r in self.runs if r.recipe == recipe.name), None)
        weights_source = "estimated from config.json"
        if run is not None and run.weights_bytes:
            est = WeightEstimate(run.weights_bytes, int(est.replicated * run.weights_bytes
                                                        / max(est.total, 1)), est.quantized)
            weights_source = f"exported size of {run.path}"
        label += f" g{group}" if group and info.group else ""
        return self._row(recipe.name, label, recipe, est, weights_source, run, group)

    def _na(self, recipe: Recipe, label: str, reason: str) -> Row:
        return Row(recipe.name, label, "-", 0, "-", prior_recovery(recipe), "prior", "n/a",
                   reason, None, None, None, "", None, None,
                   support=support_level(recipe, self.req.gpu, bool(self.shape.experts)))

    def _row(self, name: str, label: str, recipe: Recipe | None, est: WeightEstimate,
             weights_source: str, run: RunInfo | None, group: int | None) -> Row:
        req, shape = self.req, self.shape
        kv_name, kv_bytes = self.kv_dtype(recipe)
        accuracy, acc_source = prior_recovery(recipe), "prior"
        if recipe is None:
            acc_source = "baseline"
        elif run is not None and run.recovery is not None:
            accuracy, acc_source = run.recovery, f"measured ({run.path}/gate/gate.json)"
        if run is not None and run.gate_note:
            self.notes.append(run.gate_note)
        supported, gpu_note = gpu_support(recipe, req.gpu, bool(shape.experts))
        memory, status, reason = self._fit(est, kv_bytes, req.gpus, group)
        if not supported:
            status, reason = "unsupported", gpu_note
        min_tp, min_seq = self._min_tp(est, kv_bytes, group) if supported else (None, None)
        by_dtype = {"auto": kv_bytes_per_token(shape, req.gpus, shape.dtype_bytes),
                    "fp8": kv_bytes_per_token(shape, req.gpus, 1)}
        level = support_level(recipe, req.gpu, bool(shape.experts))
        quantized_acts = recipe is not None and SCHEMES[recipe.scheme].activations != "none"
        row = Row(name, label, kv_name, est.total, weights_source, accuracy, acc_source, status,
                  reason, memory, min_tp, min_seq, gpu_note,
                  run.gate_verdict if run else None, None, by_dtype, level,
                  level == "native" and quantized_acts)
        if status in ("fits", "partial"):
            row.serve = self._serve(recipe, run, kv_bytes)
        return row

    def _fit(self, est: WeightEstimate, kv_bytes: int, tp: int,
             group: int | None) -> tuple[Memory | None, str, str]:
        req = self.req
        problem = tp_problem(self.shape, tp, group)
        if problem:
            return None, "no-fit", f"TP={tp} impossible: {problem}"
        mem = vllm_memory(self.shape, self._resident(est, tp), req.gpu, tp, req.util, req.context,
                          self.batched, req.seqs, kv_bytes, self.profile, req.cpu_offload_gib,
                          req.enforce_eager)
        if mem.weights >= mem.requested:
            return mem, "no-fit", (f"weights need {mem.weights / GIB:.1f} GiB per GPU, the "
                                   f"budget is {mem.requested / GIB:.1f} GiB")
        if mem.max_concurrency < 1:
            return mem, "no-kv", (f"room for {mem.kv_tokens:,} KV tokens, less than one "
                                  f"{req.context:,}-token sequence: vLLM refuses to start")
        if mem.max_sequences < req.concurrency:
            return mem, "partial", (f"only {mem.max_sequences} of {req.concurrency} sequences "
                                    f"at {req.context:,} tokens")
        return mem, "fits", ""

    def speed(self, row: Row) -> list[SpeedRow]:
        """The measured serving speed of the row's format on this GPU (planner.speed)."""
        recipe = self.loaded.get(row.recipe)
        if recipe is None:
            return []
        try:
            group = self._group(recipe)
        except PreflightError:
            return []
        major, minor = self.req.gpu.capability
        return measured(recipe, major * 10 + minor, group, self.req.gpu.name)

    def lever_inputs(self, row: Row) -> LeverInputs | None:
        """What planner.levers re-plans the row with (None: its weights are unknown)."""
        recipe = self.loaded.get(row.recipe) if row.recipe != BASELINE else None
        if row.recipe != BASELINE and recipe is None:
            return None
        est = self._estimate(recipe)
        if est is None:
            return None
        req = self.req
        return LeverInputs(self.shape, req.gpu, self._resident(est, req.gpus), req.gpus,
                           req.util, req.context, self.batched, req.seqs,
                           self.kv_dtype(recipe)[1], self.profile, req.cpu_offload_gib,
                           req.enforce_eager)

    def _resident(self, est: WeightEstimate, tp: int) -> int:
        """What one GPU holds for the weights in vLLM: the stored tensors' share and what
        vLLM adds beside them (memory.resident_extra)."""
        return est.per_rank(tp) + resident_extra(self.shape, est, self.req.gpu, tp,
                                                 self.profile)

    def _min_tp(self, est: WeightEstimate, kv_bytes: int,
                group: int | None) -> tuple[int | None, int | None]:
        for tp in TP_CANDIDATES:
            mem, status, _ = self._fit(est, kv_bytes, tp, group)
            if status == "fits" and mem is not None:
                return tp, mem.max_sequences
        return None, None

    def _serve(self, recipe: Recipe | None, run: RunInfo | None, kv_bytes: int) -> str:
        req = self.req
        if recipe is None:
            ref = self.source.serve_ref
        elif run is not None and run.export.is_dir():
            ref = str(run.export)
        else:
            ref = f"runs/{self.source.name}-{recipe.name}/export"
        parts = [f"vllm serve {ref}", f"--tensor-parallel-size {req.gpus}",
                 f"--max-model-len {req.context}", f"--max-num-seqs {req.seqs}",
                 f"--max-num-batched-tokens {self.batched}",
                 f"--gpu-memory-utilization {req.util}"]
        if kv_bytes == 1:
            parts.append("--kv-cache-dtype fp8")
        if req.cpu_offload_gib:
            parts.append(f"--cpu-offload-gb {req.cpu_offload_gib:g}")
        if req.enforce_eager:
            parts.append("--enforce-eager")
        cmd = " ".join(parts)
        if recipe is not None and (run is None or not run.export.is_dir()):
            cmd += f"   # build it first: quantize run {recipe.name} --model {req.model}"
        return cmd
