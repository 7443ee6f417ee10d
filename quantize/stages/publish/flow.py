"""publish itself: read the run, refuse what must not ship, write the repo folder, push it.

Everything happens under the run's lock. The token is asked for (and offline mode refused)
before any file is written, the repo folder is staged before any request (so a killed
publish resumes by running again), and each push is recorded in <run>/publish/publish.json.
A dry run's `--out` must lie outside the run folder (inside it, a later stage or publish
could pick its files up); the staging folder <run>/publish/<org>/<name> is reached through
no link.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from quantize import __version__
from quantize.errors import PublishError, compose
from quantize.run.files import atomic_write_json, now, pause_point
from quantize.run.lock import private_dir, run_lock
from quantize.stages.publish.base import resolve_base
from quantize.stages.publish.hub import endpoint, online_token, upload
from quantize.stages.publish.messages import refused, warn
from quantize.stages.publish.nofollow import check_folders
from quantize.stages.publish.repo import (
    card_inputs,
    marker_fields,
    provenance,
    repo_id_for,
    write_repo,
)
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
    overwrite: bool = False  # write to an existing repo this tool did not make (or another model's)
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
    overwritten: bool = False


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
        "private": result.private, "forced": result.forced,
        "overwritten": result.overwritten, "at": now(),
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


def _out_error(problem: str, hint: str, out: Path) -> PublishError:
    return PublishError(compose(problem, hint), problem=problem, hint=hint, path=out)


def _check_out(out: Path, run_dir: Path) -> None:
    """A dry run's folder: outside the run, new or empty."""
    where, run = out.resolve(), run_dir.resolve()
    if where == run or run in where.parents or where in run.parents:
        raise _out_error(f"--out {out} is inside the run folder {run_dir} (or holds it), "
                         "where the run's stages and publish would pick its files up",
                         "give a folder outside the run, or leave --out out (the dry run "
                         "then writes <run>/publish/<org>/<name>)", out)
    if out.is_symlink() or (out.exists() and (not out.is_dir() or any(out.iterdir()))):
        raise _out_error(f"--out {out} exists and is not empty", "give a new folder", out)


def publish(opts: PublishOptions) -> PublishResult:
    run_dir = opts.run
    if not run_dir.is_dir():
        raise PublishError(path=run_dir, path_sep=" ", problem="does not exist",
                           hint="give a run folder (runs/<model>-<recipe>)")
    if opts.dry_run and opts.out is not None:
        _check_out(opts.out, run_dir)
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
        staged = (NAME, opts.org, repo_id.split("/")[1])
        folder = dry_out or run_dir.joinpath(*staged)
        if dry_out is None:
            check_folders(run_dir, staged)
            # <run>/publish holds what goes to (possibly private) repos with the token, and
            # the record of each push: user-only
            private_dir(run_dir / NAME)
        files = write_repo(run, inputs, extra, folder)
        pause_point("publish:staged")
        result = PublishResult(repo_id, folder, dict(sorted(files.items())), opts.private,
                               opts.dry_run, forced)
        if token is None:  # the dry run
            return result
        message, description = _commit_text(run, forced)
        pushed = upload(run_dir, staged, files, repo_id, private=opts.private, token=token,
                        message=message, description=description,
                        marker=marker_fields(run, base), overwrite=opts.overwrite,
                        retries=opts.retries, backoff_s=opts.backoff_s)
        result.commit = pushed.commit
        result.changed = pushed.commit != pushed.head_before
        result.deleted = pushed.deleted if result.changed else []
        result.url = f"{endpoint()}/{repo_id}"
        result.overwritten = pushed.overwritten
        if pushed.overwritten:
            warn(f"--overwrite: {repo_id} was not this run's model; files of the same names "
                 "were replaced, and only files an earlier quantize publish listed in its "
                 "marker were deleted")
        if pushed.private is not None and pushed.private != opts.private:
            warn(f"{repo_id} already exists as {'private' if pushed.private else 'public'}; "
                 "its visibility was left unchanged (change it in the repo settings)")
            result.private = pushed.private
        _record(run_dir, result)
        return result
