"""The repo contents: its name, the model card's inputs, the provenance files, the folder.

The folder holds exactly what the Hub repo will: the files the export's manifest record lists
(hard links, byte for byte, each opened without following links; minus its manifest, which is
shipped scrubbed under quantize/), README.md, the raw results and the repo marker
(quantize/repo.json, marker.py). It is built aside and renamed into place, so a killed
publish never leaves a half-written folder that a later upload would push. `write_repo`
returns what it holds, rel path → (size, sha256): the upload sends exactly that.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from quantize.errors import PublishError
from quantize.recipe.recipe import Recipe
from quantize.report.card import (
    BaseInfo,
    Calibration,
    CardInputs,
    build_card,
    default_repo_name,
    dumps_json,
)
from quantize.run.files import atomic_dir
from quantize.run.manifest import MANIFEST
from quantize.stages.publish.marker import MARKER, marker_json
from quantize.stages.publish.messages import refused, warn
from quantize.stages.publish.nofollow import open_file, parts_of, read_file
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


def _has_chat_template(run: RunFiles) -> bool:
    if "chat_template.jinja" in run.files:
        return True
    if "tokenizer_config.json" not in run.files:
        return False
    try:
        cfg = json.loads(read_file(run.dir, ("export", "tokenizer_config.json")))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(cfg, dict) and "chat_template" in cfg


def _weights_bytes(run: RunFiles) -> int:
    return sum((run.export / rel).lstat().st_size for rel in run.files
               if "/" not in rel and rel.endswith(".safetensors"))


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
        weights_bytes=_weights_bytes(run),
        has_chat_template=_has_chat_template(run), eval=run.eval, gate=run.gate,
        verify=run.verify, forced=forced, force_reason=run.refusal, extra_files=extra_files)


def _copy_fd(fd: int, dst: Path) -> None:
    with open(dst, "xb") as out:
        offset = 0
        while chunk := os.pread(fd, 8 << 20, offset):
            out.write(chunk)
            offset += len(chunk)


def _stage_export_file(run: RunFiles, rel: str, dst: Path) -> int:
    """Hard-link (else copy) one listed export file into the folder; its size. The link is
    checked to be the inode that was opened without following links."""
    parts = ("export", *parts_of(rel, run.dir / MANIFEST))
    src = run.dir.joinpath(*parts)
    fd = open_file(run.dir, parts)
    try:
        st = os.fstat(fd)
        try:
            os.link(src, dst, follow_symlinks=False)
        except OSError:  # another file system (a dry run's --out), or links not allowed
            _copy_fd(fd, dst)
        else:
            got = os.lstat(dst)
            if (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino):
                raise refused(f"{src} changed while publish read it", "run publish again", src)
        return st.st_size
    finally:
        os.close(fd)


def _write_new(path: Path, data: bytes) -> tuple[int, str]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "xb") as f:  # a new file: never written through a link
        f.write(data)
    return len(data), hashlib.sha256(data).hexdigest()


def write_repo(run: RunFiles, inputs: CardInputs, extra: dict[str, Json],
               folder: Path) -> dict[str, tuple[int, str]]:
    """The exact repo contents, built aside and renamed into place; rel path → (size,
    sha256) of every file in it (the export's as the run manifest recorded them)."""
    own = {"README.md": str(build_card(inputs)).encode()}
    own |= {rel: dumps_json(data).encode() for rel, data in extra.items()}
    shadowed = sorted(rel for rel in run.files
                      if rel in own or rel == MARKER or rel.startswith(f"{PROVENANCE_DIR}/"))
    if shadowed:
        warn(f"the export's {shadowed} are not uploaded: publish writes its own files there")
    files = {rel: sha for rel, sha in run.files.items() if rel not in shadowed}
    plan: dict[str, tuple[int, str]] = {}
    with atomic_dir(folder) as tmp:
        for rel in sorted(files):
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            plan[rel] = (_stage_export_file(run, rel, tmp / rel), files[rel])
        for rel, data in own.items():
            plan[rel] = _write_new(tmp / rel, data)
        fields = marker_fields(run, inputs.base)
        plan[MARKER] = _write_new(tmp / MARKER, marker_json(fields["recipe"],
                                                            fields["base_model"], list(plan)))
    return plan


def marker_fields(run: RunFiles, base: BaseInfo) -> dict[str, str]:
    """What the repo marker says this repo holds (compared with an existing repo's)."""
    return {"recipe": run.recipe.name, "base_model": base.repo_id or base.name}
