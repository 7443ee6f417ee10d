"""What the remaining stages of a run will write, where: the disk pre-check's input.

Before calibration, each stage that will run is sized from what is known already:

    calibrate  the token ids (int64, num_samples x seq_len) and a small summary
    quantize   the checkpoint: the planner's weight bytes for this recipe (quantize.planner.
               weights: every tensor as compressed-tensors stores it, tied embeddings once),
               the source model's other files (tokenizer, configs) and the engine's log;
               plus the weights that do not fit in host RAM when they spill to disk (.offload)
    export     the weights are hard links of the quantize stage's (counted once), so only
               the copied small files, the recipe and the export manifest
    eval/gate  reports, and the baseline's per-window scores in the shared cache

The small files are allowances (measured on the tiny and default models, docs/reliability.md);
the weights dominate from a few MB up. quantize.checks.resources.check_disk compares the sum
per file system with its free space.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantize.checks.resources import DiskNeed
from quantize.model.config import ModelConfig

if TYPE_CHECKING:
    from quantize.pipeline.wiring import PipelineView
    from quantize.run.manifest import Manifest

KiB = 1024
_WEIGHT_SUFFIX = ".safetensors"
# allowances for the small files each stage writes (sizes seen: calibration.json 0.6 KB,
# config.json with its quantization block 1.7 KB, llm-compressor's log 10 KB per decoder
# layer, eval.json 1.7-5.4 KB, gate.json 0.6-2.5 KB, manifest.json 8-11 KB, a baseline
# cache entry 0.4-4.5 KB)
_CALIBRATE_EXTRA = 4 * KiB
_QUANTIZE_EXTRA = 16 * KiB  # the quantization block in config.json, the engine's recipe
_LOG_PER_LAYER = 10 * KiB  # llm-compressor's log: 32 KB for 2 layers, 313 KB for 30
_EXPORT_EXTRA = 8 * KiB  # recipe.yaml, manifest.json
_EVAL = 8 * KiB
_BASELINE_PER_METRIC = 16 * KiB
_GATE = 4 * KiB
_MANIFEST = 16 * KiB  # the run manifest, rewritten after each stage (old + new at the rename)


def remaining(manifest: Manifest, stages: list[str], rerun: tuple[str, ...], *,
              same_run: bool) -> list[str]:
    """The stages that will write: from the first one not recorded as done (or asked to
    re-run) on, since every later stage's key names the earlier ones. A folder that recorded
    another recipe or model (`same_run` false) re-runs everything. (A recorded stage whose
    inputs changed in another way is not foreseen; a full disk then still stops it with a
    one-line error, and the re-run resumes.)"""
    for i, name in enumerate(stages):
        if (not same_run or manifest.stage(name) is None or name in rerun
                or "all" in rerun):
            return stages[i:]
    return []


def check(pipe: PipelineView, stages: dict[str, Callable[[DiskContext], list[DiskNeed]]]
          ) -> dict[str, int] | None:
    """The disk pre-check of a pipeline run (quantize.pipeline.Pipeline) over `stages` (each
    stage's disk function, in order; quantize.pipeline.stages):
    refuses (ResourceError, one line) or returns the facts for the manifest."""
    from quantize.checks.resources import check_disk
    from quantize.model.source import cache_root
    from quantize.recipe.recipe import canonical_hash
    from quantize.stages.calibrate import resolve_spec

    m = pipe.manifest
    same = (m.recipe is not None and m.recipe.sha256 == canonical_hash(pipe.recipe)
            and m.model is not None and m.model.path == str(pipe.model.path))
    todo = remaining(m, list(stages), pipe.opts.rerun, same_run=same)
    if not todo:
        return None
    spec, _ = resolve_spec(pipe.recipe, pipe.opts.dataset)
    metrics = len(pipe.suite().metrics) if "eval" in todo else 0
    ctx = DiskContext(pipe.run_dir, cache_root(), pipe.model.path, pipe.meta, pipe.recipe,
                      pipe.model.config, pipe.facts.group_size, pipe.device,
                      (spec.num_samples, spec.seq_len), metrics)
    disks = [stages[name] for name in todo]
    return check_disk(needs(disks, ctx))["disk_needed_bytes"]


def side_files(model_dir: Path) -> int:
    """Bytes of the model folder's files other than weights (tokenizer, configs, templates):
    the engine saves them with the checkpoint, and the export copies them again."""
    return sum(p.stat().st_size for p in model_dir.iterdir()
               if p.is_file() and not p.name.startswith(".") and p.suffix != _WEIGHT_SUFFIX
               and not p.name.endswith(".index.json"))


def export_weight_bytes(meta: Any, recipe: Any, config: ModelConfig,
                        group: int | None) -> int:
    """The export's weight bytes, from the planner (one home for what a format costs)."""
    from quantize.model.config import weight_bytes
    from quantize.planner.weights import estimate_weights, recipe_layers

    return estimate_weights(meta, weight_bytes(config), recipe_layers(meta, recipe, group)).total


def calibration_bytes(num_samples: int, seq_len: int) -> int:
    return num_samples * seq_len * 8 + num_samples * 8 + _CALIBRATE_EXTRA


def offload_bytes(meta: Any, recipe: Any, config: ModelConfig, device: str,
                  offload_dir: Path) -> int:
    """Weights that spill to the offload folder when host RAM is short (the quantize stage's
    own choice: quantize.checks.placement), else 0."""
    from quantize.checks.placement import choose_host
    from quantize.checks.resources import (
        estimate_host_bytes,
        host_free_bytes,
        model_size,
        weight_bytes_on,
    )
    from quantize.model.config import weight_bytes
    from quantize.run.files import free_bytes

    params = model_size(meta, recipe).params
    weights = weight_bytes_on(params, device, weight_bytes(config))
    plan = choose_host(estimate_host_bytes(params, device), weights, host_free_bytes(),
                       free_bytes(offload_dir))
    return plan.disk_bytes


def _layers(config: ModelConfig) -> int:
    return int(config.text.num_hidden_layers or 0)


@dataclass(frozen=True)
class DiskContext:
    """What sizing a stage's writes needs, known before calibration."""

    run_dir: Path
    cache: Path
    model_dir: Path
    meta: Any
    recipe: Any
    config: ModelConfig
    group: int | None
    device: str
    calibration: tuple[int, int]  # num_samples, seq_len
    metrics: int  # metrics of the eval suite

    @property
    def side(self) -> int:
        return side_files(self.model_dir)


def calibrate_disk(c: DiskContext) -> list[DiskNeed]:
    return [DiskNeed("calibrate", c.run_dir, calibration_bytes(*c.calibration))]


def quantize_disk(c: DiskContext) -> list[DiskNeed]:
    weights = export_weight_bytes(c.meta, c.recipe, c.config, c.group)
    log = _LOG_PER_LAYER * _layers(c.config)
    out = [DiskNeed("quantize", c.run_dir, weights + c.side + _QUANTIZE_EXTRA + log)]
    spill = offload_bytes(c.meta, c.recipe, c.config, c.device, c.run_dir / ".offload")
    if spill:
        out.append(DiskNeed("offload", c.run_dir, spill))
    return out


def export_disk(c: DiskContext) -> list[DiskNeed]:
    """The weights are hard links of the quantize stage's: counted once, there."""
    return [DiskNeed("export", c.run_dir, c.side + _EXPORT_EXTRA)]


def eval_disk(c: DiskContext) -> list[DiskNeed]:
    return [DiskNeed("eval", c.run_dir, _EVAL),
            DiskNeed("baseline cache", c.cache, _BASELINE_PER_METRIC * c.metrics)]


def gate_disk(c: DiskContext) -> list[DiskNeed]:
    return [DiskNeed("gate", c.run_dir, _GATE)]


def needs(stages: list[Callable[[DiskContext], list[DiskNeed]]],
          ctx: DiskContext) -> list[DiskNeed]:
    """What the stages (their disk functions) write, and where (run folder, or the shared
    cache), with the manifest rewritten after each."""
    out = [need for disk in stages for need in disk(ctx)]
    if out:
        out.append(DiskNeed("manifest", ctx.run_dir, _MANIFEST))
    return out
