"""publish itself: read the run, refuse what must not ship, write the repo folder, push it.

Everything happens under the run's lock. The token is asked for (and offline mode refused)
before any file is written, the repo folder is staged before any request (so a killed
publish resumes by running again), and each push is recorded in <run>/publish/publish.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from quantize import __version__
from quantize.errors import PublishError
from quantize.progress import info
from quantize.run.files import atomic_write_json, hash_tree, now, pause_point
from quantize.run.lock import private_dir, run_lock
from quantize.stages.publish.base import resolve_base
from quantize.stages.publish.hub import endpoint, online_token, upload
from quantize.stages.publish.messages import refused, warn
from quantize.stages.publish.repo import card_inputs, provenance, repo_id_for, write_repo
from quantize.stages.publish.run_files import RunFiles, read_run

NAME = "publish"


@dataclass
class PublishOptions:
    run: Path
    org: str
    name: str | None = None
    private: bool = True
    dry_run: bool = False
    force: bool = False
    out: Path | None = None  # where the dry run writes the repo contents
    base_model: str | None = None  # Hub id of the base model when the run cannot tell
    license: str | None = None
    retries: int = 4
    backoff_s: float = 2.0


@dataclass
class PublishResult:
    repo_id: str
    folder: Path
    files: dict[str, tuple[int, str]]  # rel path → (bytes, sha256)
    private: bool
    dry_run: bool
    forced: bool
    commit: str | None = None
    url: str | None = None
    changed: bool = False
    deleted: list[str] = field(default_factory=list)


def _record(run_dir: Path, result: PublishResult) -> None:
    """Append this push to <run>/publish/publish.json (a list, oldest first)."""
    path = run_dir / NAME / "publish.json"
    try:
        history = json.loads(path.read_text()) if path.is_file() else []
    except (OSError, json.JSONDecodeError):
        history = []
    history.append({
        "repo_id": result.repo_id, "endpoint": endpoint(), "commit": result.commit,
        "url": result.url, "changed": result.changed, "deleted": result.deleted,
        "private": result.private, "forced": result.forced, "at": now(),
        "files": {rel: sha for rel, (_, sha) in result.files.items()},
    })
    atomic_write_json(path, history)


def _commit_text(run: RunFiles, forced: bool) -> tuple[str, str]:
    verdict = (run.gate or {}).get("verdict", "not gated")
    message = f"quantize {__version__}: {run.recipe.name} (gate {verdict}" + \
        (", forced)" if forced else ")")
    recipe = run.manifest.recipe
    sha = str(recipe.sha256 if recipe and recipe.sha256 else None)[:12]
    description = (f"Run `{run.manifest.run or run.dir.name}`, export key "
                   f"{(run.export_key or '?')[:12]}, recipe sha256 {sha}.")
    return message, description


def _refuse_or_force(run: RunFiles, force: bool) -> bool:
    """Whether the release is forced; refuses a failed or absent gate without --force."""
    if run.refusal and not force:
        fix = ("run `quantize gate RUN` (it evaluates first)" if run.gate is None else
               "try a gentler recipe")
        raise refused(run.refusal, f"{fix}, or pass --force to publish anyway (the card will "
                      "say so)")
    return bool(run.refusal)


def publish(opts: PublishOptions) -> PublishResult:
    from rich.markup import escape

    run_dir = opts.run
    if not run_dir.is_dir():
        raise PublishError(path=run_dir, path_sep=" ", problem="does not exist",
                           hint="give a run folder (runs/<model>-<recipe>)")
    with run_lock(run_dir):
        run = read_run(run_dir)
        forced = _refuse_or_force(run, opts.force)
        token = None if opts.dry_run else online_token()
        if forced:
            warn(f"--force: publishing although {run.refusal}; the model card says so")
        base = resolve_base(run, opts.base_model, opts.license)
        if base.repo_id is None:
            warn("the base model's Hub id is unknown, so the card has no `base_model`; pass "
                 "--base-model ORG/NAME")
        if base.license is None:
            warn("the base model's licence is unknown, so the card has none; pass --license")
        repo_id = repo_id_for(opts.org, opts.name, base, run.recipe)
        extra = provenance(run)
        inputs = card_inputs(run, base, repo_id, forced, sorted(extra))
        dry_out = opts.out if opts.dry_run else None
        folder = dry_out or run_dir / NAME / opts.org / repo_id.split("/")[1]
        if dry_out and folder.exists() and any(folder.iterdir()):
            raise PublishError(problem=f"--out {folder} exists and is not empty",
                               hint="give a new folder")
        if dry_out is None:
            # <run>/publish holds what goes to (possibly private) repos with the token, and
            # the record of each push: user-only
            private_dir(run_dir / NAME)
        write_repo(run, inputs, extra, folder)
        pause_point("publish:staged")
        files = {rel: ((folder / rel).stat().st_size, sha)
                 for rel, sha in hash_tree(folder).items()}
        result = PublishResult(repo_id, folder, files, opts.private, opts.dry_run, forced)
        if token is None:  # the dry run
            return result
        message, description = _commit_text(run, forced)
        info(escape(f"uploading {len(files)} files to {repo_id} ({endpoint()})"))
        pushed = upload(folder, repo_id, private=opts.private, token=token, message=message,
                        description=description, retries=opts.retries,
                        backoff_s=opts.backoff_s)
        result.commit = pushed.commit
        result.changed = pushed.commit != pushed.head_before
        result.deleted = pushed.deleted if result.changed else []
        result.url = f"{endpoint()}/{repo_id}"
        if pushed.private is not None and pushed.private != opts.private:
            warn(f"{repo_id} already exists as {'private' if pushed.private else 'public'}; "
                 "its visibility was left unchanged (change it in the repo settings)")
            result.private = pushed.private
        _record(run_dir, result)
        return result
