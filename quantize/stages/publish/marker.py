"""The repo marker: `quantize/repo.json`, uploaded in every publish commit, says that this
tool made the repo, for which recipe and base model, and which files it put there.

What it decides, before anything is written to the Hub (`claim`):

- a repo that does not exist is created (and is then ours); so is an empty one (nothing but
  `.gitattributes`: what a publish that created the repo and then failed or was killed
  leaves; there is nothing in it to replace);
- an existing repo with files but without a valid marker was not made by `quantize`:
  refused unless `--overwrite` (then this run's files are added and replace same-named ones;
  none of the repo's other files is deleted);
- a marker naming another recipe or base model means the repo holds another model: refused
  unless `--overwrite`;
- files are deleted only when the previous marker lists them (this tool uploaded them) and
  this run does not have them; never `.gitattributes`, never a file the marker does not name.

The marker is a guard against mistakes, not an access control: anyone who may write to the
repo may also write its marker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from quantize.stages.publish.messages import refused

if TYPE_CHECKING:
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import ModelInfo

MARKER = "quantize/repo.json"
TOOL = "quantize"
KEEP_REMOTE = frozenset({".gitattributes"})  # never deleted by a publish
_MAX_MARKER = 1 << 20


def marker_json(recipe: str, base_model: str, files: list[str]) -> bytes:
    """The marker's bytes: stable for the same run, so re-publishing it changes nothing."""
    data = {"tool": TOOL, "schema": 1, "recipe": recipe, "base_model": base_model,
            "files": sorted(f for f in files if f != MARKER)}
    return (json.dumps(data, indent=2) + "\n").encode()


@dataclass
class Claim:
    deletable: set[str]  # remote files this tool uploaded before (listed in the old marker)
    overwritten: bool  # the repo was not (or not for this model) ours: --overwrite was given


def _fetch(api: HfApi, repo_id: str, revision: str) -> bytes | None:
    """The marker's bytes at `revision` (at most 1 MiB, else None); read straight from the
    resolve URL, so nothing is written to the Hugging Face cache."""
    from urllib.parse import quote

    from huggingface_hub import get_session
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

    # the resolve URL built on the endpoint the API uses (hf_hub_url only swaps the endpoint
    # it read at import)
    url = f"{api.endpoint}/{repo_id}/resolve/{quote(revision, safe='')}/{quote(MARKER)}"
    headers = build_hf_headers(token=api.token, library_name="quantize")
    out = b""
    with get_session().stream("GET", url, headers=headers, follow_redirects=True) as resp:
        hf_raise_for_status(resp)
        for chunk in resp.iter_bytes():
            out += chunk
            if len(out) > _MAX_MARKER:
                return None
    return out


def _remote_marker(api: HfApi, info: ModelInfo) -> dict[str, Any] | None:
    """The repo's marker at the head we read, if it is a marker of this tool."""
    sizes = {s.rfilename: s.size for s in info.siblings or []}
    if MARKER not in sizes or (sizes[MARKER] or 0) > _MAX_MARKER or info.sha is None:
        return None
    raw = _fetch(api, info.id, info.sha)
    try:
        data = json.loads(raw) if raw is not None else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or data.get("tool") != TOOL \
            or not isinstance(data.get("files"), list):
        return None
    return data


def claim(api: HfApi, info: ModelInfo, ours: dict[str, str], *, overwrite: bool) -> Claim:
    """Whether this publish may write to the existing repo `info`, and what it may delete
    there (see the module docstring); `ours`: this run's marker fields (recipe, base_model)."""
    repo_id = info.id
    remote = {s.rfilename for s in info.siblings or []}
    old = _remote_marker(api, info)
    if old is None:
        if remote <= KEEP_REMOTE:  # empty: nothing to replace (a failed first publish)
            return Claim(set(), False)
        if not overwrite:
            raise refused(f"{repo_id} already exists and was not made by quantize (it has no "
                          f"{MARKER}), so publishing could replace its files",
                          "publish under another --name, or pass --overwrite to add this "
                          "run's files to it (none of its other files is deleted)")
        return Claim(set(), True)
    mine = {str(f) for f in old["files"]} & remote
    theirs = {k: old.get(k) for k in ("recipe", "base_model")}
    if theirs != ours:
        if not overwrite:
            raise refused(f"{repo_id} holds another model (recipe {theirs['recipe']!r}, base "
                          f"{theirs['base_model']!r}; this run: recipe {ours['recipe']!r}, "
                          f"base {ours['base_model']!r})",
                          "publish under another --name, or pass --overwrite to replace it")
        return Claim(mine, True)
    return Claim(mine, False)
