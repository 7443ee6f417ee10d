"""Stage order, cache keys and skip/rerun decisions.

Each stage's key is the sha256 of its inputs (including upstream stage keys and package
versions). A stage is skipped only when its recorded key matches and its output files still
hash to what the manifest recorded; otherwise it re-runs, and the log says why.
"""

from __future__ import annotations

import importlib.metadata
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantize import __version__
from quantize.checks import preflight
from quantize.errors import ExportError, QuantizeError
from quantize.model.source import (
    DEFAULT_MODEL,
    HUB_ID,
    ModelRef,
    check_architecture,
    model_fingerprint,
    resolve_model,
)
from quantize.progress import info, step
from quantize.run.files import atomic_dir, check_tree, hash_tree, now, pause_point, sha256_file
from quantize.run.lock import run_lock
from quantize.run.manifest import read_manifest, write_manifest
from quantize.spec.recipe import (
    EvalSuite,
    Recipe,
    canonical_hash,
    load_recipe,
    resolve,
    suite_for,
)
from quantize.spec.yamlio import read_text
from quantize.stages import STAGES

_VERSIONED = ("torch", "transformers", "llmcompressor", "compressed-tensors", "lm_eval")


def versions() -> dict[str, str]:
    out = {"quantize": __version__, "python": platform.python_version()}
    for pkg in _VERSIONED:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "absent"
    return out


def pick_device(requested: str) -> str:
    if requested != "auto":
        if requested == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise QuantizeError("--device cuda but no CUDA GPU is visible; use --device cpu")
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_run_dir(model: ModelRef, recipe: Recipe) -> Path:
    return Path("runs") / f"{model.name}-{recipe.name}"


def from_hub(model: ModelRef) -> bool:
    """Whether the model was fetched from the Hub, possibly with the user's token (a gated or
    private model): then the run folder holds data derived from it and is made user-only."""
    return (model.source != DEFAULT_MODEL and bool(HUB_ID.match(model.source))
            and not Path(model.source).expanduser().exists())


def _absolute(ref: str | None) -> str | None:
    """A path the user gave, made absolute so `quantize eval RUN` works from any folder."""
    if ref is not None and Path(ref).exists():
        return str(Path(ref).resolve())
    return ref


@dataclass
class RunOptions:
    recipe: str
    model: str | None = None
    dataset: str | None = None
    out: Path | None = None
    device: str = "auto"
    until: str = "gate"
    rerun: tuple[str, ...] = ()
    allow_pickle: bool = False
    suite: str | None = None
    tp: int = 1  # the tensor-parallel size to check the model's shapes for (pre-flight only)
    # processes for the quantize stage (torchrun, one GPU each); an execution setting like
    # the memory placement, not an input: not part of the stage key
    gpus: int = 1


@dataclass
class Pipeline:
    opts: RunOptions
    recipe: Recipe = field(init=False)
    recipe_text: str = field(init=False)
    model: ModelRef = field(init=False)
    run_dir: Path = field(init=False)
    device: str = field(init=False)
    manifest: dict[str, Any] = field(init=False, default_factory=dict)
    facts: dict[str, Any] = field(init=False, default_factory=dict)
    keys: dict[str, str] = field(init=False, default_factory=dict)
    meta: Any = field(init=False, default=None)  # the meta-device model pre-flight built
    _fp: tuple[threading.Thread, dict[str, Any]] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.opts.until not in STAGES:
            raise QuantizeError(f"unknown stage {self.opts.until!r}; stages: {', '.join(STAGES)}")
        self.recipe = load_recipe(self.opts.recipe)
        self.recipe_text = read_text(resolve("recipes", self.opts.recipe))
        self.model = resolve_model(self.opts.model, allow_pickle=self.opts.allow_pickle)
        check_architecture(self.model.config, trust_remote_code=self.recipe.trust_remote_code)
        self.run_dir = self.opts.out or default_run_dir(self.model, self.recipe)
        self.device = pick_device(self.opts.device)
        if self.opts.gpus != 1:  # before any calibration: can this recipe run data-parallel?
            from quantize.backends.distributed import check_support, visible_gpus

            check_support(self.recipe, self.device, self.opts.gpus, visible_gpus(self.device))

    # --- the driver -----------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        with run_lock(self.run_dir, private=from_hub(self.model)):
            self.manifest = read_manifest(self.run_dir)
            # one meta-device model for pre-flight and the memory estimate (no weights read)
            self.meta = preflight.build_meta(self.recipe, self.model.config)
            self.facts = preflight.check(self.recipe, self.model.config, tp=self.opts.tp,
                                         model=self.meta)
            if STAGES.index(self.opts.until) >= STAGES.index("eval"):
                self.suite()  # a bad suite fails now, not after hours of quantization
            self._record_header()
            for stage in STAGES[: STAGES.index(self.opts.until) + 1]:
                self._stage(stage)
            self.fingerprint()  # a calibrate-only run records it too
            gate = self.manifest["stages"].get("gate")
            if "gate" in self.keys and gate:
                self.manifest["releasable"] = gate["summary"]["verdict"] == "pass"
            write_manifest(self.run_dir, self.manifest)
            return self.manifest

    def _start_fingerprint(self) -> None:
        """Hash the model's weights (16 GB for an 8B model: 4.6 s on the H200 host, the
        largest fixed cost of a first run, bench/RESULTS.md) in a background thread while
        calibration and quantization run; hashlib releases the GIL. A stage whose decision
        needs it (a finished result to compare against) waits for it."""
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["value"] = model_fingerprint(self.model)
            except BaseException as exc:  # re-raised in the caller's thread
                box["error"] = exc

        thread = threading.Thread(target=work, name="model-fingerprint", daemon=True)
        thread.start()
        self._fp = (thread, box)

    def fingerprint(self) -> str:
        """The model's fingerprint (waits for the background hash), recorded in the manifest."""
        if self._fp is None:
            self._start_fingerprint()
        assert self._fp is not None
        thread, box = self._fp
        thread.join()
        if "error" in box:
            raise box["error"]
        self.manifest["model"]["fingerprint"] = box["value"]
        return str(box["value"])

    def suite(self) -> EvalSuite:
        """The eval suite: --suite, else the recipe's, with the recipe's tightened thresholds."""
        return suite_for(self.recipe, self.opts.suite)

    def _record_header(self) -> None:
        self.manifest.update({
            "schema": 1,
            "run": self.run_dir.name,
            "model": {"source": self.model.source, "path": str(self.model.path),
                      "fingerprint": None},  # filled in by fingerprint()
            "recipe": {"name": self.recipe.name, "ref": _absolute(self.opts.recipe),
                       "sha256": canonical_hash(self.recipe),
                       "trust_remote_code": self.recipe.trust_remote_code},
            "versions": versions(),
            "device": self.device,
            "dataset": _absolute(self.opts.dataset),
            "preflight": self.facts,
        })
        self._start_fingerprint()

    def _stage(self, name: str) -> None:
        inputs, execute = self._plan(name)
        entry = self.manifest["stages"].get(name)
        out = self.run_dir / name
        reason = self._why_run(name, entry, inputs, out)
        if reason is None:
            key = self.keys[name]
            info(f"[dim]skip[/dim] {name}: inputs unchanged (key {key[:12]}), outputs verified")
            return
        info(f"[bold]{name}[/bold]: {reason}")
        started, t0 = now(), time.perf_counter()
        pause_point(f"{name}:start")
        with atomic_dir(out) as tmp:
            summary = execute(tmp)
            pause_point(f"{name}:written")
        pause_point(f"{name}:renamed")  # folder in place, manifest entry not yet written
        inputs = _resolved(inputs)  # a deferred input (the model fingerprint) is ready by now
        key = self.keys[name] = canonical_hash(inputs)
        self.manifest["stages"][name] = {
            "key": key, "inputs": inputs, "status": "done", "started": started,
            "ended": now(), "duration_s": round(time.perf_counter() - t0, 2),
            "outputs": hash_tree(out), "summary": summary,
        }
        write_manifest(self.run_dir, self.manifest)

    def _why_run(self, name: str, entry: dict[str, Any] | None, inputs: dict[str, Any],
                 out: Path) -> str | None:
        """Why the stage must run, or None to skip it. Deferred inputs are resolved (waited
        for) only when there is a finished result to compare them with."""
        if name in self.opts.rerun or "all" in self.opts.rerun:
            return "re-running as asked (--rerun)"
        if entry is None or entry.get("status") != "done":
            return "no finished result yet"
        inputs = _resolved(inputs)
        key = self.keys[name] = canonical_hash(inputs)
        if entry.get("key") != key:
            old = entry.get("inputs", {})
            changed = sorted(k for k in set(old) | set(inputs) if old.get(k) != inputs.get(k))
            return f"inputs changed ({', '.join(changed) or 'key'})"
        try:
            check_tree(out, entry.get("outputs", {}), name)
        except ExportError as exc:
            return f"outputs no longer match the manifest ({exc}); rebuilding"
        return None

    # --- stage wiring ---------------------------------------------------------------------
    def _plan(self, name: str) -> tuple[dict[str, Any], Callable[[Path], dict[str, Any]]]:
        planner: Callable[[], tuple[dict[str, Any], Callable[[Path], dict[str, Any]]]] = \
            getattr(self, f"_plan_{name}")
        return planner()

    def _plan_calibrate(self) -> tuple[dict[str, Any], Callable[[Path], dict[str, Any]]]:
        from quantize.stages import calibrate

        spec, base = calibrate.resolve_spec(self.recipe, self.opts.dataset)
        tok_files = sorted(self.model.path.glob("tokenizer*")) + sorted(
            self.model.path.glob("*.jinja"))
        inputs = {"spec": canonical_hash(spec),
                  "source": calibrate.source_fingerprint(spec, base),
                  "tokenizer": [sha256_file(f) for f in tok_files]}

        def execute(out: Path) -> dict[str, Any]:
            from transformers import AutoTokenizer

            with step(f"calibration set: {spec.num_samples} × {spec.seq_len} tokens from "
                      f"{spec.builtin or spec.path or spec.hub}"):
                tok = AutoTokenizer.from_pretrained(self.model.path)
                return calibrate.run(spec, base, tok, out)

        return inputs, execute

    def _plan_quantize(self) -> tuple[dict[str, Any], Callable[[Path], dict[str, Any]]]:
        from quantize.backends import QuantizeJob, resolve_batch_size
        from quantize.stages import calibrate, quantize

        quant_part = self.recipe.model_dump(
            mode="json", exclude={"description", "calibration", "eval"})
        calib = self.manifest["stages"]["calibrate"]["summary"]
        # deferred: the quantize stage runs while the model is hashed (see _start_fingerprint)
        model = {"source": self.manifest["model"]["source"], "fingerprint": self.fingerprint}
        inputs = {"recipe": canonical_hash(quant_part), "model": model,
                  "calibration": calib["fingerprint"], "group_size": self.facts["group_size"],
                  "device": self.device, "versions": self.manifest["versions"]}

        def execute(out: Path) -> dict[str, Any]:
            from quantize.backends.distributed import check_samples, shares
            from quantize.checks.placement import GiB, load_plan
            from quantize.checks.resources import check_memory

            samples = calibrate.load(self.run_dir / "calibrate")
            if not self.recipe.needs_calibration:
                samples = []
            gpus = self.opts.gpus
            check_samples(len(samples), gpus)
            share = samples[: -(-len(samples) // gpus)]  # the largest process's share
            batch = resolve_batch_size(self.recipe.batch_size, self.device, share)
            # before the model is loaded: refuse, or pick where it lives on a GPU and, when
            # host RAM is short, which weights go to disk
            offload_dir = self.run_dir / ".offload"
            mem = self.facts["memory"] = check_memory(
                self.meta, self.recipe, self.model.config, self.device, share, batch,
                world_size=gpus, offload_dir=offload_dir)
            disk = mem["host_tier"] == "disk"
            job = QuantizeJob(self.model.path, self.recipe, self.facts["group_size"], samples,
                              self.device, batch,
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
                how = "gloo, CPU processes" if self.device == "cpu" else "NCCL, one GPU each"
                info(f"calibration on {gpus} processes (torchrun, {how}), samples split {split}")
            return quantize.run(job, out)

        return inputs, execute

    def _plan_export(self) -> tuple[dict[str, Any], Callable[[Path], dict[str, Any]]]:
        from quantize.stages import export

        inputs = {"quantize": self.keys["quantize"],
                  "recipe_text": canonical_hash({"text": self.recipe_text})}

        def execute(out: Path) -> dict[str, Any]:
            stages = {k: {f: v[f] for f in ("started", "ended", "duration_s")}
                      for k, v in self.manifest["stages"].items() if k in ("calibrate",
                                                                           "quantize")}
            meta = {k: self.manifest[k] for k in ("model", "recipe", "versions", "device")}
            meta["calibration"] = self.manifest["stages"]["calibrate"]["summary"]
            meta["stages"] = stages
            with step(f"writing export to {self.run_dir / 'export'}"):
                return export.run(self.run_dir / "quantize", self.recipe_text, meta, out)

        return inputs, execute

    def _plan_eval(self) -> tuple[dict[str, Any], Callable[[Path], dict[str, Any]]]:
        from quantize.stages import eval as eval_stage

        return eval_stage.plan(self)

    def _plan_gate(self) -> tuple[dict[str, Any], Callable[[Path], dict[str, Any]]]:
        from quantize.stages import gate

        return gate.plan(self)


def _resolved(inputs: dict[str, Any]) -> dict[str, Any]:
    """Stage inputs with deferred values (zero-argument callables) computed."""
    return {k: _resolved(v) if isinstance(v, dict) else v() if callable(v) else v
            for k, v in inputs.items()}


def run(opts: RunOptions) -> Pipeline:
    pipe = Pipeline(opts)
    pipe.run()
    return pipe
