"""Where `quantize plan` gets a model's config.json, and which run folders quantized it.

MODEL is a run folder, a local folder, `default`, a built-in config (a shipped copy of a
public config.json, so planning works offline) or a Hub id (only config.json is fetched).
Run folders found under --runs lend a recipe row its real exported size and its measured
recovery from the gate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from quantize.errors import PlanError, QuantizeError, first_line
from quantize.model.config import CONFIG, ModelConfig, config_path, read_config
from quantize.model.qconfig import without_quant_config
from quantize.recipe.paths import DATA_DIR
from quantize.run.manifest import RunFolder

CONFIGS = DATA_DIR / "model_configs"


@dataclass
class RunInfo:
    """A finished (or partial) pipeline run folder."""

    path: Path
    recipe: str
    model_source: str
    model_path: str
    weights_bytes: int | None
    gate_verdict: str | None
    recovery: float | None  # the worst metric's recovery from gate/gate.json
    gate_note: str = ""

    @property
    def export(self) -> Path:
        return RunFolder(self.path).export


@dataclass
class ModelSource:
    spec: str
    name: str  # short name, as run folders use it
    origin: str  # builtin:<repo> | folder:<path> | hub:<id> | default | run:<path>
    config: ModelConfig  # config.json without the built-in copies' `_source` keys
    serve_ref: str  # what `vllm serve` gets for the baseline
    run: RunInfo | None = None


def _clean(config: ModelConfig) -> ModelConfig:
    return config.without(*(k for k in config.model_extra or {} if k.startswith("_")))


class ShippedSource(BaseModel):
    """Where a built-in config was copied from (its `_source` key)."""

    model_config = ConfigDict(extra="allow")

    repo_id: str


def _shipped(path: Path) -> ModelConfig:
    """A built-in config file (quantize/data/model_configs/*.json: shipped data, not a model
    folder's config.json)."""
    return ModelConfig.from_json_text(path.read_text())


def builtin_configs() -> dict[str, Path]:
    """repo id -> shipped config file."""
    return {ShippedSource.model_validate((_shipped(p).model_extra or {})["_source"]).repo_id: p
            for p in sorted(CONFIGS.glob("*.json"))}


def _builtin(spec: str) -> tuple[str, Path] | None:
    want = spec.lower()
    for repo, path in builtin_configs().items():
        if want in (repo.lower(), repo.split("/")[-1].lower()):
            return repo, path
    return None


def read_run(path: Path) -> RunInfo | None:
    """The facts of a run folder, or None if it is not one. Reads gate.json defensively."""
    folder = RunFolder(path)
    if not folder.is_run():
        return None
    try:
        manifest = folder.read()
    except (QuantizeError, OSError):
        return None
    export = manifest.stage("export")
    weights = export.summary.get("weights_bytes") if export is not None else None
    if weights is None and folder.export.is_dir():
        weights = sum(p.stat().st_size for p in folder.export.glob("*.safetensors")) or None
    verdict, recovery, note = _read_gate(folder.stage_dir("gate") / "gate.json")
    model = manifest.model
    return RunInfo(path=path, recipe=manifest.recipe.name if manifest.recipe else "",
                   model_source=model.source if model else "",
                   model_path=model.path if model else "", weights_bytes=weights,
                   gate_verdict=verdict, recovery=recovery, gate_note=note)


def _read_gate(path: Path) -> tuple[str | None, float | None, str]:
    """(verdict, worst recovery, note) from the gate stage's gate.json; a malformed file is
    ignored with a note, so one broken run does not stop the plan."""
    if not path.is_file():
        return None, None, ""
    try:
        gate = json.loads(path.read_text())
        verdict = gate.get("verdict")
        recoveries = [float(r["recovery"]) for r in gate.get("rows", [])
                      if isinstance(r, dict) and isinstance(r.get("recovery"), (int, float))]
    except (OSError, json.JSONDecodeError, AttributeError, TypeError, ValueError):
        return None, None, f"{path} is unreadable; ignored"
    if verdict not in ("pass", "fail"):
        return None, None, f"{path} has no pass/fail verdict; ignored"
    return verdict, (min(recoveries) if recoveries else None), ""


def find_runs(runs_dir: Path, name: str, spec: str) -> list[RunInfo]:
    """Run folders under runs_dir that quantized this model."""
    if not runs_dir.is_dir():
        return []
    found = []
    for child in sorted(runs_dir.iterdir()):
        info = read_run(child) if child.is_dir() else None
        if info is None:
            continue
        names = {info.model_source, Path(info.model_source).name, Path(info.model_path).name,
                 info.model_path}
        if name in names or spec in names:
            found.append(info)
    return found


def load_source(spec: str) -> ModelSource:
    """MODEL: a run folder, a local folder, `default`, a built-in config or a Hub id.
    Only config.json is read; no weights."""
    from quantize.model.source import DEFAULT_MODEL, DEFAULT_NAME, HUB_ID

    path = Path(spec).expanduser()
    run = RunFolder(path)
    if path.is_dir() and run.is_run() and run.export.is_dir():
        return _from_run(run, spec)
    if path.is_dir():
        if not config_path(path).is_file():
            raise PlanError(path=path, path_sep=" ", problem="has no config.json",
                            hint="give the folder that holds it, a run folder, a built-in model "
                                 "or a Hub id")
        return ModelSource(spec, path.resolve().name, f"folder:{path}",
                           _clean(read_config(path)), str(path))
    if spec == DEFAULT_MODEL:
        from quantize.model.source import resolve_model

        ref = resolve_model(None)
        return ModelSource(spec, DEFAULT_NAME, "default", _clean(ref.config), str(ref.path))
    hit = _builtin(spec)
    if hit:
        repo, file = hit
        return ModelSource(spec, repo.split("/")[-1], f"builtin:{repo}", _clean(_shipped(file)),
                           repo)
    if HUB_ID.match(spec):
        return ModelSource(spec, spec.split("/")[-1], f"hub:{spec}", _hub_config(spec), spec)
    raise PlanError(problem=f"model {spec!r} is not a folder, a run folder, `default`, a "
                            "built-in model or a Hub id",
                    hint=f"built-in: {', '.join(builtin_configs())}")


def _from_run(folder: RunFolder, spec: str) -> ModelSource:
    """A run folder plans its base model: the export's config.json without its quantization
    block, so the baseline row is the unquantized model."""
    path = folder.path
    run = read_run(path)
    if run is None:
        raise PlanError(path=f"{path}/manifest.json", path_sep=" ",
                        problem="is not a run manifest",
                        hint="re-run the pipeline or plan from the model itself")
    config = without_quant_config(_clean(read_config(folder.export)))
    base = Path(run.model_path)
    name = base.name or path.name
    serve = run.model_source if run.model_source not in ("", "default") else str(base)
    return ModelSource(spec, name, f"run:{path}", config, serve, run)


def _hub_config(repo: str) -> ModelConfig:
    try:
        from huggingface_hub import hf_hub_download

        file = hf_hub_download(repo, CONFIG)
    except Exception as exc:  # offline, gated, missing: all mean "no config"
        first = first_line(exc)[:160]
        raise PlanError(problem=f"cannot get config.json of {repo!r} from the Hub ({first})",
                        hint="pass a local folder with config.json or one of the built-in "
                             f"models: {', '.join(builtin_configs())}") from None
    return _clean(read_config(Path(file).parent))
