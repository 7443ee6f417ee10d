"""The run folder, typed: what `manifest.json` holds and the one reader every command uses.

Layout of a run folder (`runs/<model>-<recipe>/`):

    manifest.json        written last by every stage (atomic); stage keys, hashes, versions
    .lock                held (flock) by the process that owns the folder while it runs
    calibrate/           calibration.safetensors (token ids) + calibration.json
    quantize/            the compressed checkpoint as the engine saved it
    export/              the vLLM-loadable checkpoint + recipe.yaml + manifest.json
    eval/                eval.json + eval.md
    gate/                gate.json + gate.md
    verify/              verify.json + verify.md (a recorded stage: its key names the export)

A stage's folder is built under a temporary name and renamed into place only when complete,
so a crash never leaves a folder that looks finished; the manifest entry that marks a stage
done is written after the rename and lists the sha256 of every file in it.

Manifests are schema 1 since the first release; fields added later are optional, and unknown
fields are kept (a newer manifest read by an older reader loses nothing on rewrite).
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from quantize.errors import ExportError
from quantize.run.files import atomic_write_json, check_tree

MANIFEST = "manifest.json"
_VERSIONED = ("torch", "transformers", "llmcompressor", "compressed-tensors", "lm_eval")
SCHEMA = 1
M = TypeVar("M", bound=BaseModel)
Json = Any  # a JSON value as stored (stage inputs and summaries are stage-specific)


class _Record(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class ModelInfo(_Record):
    source: str
    path: str = ""
    fingerprint: str | None = None


class RecipeInfo(_Record):
    name: str
    ref: str | None = None
    sha256: str = ""
    trust_remote_code: bool = False


class PreflightFacts(_Record):
    """What the checks before calibration found and later stages read (the manifest's
    `preflight`): the resolved group size, the layers to quantize, the tensor-parallel size
    checked, the warnings, the GPU named with --gpu, the disk the remaining stages need, and
    (set by the quantize stage) where the model lives (checks.resources.check_memory)."""

    group_size: int | None = None
    layers: int = 0
    tp: int = 1
    warnings: list[str] = Field(default_factory=list)
    gpu: dict[str, Json] | None = None
    disk_needed_bytes: dict[str, int] | None = None
    memory: dict[str, Json] | None = None


class StageRecord(_Record):
    """One finished stage: its key (sha256 of its inputs), the inputs themselves, timings,
    the sha256 of every output file and the stage's own summary."""

    key: str
    inputs: dict[str, Json] = Field(default_factory=dict)
    status: str = "done"
    started: str = ""
    ended: str = ""
    duration_s: float = 0.0
    outputs: dict[str, str] = Field(default_factory=dict)
    summary: dict[str, Json] = Field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.status == "done"

    def result(self, model: type[M]) -> M:
        """The stage's summary as its typed result (quantize.run.results)."""
        return model.model_validate(self.summary)


class Manifest(_Record):
    schema_: int = Field(default=SCHEMA, alias="schema")
    run: str | None = None
    model: ModelInfo | None = None
    recipe: RecipeInfo | None = None
    versions: dict[str, str] = Field(default_factory=dict)
    device: str | None = None
    dataset: str | None = None
    preflight: PreflightFacts | None = None
    stages: dict[str, StageRecord] = Field(default_factory=dict)
    releasable: bool | None = None

    def stage(self, name: str) -> StageRecord | None:
        """The stage's record when it finished, else None."""
        rec = self.stages.get(name)
        return rec if rec is not None and rec.done else None

    def result(self, name: str, model: type[M]) -> M:
        """A finished stage's summary, typed; a one-line error when the stage has not run."""
        rec = self.stage(name)
        if rec is None:
            raise ExportError(problem=f"the run has no finished {name} stage",
                              hint="run it first (quantize run, or the stage's own command)")
        return rec.result(model)

    def to_json(self) -> dict[str, Json]:
        data = self.model_dump(mode="json", by_alias=True, exclude_unset=True)
        # the stages dict is filled in place (stages[name] = record), which pydantic does not
        # count as setting the field: always written
        data["stages"] = {k: v.model_dump(mode="json", by_alias=True, exclude_unset=True)
                          for k, v in self.stages.items()}
        return {"schema": SCHEMA, **data}


class ExportManifest(_Record):
    """The manifest.json inside an export folder: where the checkpoint came from (model,
    recipe, versions, calibration, stage timings) and the sha256 of every other file."""

    model: ModelInfo | None = None
    recipe: RecipeInfo | None = None
    versions: dict[str, str] = Field(default_factory=dict)
    device: str | None = None
    calibration: dict[str, Json] = Field(default_factory=dict)
    stages: dict[str, dict[str, Json]] = Field(default_factory=dict)
    files: dict[str, str] = Field(default_factory=dict)


def read_manifest_file(path: Path) -> Manifest:
    """A manifest file (a run's or an export's), or a one-line error saying how to re-run."""
    return _read(path, Manifest)


def read_export_manifest(path: Path) -> ExportManifest:
    """An export folder's manifest.json, or a one-line error saying how to re-export."""
    return _read(path, ExportManifest)


def _read(path: Path, model: type[M]) -> M:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ExportError(path=path, path_sep=" ", problem="is corrupt",
                          hint="delete the run folder and re-run") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        where = ".".join(str(x) for x in exc.errors()[0]["loc"])
        raise ExportError(path=path, path_sep=" ",
                          problem=f"is not a manifest this version reads ({where}: "
                                  f"{exc.errors()[0]['msg']})",
                          hint="re-run the pipeline into a new folder") from None


def check_out_folder(run_dir: Path, model_path: Path) -> None:
    """The run folder may not be the model folder or inside it: the run's files would become
    the model's (its manifest.json a model file, so the fingerprint would change every run)."""
    run, model = Path(run_dir).resolve(), Path(model_path).resolve()
    if run == model or run.is_relative_to(model):
        from quantize.errors import QuantizeError

        where = "is the model folder" if run == model else f"is inside the model folder {model}"
        raise QuantizeError(path=run_dir, path_sep=" ", problem=f"{where}, so the run would "
                            "write into the model", hint="give --out a folder of its own")


def check_same_run(manifest: Manifest, run_dir: Path, recipe: str, source: str,
                   model_path: Path, *, replace: bool) -> None:
    """Refuse to turn a run folder of another recipe or model into this run's (its export
    would be silently replaced), unless `replace` (`--rerun all`). The same model is the same
    source as typed, or the same folder (`./m` and `/abs/m`; a Hub id whose snapshot moved)."""
    if replace or manifest.recipe is None:
        return
    was = []
    if manifest.recipe.name != recipe:
        was.append(f"recipe {manifest.recipe.name!r}")
    m = manifest.model
    if m is not None and m.source != source and (
            not m.path or Path(m.path).resolve() != Path(model_path).resolve()):
        was.append(f"model {m.source!r}")
    if was:
        from quantize.errors import QuantizeError

        raise QuantizeError(
            path=run_dir, path_sep=" ",
            problem=f"holds the run of {' and '.join(was)}, which this run of recipe "
                    f"{recipe!r} on {source!r} would replace",
            hint="give another --out folder, or pass --rerun all to replace that run")


class RunFolder:
    """A run folder: its paths and its manifest. Every command reads runs through this."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST

    def is_run(self) -> bool:
        return self.manifest_path.is_file()

    def stage_dir(self, name: str) -> Path:
        return self.path / name

    @property
    def export(self) -> Path:
        return self.path / "export"

    def read(self) -> Manifest:
        """The manifest (an empty one when the folder has none yet)."""
        if not self.manifest_path.exists():
            return Manifest()
        return read_manifest_file(self.manifest_path)

    def write(self, manifest: Manifest) -> None:
        atomic_write_json(self.manifest_path, manifest.to_json())

    def require(self) -> Manifest:
        """The manifest of a folder that must be a run folder."""
        if not self.is_run():
            from quantize.errors import QuantizeError

            raise QuantizeError(path=self.path, path_sep=" ",
                                problem="is not a run folder (no manifest.json)",
                                hint="give the folder `quantize run` wrote, e.g. "
                                     "runs/<model>-<recipe>")
        return self.read()

    def verified_stage(self, manifest: Manifest, name: str) -> StageRecord | None:
        """The stage's record when it finished and its files still hash to it, else None."""
        rec = manifest.stage(name)
        if rec is None:
            return None
        try:
            check_tree(self.stage_dir(name), rec.outputs, name)
        except ExportError:
            return None
        return rec


def versions() -> dict[str, str]:
    """The package versions a manifest records (part of every stage key that they change)."""
    from quantize import __version__

    out = {"quantize": __version__, "python": platform.python_version()}
    for pkg in _VERSIONED:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "absent"
    return out
