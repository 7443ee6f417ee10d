"""The upload: one commit through huggingface_hub's commit API, retried on transient errors.

Before any request every file is pinned and hashed again (pinned.py): nothing goes up that
does not hash to what the run recorded. Then the repo is read (`model_info`): a repo that does
not exist is created; an existing one must carry this tool's marker (marker.py) unless
`--overwrite`. `HfApi.create_commit` gets a `CommitOperationAdd` per file and a
`CommitOperationDelete` per remote file that the previous marker lists (this tool uploaded
it) and the run no longer has, never `.gitattributes` nor any other file, with
`parent_commit` = the head read just before. `upload_folder(delete_patterns=...)` is not
used: with `hf_xet` installed (the default) it takes a pipelined path that may split a large
folder into several commits, it lists the remote files at the branch head rather than at the
commit it checked, and it does not say what it deleted.

create_commit asks the Hub which files it already holds with the same content and skips
them; with no change left it makes no commit and returns the head. So a retry after a lost
response makes no second commit, LFS/Xet objects that reached the Hub before a failure are not
sent again, and publishing the same run twice is a no-op.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from quantize import __version__
from quantize.errors import PublishError, first_line
from quantize.progress import info as progress
from quantize.stages.publish.marker import KEEP_REMOTE, MARKER, claim
from quantize.stages.publish.messages import redact, warn
from quantize.stages.publish.pinned import Pinned, pinned

if TYPE_CHECKING:
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import ModelInfo

_TRANSIENT_STATUS = {408, 412, 429, 500, 502, 503, 504}


# --- credentials ---------------------------------------------------------------------------
def hub_token() -> str:
    """HF_TOKEN, else the stored login; never printed."""
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise PublishError(problem="no Hugging Face token",
                           hint="set HF_TOKEN or run `hf auth login` (a token with write "
                                "access to the organisation), or use --dry-run")
    return token


def online_token() -> str:
    """The token, after refusing offline mode (nothing could be uploaded)."""
    from huggingface_hub import constants

    if constants.is_offline_mode():
        raise PublishError(problem="HF_HUB_OFFLINE is set, so nothing can be uploaded",
                           hint="unset it, or use --dry-run")
    return hub_token()


def endpoint() -> str:
    """HF_ENDPOINT read now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


# --- errors --------------------------------------------------------------------------------
def _status(exc: BaseException) -> int | None:
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(exc, HfHubHTTPError):
        return exc.response.status_code
    return None


def is_transient(exc: BaseException) -> bool:
    """Worth retrying: rate limits, server errors, a concurrent push (412), dropped or
    timed-out connections; never offline mode (a ConnectionError too)."""
    import httpx
    from huggingface_hub.errors import OfflineModeIsEnabled

    status = _status(exc)
    if status is not None:
        return status in _TRANSIENT_STATUS
    if isinstance(exc, OfflineModeIsEnabled):
        return False
    return isinstance(exc, (httpx.TransportError, ConnectionError, TimeoutError))


def _hint(exc: BaseException, repo_id: str) -> str | None:
    """What to do about a failure, by huggingface_hub's error type and the HTTP status."""
    import httpx
    from huggingface_hub.errors import (
        BadRequestError,
        DisabledRepoError,
        GatedRepoError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

    status = _status(exc)
    org = repo_id.split("/")[0]
    if isinstance(exc, GatedRepoError):
        return f"{repo_id} is gated and the token has no access; use a token of {org!r}"
    if isinstance(exc, DisabledRepoError):
        return f"{repo_id} is disabled on the Hub; publish under another --name"
    if isinstance(exc, RepositoryNotFoundError) or status == 404:
        return f"{repo_id} was not found; check --org/--name and the token's access"
    if isinstance(exc, OfflineModeIsEnabled):
        return "HF_HUB_OFFLINE is set; unset it, or use --dry-run"
    if isinstance(exc, BadRequestError):
        return "the Hub rejected the request, e.g. the model card's metadata"
    if status == 401:
        return "the Hub refused the token; check HF_TOKEN or `hf auth login`"
    if status == 403:
        return (f"the token may not write to {org!r}; use a write token of a member of that "
                "organisation")
    if status == 409:
        return (f"{repo_id} exists, but the token cannot read it (or someone created it "
                "meanwhile); publish under another --name")
    if status == 412:
        return "someone else pushed to the repo meanwhile; run publish again"
    if status is not None and status in _TRANSIENT_STATUS:
        return "the Hub is busy or failing; try again later"
    if isinstance(exc, (httpx.TransportError, ConnectionError, TimeoutError)):
        return f"could not reach {endpoint()}; check the network and HF_ENDPOINT"
    return None


def failure(exc: BaseException, repo_id: str, token: str | None) -> PublishError:
    """A failed upload in one line, without the token: what failed (`problem`, the client's
    first line) and, where the answer tells, what to do (`hint`, in brackets)."""
    from huggingface_hub.errors import HfHubHTTPError

    detail = first_line(exc)
    server = exc.server_message if isinstance(exc, HfHubHTTPError) else None
    if detail.endswith(":") and server:  # e.g. "Bad request:", the reason on the next line
        detail += " " + first_line(ValueError(server))
    problem = redact(f"publishing {repo_id} failed: {detail}", token)
    hint = _hint(exc, repo_id)
    hint = redact(hint, token) if hint else None
    return PublishError(problem + (f" ({hint})" if hint else ""), problem=problem, hint=hint)


def explain(exc: BaseException, repo_id: str, token: str | None) -> str:
    """One line for a failed upload, without the token."""
    return str(failure(exc, repo_id, token))


# --- the upload ----------------------------------------------------------------------------
@dataclass
class Pushed:
    commit: str
    head_before: str | None  # the head seen by the FIRST attempt
    deleted: list[str]
    private: bool | None
    overwritten: bool = False  # --overwrite let it write to a repo that was not its own


_UNSEEN = "<unseen>"


@dataclass
class _Attempts:
    """What the attempts of one upload share: the head the first one saw, whether the upload
    was announced."""

    first_head: str | None = _UNSEEN
    announce: bool = True


def _repo_info(api: HfApi, repo_id: str, private: bool) -> tuple[ModelInfo, bool]:
    """The repo's info, creating it when it does not exist: (info, whether it existed)."""
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        return api.model_info(repo_id, files_metadata=True), True
    except RepositoryNotFoundError:
        pass
    api.create_repo(repo_id, private=private, exist_ok=False)
    return api.model_info(repo_id, files_metadata=True), False


def _push_once(api: HfApi, files: Pinned, repo_id: str, private: bool, message: str,
               description: str, marker: dict[str, str], overwrite: bool,
               seen: _Attempts) -> Pushed:
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    info, existed = _repo_info(api, repo_id, private)
    if seen.first_head == _UNSEEN:
        seen.first_head = info.sha
    deletable: set[str] = set()
    overwritten = False
    if existed:
        got = claim(api, info, marker, overwrite=overwrite)
        deletable, overwritten = got.deletable, got.overwritten
    stale = sorted(deletable - set(files.plan) - KEEP_REMOTE - {MARKER})
    if seen.announce:  # once the repo is known to be ours to write
        seen.announce = False
        from rich.markup import escape

        progress(escape(f"uploading {len(files.plan)} files to {repo_id} ({endpoint()})"))
    ops: list[CommitOperationAdd | CommitOperationDelete] = list(files.ops())
    ops += [CommitOperationDelete(path_in_repo=rel) for rel in stale]
    # parent_commit: if someone else pushes meanwhile the Hub answers 412 and we retry.
    commit = api.create_commit(repo_id, ops, commit_message=message,
                               commit_description=description,
                               parent_commit=info.sha)
    # A retry after a lost response finds its own commit already there: "changed" is judged
    # against the head the first attempt saw.
    return Pushed(commit.oid, seen.first_head, stale, info.private, overwritten)


def upload(root: Path, folder: tuple[str, ...], plan: dict[str, tuple[int, str]],
           repo_id: str, *, private: bool, token: str, message: str, description: str,
           marker: dict[str, str], overwrite: bool, retries: int, backoff_s: float) -> Pushed:
    """Pin and re-hash the staged folder `root/folder...` (exactly the files of `plan`),
    check the repo is this tool's (or create it), and push the files as one commit;
    transient errors retry the whole step with exponential backoff (safe: see the module
    docstring). A refusal comes before any write to the Hub."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint(), token=token, library_name="quantize",
                library_version=__version__)
    seen = _Attempts()
    with pinned(root, folder, plan) as files:
        for attempt in range(1, retries + 1):
            try:
                return _push_once(api, files, repo_id, private, message, description, marker,
                                  overwrite, seen)
            except PublishError:
                raise
            except Exception as exc:  # any message may quote the token: all are redacted
                if not is_transient(exc) or attempt == retries:
                    raise failure(exc, repo_id, token) from None
                wait = backoff_s * 2 ** (attempt - 1)
                warn(redact(f"transient Hub error ({type(exc).__name__}: "
                            f"{(str(exc).splitlines() or [''])[0]}); retry "
                            f"{attempt}/{retries - 1} in {wait:.1f}s", token))
                time.sleep(wait)
    raise AssertionError("unreachable")
