"""What each stage of a run takes: its inputs (what its key hashes) and how to execute it.

One function per stage, named as the stage. Each reads what it needs from the pipeline's
state (recipe, model, manifest, upstream keys) and hands the stage module explicit values;
no stage module sees the pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from quantize.model.source import ModelRef, tokenizer_files
from quantize.progress import info, step
from quantize.recipe.recipe import EvalSuite, Recipe, canonical_hash
from quantize.run.files import sha256_file
from quantize.run.manifest import ExportManifest, Manifest, PreflightFacts
from quantize.run.results import (
    CalibrationSummary,
    EvalSummary,
    ExportSummary,
    GateSummary,
    QuantizeSummary,
    Record,
)
from quantize.run.stage import Inputs

# a stage's summary, typed; the pipeline hands the manifest its JSON (Record.to_json)
Execute = Callable[[Path], Record]
Plan = tuple[Inputs, Execute]


class OptionsView(Protocol):
    dataset: str | None
    rerun: tuple[str, ...]
    gpus: int
    eval_engine: Any  # quantize.stages.eval.engine.EvalEngineRequest | None
    consumers: tuple[str, ...] | None  # `quantize gate --consumer`



class PipelineView(Protocol):
    """What the stages' wiring reads of a run (quantize.pipeline.Pipeline provides it)."""

    @property
    def opts(self) -> OptionsView: ...

    recipe: Recipe
    recipe_text: str
    model: ModelRef
    run_dir: Path
    device: str
    manifest: Manifest
    facts: PreflightFacts
    keys: dict[str, str]
    meta: Any

    def fingerprint(self) -> str: ...

    def suite(self) -> EvalSuite: ...


def calibrate(pipe: PipelineView) -> Plan:
    from quantize.stages import calibrate as stage

    spec, base = stage.resolve_spec(pipe.recipe, pipe.opts.dataset)
    tok_files = tokenizer_files(pipe.model.path)  # the vocabulary files too
    inputs = {"spec": canonical_hash(spec),
              "source": stage.source_fingerprint(spec, base),
              "tokenizer": [sha256_file(f) for f in tok_files]}

    def execute(out: Path) -> CalibrationSummary:
        from transformers import AutoTokenizer

        with step(f"calibration set: {spec.num_samples} × {spec.seq_len} tokens from "
                  f"{spec.builtin or spec.path or spec.hub}"):
            tok = AutoTokenizer.from_pretrained(pipe.model.path)
            return stage.run(spec, base, tok, out)

    return inputs, execute


def quantize(pipe: PipelineView) -> Plan:
    from quantize.backends import QuantizeJob, resolve_batch_size
    from quantize.stages import calibrate as calibrate_stage
    from quantize.stages import quantize as stage

    recipe = pipe.recipe
    quant_part = recipe.model_dump(mode="json", exclude={"description", "calibration", "eval"})
    if quant_part.get("mixed_precision") is None:  # a later field: the keys of runs before it
        quant_part.pop("mixed_precision", None)     # stay what they were
    calib = pipe.manifest.result("calibrate", CalibrationSummary)
    # deferred: the quantize stage runs while the model is hashed (see _start_fingerprint)
    model = {"source": pipe.model.source, "fingerprint": pipe.fingerprint}
    inputs = {"recipe": canonical_hash(quant_part), "model": model,
              "calibration": calib.fingerprint, "group_size": pipe.facts.group_size,
              "device": pipe.device, "versions": pipe.manifest.versions}

    def execute(out: Path) -> QuantizeSummary:
        from quantize.backends.distributed import check_samples, shares
        from quantize.checks.placement import GiB, load_plan
        from quantize.checks.resources import check_memory

        samples = calibrate_stage.load(pipe.run_dir / "calibrate")
        if not recipe.needs_calibration:
            samples = []
        gpus = pipe.opts.gpus
        check_samples(len(samples), gpus)
        share = samples[: -(-len(samples) // gpus)]  # the largest process's share
        batch = resolve_batch_size(recipe.batch_size, pipe.device, share)
        # before the model is loaded: refuse, or pick where it lives on a GPU and, when
        # host RAM is short, which weights go to disk
        offload_dir = pipe.run_dir / ".offload"
        mem = pipe.facts.memory = check_memory(
            pipe.meta, recipe, pipe.model.config, pipe.device, share, batch,
            world_size=gpus, offload_dir=offload_dir)
        disk = mem["host_tier"] == "disk"
        job = QuantizeJob(pipe.model.path, recipe, pipe.facts.group_size, samples,
                          pipe.device, batch,
                          placement=mem.get("gpu_placement", "resident"), world_size=gpus,
                          host_tier=mem["host_tier"],
                          cpu_budget=mem.get("host_cpu_budget_bytes") or
                          int(mem["host_ram_free_gib"] * GiB),
                          offload_dir=offload_dir if disk else None)
        load = load_plan(job.device, job.placement, job.host_tier, gpus, job.cpu_budget,
                         job.offload_dir)
        info(f"weights: {load.where}")
        if gpus > 1:
            split = "/".join(str(n) for n in shares(len(samples), gpus))
            how = "gloo, CPU processes" if pipe.device == "cpu" else "NCCL, one GPU each"
            info(f"calibration on {gpus} processes (torchrun, {how}), samples split {split}")
        return stage.run(job, out)

    return inputs, execute


def export(pipe: PipelineView) -> Plan:
    from quantize.stages import export as stage

    inputs = {"quantize": pipe.keys["quantize"],
              "recipe_text": canonical_hash({"text": pipe.recipe_text})}

    def execute(out: Path) -> ExportSummary:
        m = pipe.manifest
        stages = {k: {"started": v.started, "ended": v.ended, "duration_s": v.duration_s}
                  for k, v in m.stages.items() if k in ("calibrate", "quantize")}
        meta = ExportManifest(model=m.model, recipe=m.recipe, versions=m.versions,
                              device=m.device, calibration=m.stages["calibrate"].summary,
                              stages=stages)
        with step(f"writing export to {pipe.run_dir / 'export'}"):
            return stage.run(pipe.run_dir / "quantize", pipe.recipe_text, meta, out)

    return inputs, execute


def eval(pipe: PipelineView) -> Plan:
    from dataclasses import replace

    from quantize.errors import EvalError
    from quantize.metrics.consumers import measured_here
    from quantize.stages import eval as stage
    from quantize.stages.eval.engine import EvalEngineRequest, choose, requested_engine

    suite = pipe.suite()
    export = pipe.run_dir / "export"
    # the engine is chosen before anything loads (and refused here: no vLLM, --tp too large)
    req = pipe.opts.eval_engine or EvalEngineRequest()
    req = replace(req, engine=requested_engine(req.engine, pipe.recipe.eval.engine,
                                               suite.engine))
    choice = choose(req, export, pipe.model.path, pipe.recipe.kv_cache is not None,
                    pipe.device)
    stage.check_engine(suite, choice)
    inputs = {"export": pipe.keys["export"], "suite": stage.measured_settings(suite),
              "device": pipe.device}
    if (engine := stage.engine_key(choice)) is not None:  # absent: hf
        inputs["engine"] = engine
    if (scoring := stage.choice_scoring(suite, choice)) is not None:
        inputs["choice_scoring"] = scoring
    consumers = measured_here(pipe.recipe.online_transforms)
    inputs["consumers"] = consumers

    def execute(out: Path) -> EvalSummary:
        if not export.is_dir():
            raise EvalError(path=export, path_sep=" ", problem="is missing",
                            hint="run the export stage first")
        return stage.run(export, pipe.model.path, pipe.fingerprint(), suite,
                         pipe.device, pipe.manifest.versions, out, choice, consumers,
                         pipe.recipe.trust_remote_code)

    return inputs, execute


def gate(pipe: PipelineView) -> Plan:
    from quantize.stages import gate as stage

    suite = pipe.suite()
    rules = {m.name: m for m in suite.metrics}
    consumers = pipe.opts.consumers or pipe.recipe.advertised_consumers
    inputs = {"eval": pipe.keys["eval"],
              "rules": [m.model_dump(include={"name", "direction", "threshold", "on_fail"})
                        for m in suite.metrics],
              "consumers": list(consumers)}

    def execute(out: Path) -> GateSummary:
        ev = stage.read_eval(pipe.run_dir / "eval")
        return stage.run(stage.with_rules(ev, rules, consumers), out)

    return inputs, execute
