"""Stage order, cache keys and skip/rerun decisions.

Each stage's key is the sha256 of its inputs (including upstream stage keys and package
versions). A stage is skipped only when its recorded key matches and its output files still
hash to what the manifest recorded; otherwise it re-runs, and the log says why.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantize import backends
from quantize.checks import preflight
from quantize.checks.formats import GpuTarget
from quantize.errors import QuantizeError
from quantize.model.source import (
    DEFAULT_MODEL,
    HUB_ID,
    ModelRef,
    check_architecture,
    model_fingerprint,
    resolve_model,
)
from quantize.pipeline.input_model import converted_model
from quantize.pipeline.stages import Stage, upto
from quantize.recipe.recipe import (
    EvalSuite,
    Recipe,
    canonical_hash,
    load_recipe,
    resolve,
    suite_for,
)
from quantize.recipe.yamlio import read_text
from quantize.run import stage as run_stage
from quantize.run.lock import run_lock
from quantize.run.manifest import (
    Manifest,
    ModelInfo,
    PreflightFacts,
    RecipeInfo,
    RunFolder,
    check_out_folder,
    check_same_run,
    versions,
)
from quantize.run.results import GateSummary


def pick_device(requested: str) -> str:
    if requested != "auto":
        if requested == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise QuantizeError(problem="--device cuda but no CUDA GPU is visible",
                                    hint="use --device cpu")
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


def target_gpu(name: str | None) -> GpuTarget | None:
    """`--gpu NAME` from the GPU catalog (quantize/data/gpus.yaml) as pre-flight's target."""
    if name is None:
        return None
    from quantize.planner.gpus import find

    gpu = find(name)
    major, minor = gpu.capability
    return GpuTarget(gpu.name, major * 10 + minor)


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
    no_disk_check: bool = False  # skip the disk pre-check (quantize.pipeline.disk)
    gpu: str | None = None  # the GPU the export is for (--gpu): pre-flight's format warnings
    # `quantize eval --engine/--tp/--kv-cache-dtype` (stages.eval.engine.EvalEngineRequest);
    # None: the recipe's or suite's eval.engine, else auto
    eval_engine: Any = None
    # `quantize gate --consumer`: the consumers to judge the export for (None: the recipe's)
    consumers: tuple[str, ...] | None = None
    # the folder holds one tool's runs of several recipes by design (`quantize fit`: its base
    # recipe's calibration, then the fitted recipe): no refusal of another recipe's run there
    shared_folder: bool = False


@dataclass
class _Hashing:
    """The model fingerprint being computed in a background thread."""

    thread: threading.Thread | None = None
    value: str | None = None
    error: BaseException | None = None
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass
class Pipeline:
    opts: RunOptions
    recipe: Recipe = field(init=False)
    recipe_text: str = field(init=False)
    model: ModelRef = field(init=False)
    run_dir: Path = field(init=False)
    device: str = field(init=False)
    manifest: Manifest = field(init=False, default_factory=Manifest)
    facts: PreflightFacts = field(init=False, default_factory=PreflightFacts)
    keys: dict[str, str] = field(init=False, default_factory=dict)
    meta: Any = field(init=False, default=None)  # the meta-device model pre-flight built
    target_gpu: GpuTarget | None = field(init=False, default=None)  # --gpu, resolved
    _fp: _Hashing | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        upto(self.opts.until)  # an unknown stage name fails now
        self.recipe = load_recipe(self.opts.recipe)
        self.recipe_text = read_text(resolve("recipes", self.opts.recipe))
        # a GGUF or FP8-block source is converted to bf16 first (cached; input_model)
        self.model = converted_model(self.opts.model, allow_pickle=self.opts.allow_pickle) \
            or resolve_model(self.opts.model, allow_pickle=self.opts.allow_pickle)
        check_architecture(self.model.config, trust_remote_code=self.recipe.trust_remote_code)
        self.run_dir = self.opts.out or default_run_dir(self.model, self.recipe)
        self.device = pick_device(self.opts.device)
        self.target_gpu = target_gpu(self.opts.gpu)  # an unknown name fails now
        if self.opts.gpus != 1:  # before any calibration: can this recipe run data-parallel?
            from quantize.backends.distributed import check_support, visible_gpus

            check_support(self.recipe, self.device, self.opts.gpus, visible_gpus(self.device))

    # --- the driver -----------------------------------------------------------------------
    def run(self) -> None:
        check_out_folder(self.run_dir, self.model.path)  # before the lock creates anything
        with run_lock(self.run_dir, private=from_hub(self.model)), self._hashing():
            folder = RunFolder(self.run_dir)
            self.manifest = folder.read()
            # another recipe's or model's run is not replaced unless asked (--rerun all)
            check_same_run(self.manifest, self.run_dir, self.recipe.name, self.model.source,
                           self.model.path,
                           replace="all" in self.opts.rerun or self.opts.shared_folder)
            # the engine installed and willing first (no model built for that)
            backends.check_model(self.recipe, self.model.config)
            # one meta-device model for pre-flight and the memory estimate (no weights read)
            self.meta = preflight.build_meta(self.recipe, self.model.config)
            self.facts = preflight.check(self.recipe, self.model.config, tp=self.opts.tp,
                                         model=self.meta, gpu=self.target_gpu,
                                         weights=self.model.path)
            todo = upto(self.opts.until)
            if "eval" in {st.name for st in todo}:
                self.suite()  # a bad suite fails now, not after hours of quantization
            if not self.opts.no_disk_check:  # a full disk refused now, not after hours
                from quantize.pipeline import disk

                self.facts.disk_needed_bytes = disk.check(self, {st.name: st.disk
                                                                 for st in todo})
            self._record_header()
            for stage in todo:
                self._stage(stage)
            self.fingerprint()  # a calibrate-only run records it too
            gate = self.manifest.stage("gate")
            if "gate" in self.keys and gate is not None:
                self.manifest.releasable = gate.result(GateSummary).verdict == "pass"
            folder.write(self.manifest)

    def _start_fingerprint(self) -> None:
        """Hash the model's weights (16 GB for an 8B model: 4.6 s on the H200 host, the
        largest fixed cost of a first run, bench/RESULTS.md) in a background thread while
        calibration and quantization run; hashlib releases the GIL. A stage whose decision
        needs it (a finished result to compare against) waits for it."""
        box = _Hashing()

        def work() -> None:
            try:
                box.value = model_fingerprint(self.model, box.cancel)
            except BaseException as exc:  # re-raised in the caller's thread
                box.error = exc

        box.thread = threading.Thread(target=work, name="model-fingerprint", daemon=True)
        box.thread.start()
        self._fp = box

    @contextlib.contextmanager
    def _hashing(self) -> Iterator[None]:
        """However the run ends, the hashing thread has ended before it returns: a refusal
        or Ctrl-C stops it (within a chunk) and waits for it, so the CLI never exits with it
        running. A daemon thread still running at interpreter exit is torn down wherever it
        is (in hashlib, in a thread pool), the likely cause of the refusals that exited 134
        ("terminate called without an active exception", #47)."""
        try:
            yield
        finally:
            box = self._fp
            if box is not None and box.thread is not None and box.thread.is_alive():
                box.cancel.set()
                box.thread.join(timeout=30)

    def fingerprint(self) -> str:
        """The model's fingerprint (waits for the background hash), recorded in the manifest."""
        if self._fp is None:
            self._start_fingerprint()
        box = self._fp
        assert box is not None and box.thread is not None
        box.thread.join()
        if box.error is not None:
            raise box.error
        assert self.manifest.model is not None  # the header is written before any stage
        self.manifest.model.fingerprint = box.value
        return str(box.value)

    def suite(self) -> EvalSuite:
        """The eval suite: --suite, else the recipe's, with the recipe's tightened thresholds."""
        return suite_for(self.recipe, self.opts.suite)

    def _record_header(self) -> None:
        m = self.manifest
        m.run = self.run_dir.name
        # the fingerprint is filled in by fingerprint()
        m.model = ModelInfo(source=self.model.source, path=str(self.model.path),
                            fingerprint=None)
        m.recipe = RecipeInfo(name=self.recipe.name, ref=_absolute(self.opts.recipe),
                              sha256=canonical_hash(self.recipe),
                              trust_remote_code=self.recipe.trust_remote_code)
        m.versions = versions()
        m.device = self.device
        m.dataset = _absolute(self.opts.dataset)
        m.preflight = self.facts
        self._start_fingerprint()

    def _stage(self, stage: Stage) -> None:
        name = stage.name
        inputs, execute = stage.plan(self)
        rerun = name in self.opts.rerun or "all" in self.opts.rerun
        status = run_stage.status(name, self.manifest.stages.get(name), inputs,
                                  self.run_dir / name, rerun=rerun)
        if status.key is not None:
            self.keys[name] = status.key
        run_stage.announce(name, status)
        if not status.must_run:
            return
        record = run_stage.build(self.run_dir, name, inputs, lambda out: execute(out).to_json())
        self.keys[name] = record.key
        self.manifest.stages[name] = record
        RunFolder(self.run_dir).write(self.manifest)


def run(opts: RunOptions) -> Pipeline:
    pipe = Pipeline(opts)
    pipe.run()
    return pipe
