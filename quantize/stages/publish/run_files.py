"""Reading a run for release: everything the card and the upload need, checked.

Refused (PublishError) is whatever must not ship: an export that is missing, incomplete or no
longer matches the manifest's hashes, or that holds anything the manifest does not list (a
dotfile, a file copied in later) or anything but regular files (a symbolic link, a FIFO, a
socket, a device; nofollow.py reads the run without following links); a manifest path that is
not a plain relative path; eval/gate results that do not match their hashes or belong to an
older export (the stage-key chain); a failed verification. What ships from the export is
exactly `RunFiles.files`: the files its manifest record lists, with their sha256. A failed or absent
gate is not refused here but named in `RunFiles.refusal` (publish refuses it unless
`--force`).

Verify is a recorded stage: its manifest record's `inputs.export` names the export it
checked. A verify result counts only when that is the current export's key; a record for
another export is refused, and a verify.json with no record (run folders written before
verify was recorded) is left out, so the card says "not verified". File times are never
used to judge freshness.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from quantize.errors import ExportError, QuantizeError
from quantize.model.config import ModelConfig
from quantize.recipe.recipe import Recipe
from quantize.recipe.yamlio import parse_model
from quantize.run.files import check_tree
from quantize.run.manifest import MANIFEST, ExportManifest, Manifest, RunFolder
from quantize.stages.publish.messages import redact, refused, refused_by, warn
from quantize.stages.publish.nofollow import parts_of, read_file, regular_files

Json = dict[str, Any]  # a result file as its stage wrote it (shipped verbatim, scrubbed)


@dataclass
class RunFiles:
    """A run folder read and checked: everything the card and the upload need."""

    dir: Path
    manifest: Manifest
    export: Path
    export_manifest: ExportManifest
    export_manifest_json: Json  # the file as written (shipped scrubbed under quantize/)
    config: ModelConfig  # the export's config.json
    recipe: Recipe
    recipe_text: str
    eval: Json | None
    gate: Json | None
    verify: Json | None
    refusal: str  # why the gate does not allow a release ("" when it does)
    files: dict[str, str]  # what ships from the export: rel path → sha256 (manifest aside)

    @property
    def export_key(self) -> str:
        rec = self.manifest.stage("export")
        return rec.key if rec else ""


def _recorded(folder: RunFolder, manifest: Manifest, stage: str, rel: str) -> bytes:
    """A file of a finished stage, read without following links, whose bytes still hash to
    what the manifest recorded (read once: what is checked is what is used)."""
    path = folder.stage_dir(stage) / rel
    rec = manifest.stage(stage)
    expected = rec.outputs.get(rel) if rec else None
    if expected is None:
        raise refused(f"{path} is not recorded in the run manifest",
                      "re-run the stage that writes it", path)
    data = read_file(folder.path, (stage, *parts_of(rel, folder.manifest_path)))
    if hashlib.sha256(data).hexdigest() != expected:
        raise refused(f"{path} does not match its recorded sha256 (changed or truncated)",
                      "delete it and re-run", path)
    return data


def _json(folder: RunFolder, manifest: Manifest, stage: str, rel: str, what: str) -> Json:
    path = folder.stage_dir(stage) / rel
    try:
        data = json.loads(_recorded(folder, manifest, stage, rel).decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise refused(f"{what} {path} is not valid JSON", "re-run the stage that writes it",
                      path) from None
    if not isinstance(data, dict):
        raise refused(f"{what} {path} is not a JSON object", "re-run its stage", path)
    return data


def _check_stage_files(folder: RunFolder, manifest: Manifest, stage: str,
                       only_listed: bool = False) -> dict[str, str]:
    """The stage's recorded files, checked: plain paths, regular files (nothing followed),
    each matching its sha256; with `only_listed`, nothing else in the folder either."""
    rec = manifest.stage(stage)
    outputs = rec.outputs if rec else {}
    for rel in outputs:
        parts_of(rel, folder.manifest_path)
    found = regular_files(folder.path, (stage,))
    if only_listed and (extra := sorted(found - set(outputs))):
        path = folder.stage_dir(stage) / extra[0]
        raise refused(f"{path} is not a file the run wrote (the run manifest does not list it)",
                      "remove it: publish uploads only the files the manifest lists", path)
    try:
        check_tree(folder.stage_dir(stage), outputs, stage)
    except ExportError as exc:
        raise refused_by(exc) from None
    return dict(outputs)


def _check_metrics(ev: Json, path: Path) -> None:
    need = ("name", "baseline", "candidate", "recovery", "threshold")
    rows = ev.get("metrics")
    if not isinstance(rows, list) or not rows:
        raise refused(f"{path} has no `metrics` list", "re-run the eval stage", path)
    for row in rows:
        missing = [k for k in need if not isinstance(row, dict) or row.get(k) is None]
        if missing:
            raise refused(f"{path}: a metric lacks {missing}", "re-run the eval stage", path)


def _read_eval_gate(folder: RunFolder, manifest: Manifest, export_key: str
                    ) -> tuple[Json | None, Json | None, str]:
    """eval.json and gate.json, checked; and why the gate does not allow a release."""
    ev_rec, gate_rec = manifest.stage("eval"), manifest.stage("gate")
    ev = gate = None
    if ev_rec is not None:
        _check_stage_files(folder, manifest, "eval")
        if ev_rec.inputs.get("export") not in (None, export_key):
            raise refused("the eval results belong to an older export",
                          "re-run `quantize run` to evaluate the current one")
        ev = _json(folder, manifest, "eval", "eval.json", "eval result")
        _check_metrics(ev, folder.stage_dir("eval") / "eval.json")
    if gate_rec is not None:
        if ev_rec is None:
            raise refused("the run has a gate result but no eval result",
                          "re-run `quantize run`")
        _check_stage_files(folder, manifest, "gate")
        if gate_rec.inputs.get("eval") not in (None, ev_rec.key):
            raise refused("the gate result belongs to an older eval",
                          "re-run `quantize run` to gate the current one")
        gate = _json(folder, manifest, "gate", "gate.json", "gate result")
    if gate is None:
        return ev, None, "the run has not been evaluated and gated"
    failures = [str(f) for f in gate.get("failures") or []]
    if gate.get("verdict") != "pass" or gate.get("releasable") is False \
            or manifest.releasable is False:
        return ev, gate, ("the release gate failed on " + (", ".join(failures) or
                                                          f"verdict {gate.get('verdict')!r}"))
    return ev, gate, ""


def _unproven_consumers(gate: Json | None, recipe: Recipe) -> str:
    """Why the gate does not vouch for the consumers the recipe advertises ("" when it does):
    every one the eval measures must have a passing row (a gate from before consumer rows
    has none; vLLM is `quantize verify`'s to check, and the card lists it only then)."""
    from quantize.recipe.consumers import CONSUMERS, row_name

    if gate is None:
        return ""
    verdicts = {r.get("name"): r.get("verdict") for r in gate.get("rows") or []}
    missing = [c for c in recipe.advertised_consumers
               if CONSUMERS[c].measured_by == "eval" and verdicts.get(row_name(c)) != "pass"]
    if not missing:
        return ""
    return (f"the gate does not show that {', '.join(missing)} load this export right (no "
            "passing consumer row; re-run `quantize run` to measure them)")


def _read_verify(folder: RunFolder, manifest: Manifest, export_key: str) -> Json | None:
    """verify.json when the manifest records it for the current export (see the module
    docstring); a failed verification is refused."""
    rec = manifest.stage("verify")
    path = folder.stage_dir("verify") / "verify.json"
    if rec is None or rec.inputs.get("export") is None:
        if path.is_file():
            warn(f"{path} is not recorded in the run manifest for an export, so the card says "
                 "`not verified`; re-run `quantize verify` on the run")
        return None
    if rec.inputs["export"] != export_key:
        raise refused("the verify result belongs to an older export", "re-run `quantize verify`")
    _check_stage_files(folder, manifest, "verify")
    result = _json(folder, manifest, "verify", "verify.json", "verify result")
    if result.get("passed") is False:
        why = result.get("result") or result.get("error") or "see verify.json"
        raise refused(redact(f"verification at level {result.get('level')!r} failed ({why})",
                             None), "fix the export and re-run `quantize verify`")
    return result


def _read_manifest(folder: RunFolder) -> Manifest:
    if folder.manifest_path.is_symlink():
        raise refused(f"{folder.manifest_path} is a symbolic link",
                      "publish reads only the manifest the run wrote", folder.manifest_path)
    if not folder.is_run():
        raise refused(f"{folder.path} is not a run folder (no {MANIFEST})",
                      "give the folder `quantize run` wrote (runs/<model>-<recipe>)", folder.path)
    try:
        return folder.read()
    except ExportError as exc:
        raise refused_by(exc) from None


def _read_export_manifest(folder: RunFolder, manifest: Manifest
                          ) -> tuple[ExportManifest, Json]:
    raw = _json(folder, manifest, "export", MANIFEST, "export manifest")
    try:
        return ExportManifest.model_validate(raw), raw
    except ValidationError as exc:
        where = ".".join(str(x) for x in exc.errors()[0]["loc"])
        path = folder.export / MANIFEST
        raise refused(f"{path} is not an export manifest this version reads ({where}: "
                      f"{exc.errors()[0]['msg']})", "re-export the run", path) from None


def read_run(run_dir: Path) -> RunFiles:
    """Read and check everything a release needs; raise PublishError on what must not ship."""
    from quantize.stages.export import check_checkpoint

    folder = RunFolder(run_dir)
    manifest = _read_manifest(folder)
    export_rec = manifest.stage("export")
    if export_rec is None:
        raise refused(f"{run_dir} has no finished export",
                      "run `quantize export` (or `quantize run`) first", run_dir)
    export = folder.export
    outputs = _check_stage_files(folder, manifest, "export", only_listed=True)
    try:
        config = check_checkpoint(export)
    except ExportError as exc:
        raise refused_by(exc) from None
    recipe_path = export / "recipe.yaml"
    if "recipe.yaml" not in outputs:
        raise refused(f"{recipe_path} is missing", "re-export the run", recipe_path)
    recipe_bytes = _recorded(folder, manifest, "export", "recipe.yaml")
    recipe_text = recipe_bytes.decode("utf-8", "replace")
    try:
        recipe: Recipe = parse_model(Recipe, recipe_text, str(recipe_path))
    except QuantizeError as exc:
        raise refused(f"the run's recipe no longer parses ({exc})",
                      "re-run with the current recipe", recipe_path) from None
    export_manifest, export_manifest_json = _read_export_manifest(folder, manifest)
    ev, gate, refusal = _read_eval_gate(folder, manifest, export_rec.key)
    refusal = refusal or _unproven_consumers(gate, recipe)
    verify = _read_verify(folder, manifest, export_rec.key)
    files = {rel: sha for rel, sha in outputs.items() if rel != MANIFEST}
    return RunFiles(run_dir, manifest, export, export_manifest, export_manifest_json, config,
                    recipe, recipe_text, ev, gate, verify, refusal, files)
