"""The repo contents: its name, the model card's inputs, the provenance files, the folder.

The folder holds exactly what the Hub repo will: the export's files (hard links, byte for
byte, minus its manifest, which is shipped scrubbed under quantize/), README.md and the raw
results. It is built aside and renamed into place, so a killed publish never leaves a
half-written folder that a later upload would push.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from quantize.errors import PublishError
from quantize.report.card import (
    BaseInfo,
    Calibration,
    CardInputs,
    build_card,
    default_repo_name,
    dumps_json,
)
from quantize.run.files import atomic_dir, link_or_copy
from quantize.run.manifest import MANIFEST
from quantize.spec.recipe import Recipe
from quantize.stages.publish.run_files import Json, RunFiles

PROVENANCE_DIR = "quantize"  # raw results shipped next to the card
# Hub repo and namespace names: letters, digits, `-`, `_`, `.`; no `--`/`..`; <= 96 chars.
_HUB_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$")


def repo_id_for(org: str, name: str | None, base: BaseInfo, recipe: Recipe) -> str:
    repo = name or default_repo_name(base.name, recipe)
    for what, value in (("--org", org), ("--name", repo)):
        if not _HUB_NAME.match(value) or "--" in value or ".." in value:
            raise PublishError(problem=f"{what} {value!r} is not a valid Hub name",
                               hint="use letters, digits, '-', '_' and '.', at most 96 "
                                    "characters, no '--' or '..', starting and ending with a "
                                    "letter or digit")
    return f"{org}/{repo}"


def _scrub_paths(obj: Any) -> Any:
    """Local absolute paths (which may name users or machines) → `<local>/<basename>`."""
    if isinstance(obj, dict):
        return {k: _scrub_paths(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_scrub_paths(v) for v in obj]
    if isinstance(obj, str) and (obj.startswith(("/", "~")) or re.match(r"^[A-Za-z]:\\", obj)):
        return f"<local>/{Path(obj).name}"
    return obj


def provenance(run: RunFiles) -> dict[str, Json]:
    """The raw results shipped in the repo under quantize/, local paths scrubbed."""
    files = {f"{PROVENANCE_DIR}/export-manifest.json": run.export_manifest_json}
    for name, data in (("eval", run.eval), ("gate", run.gate), ("verify", run.verify)):
        if data is not None:
            files[f"{PROVENANCE_DIR}/{name}.json"] = data
    return {rel: _scrub_paths(data) for rel, data in files.items()}


def _has_chat_template(export: Path) -> bool:
    if (export / "chat_template.jinja").is_file():
        return True
    tok_cfg = export / "tokenizer_config.json"
    return tok_cfg.is_file() and "chat_template" in json.loads(tok_cfg.read_text())


def card_inputs(run: RunFiles, base: BaseInfo, repo_id: str, forced: bool,
                extra_files: list[str]) -> CardInputs:
    em, m = run.export_manifest, run.manifest
    calibrate = m.stage("calibrate")
    calibration = em.calibration or (calibrate.summary if calibrate else None)
    return CardInputs(
        repo_id=repo_id, run=m.run or run.dir.name, base=base, recipe=run.recipe,
        recipe_text=run.recipe_text, config=run.config,
        calibration=Calibration.read(calibration), versions=em.versions or m.versions,
        group_size=m.preflight.group_size if m.preflight else None,
        layers=(m.preflight.layers or None) if m.preflight else None,
        weights_bytes=sum(p.stat().st_size for p in run.export.glob("*.safetensors")),
        has_chat_template=_has_chat_template(run.export), eval=run.eval, gate=run.gate,
        verify=run.verify, forced=forced, force_reason=run.refusal, extra_files=extra_files)


def write_repo(run: RunFiles, inputs: CardInputs, extra: dict[str, Json], folder: Path) -> None:
    """The exact repo contents, built aside and renamed into place."""
    with atomic_dir(folder) as tmp:
        for src in sorted(run.export.rglob("*")):
            rel = src.relative_to(run.export).as_posix()
            if src.is_file() and rel != MANIFEST:
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                link_or_copy(src, tmp / rel)
        (tmp / "README.md").write_text(str(build_card(inputs)), encoding="utf-8")
        for rel, data in extra.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(dumps_json(data), encoding="utf-8")
