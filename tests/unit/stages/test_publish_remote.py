"""What publish may do to a Hub repo (issue #47): create it or write only to a repo this tool
made for the same model (its marker, quantize/repo.json), never delete a file it did not
upload, and upload exactly the bytes the run recorded, re-hashed just before the first request.
Synthetic run folders and the real huggingface_hub client against the fake Hub on 127.0.0.1
(tests/fixtures/hub): seconds."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from fixtures.hub import FakeHub
from fixtures.hub.runs import make_run, relist

from quantize.cli import main
from quantize.errors import PublishError
from quantize.stages.publish import MARKER, PublishOptions, publish
from tests.fixtures.manifests import read_manifest

TOKEN = "hf_RemoteSafetyToken4Kq8Zp2Lm7Nx"
ORG = "test-org"
REPO = f"{ORG}/Tiny-Base-tiny-gptq"
THEIRS = {"README.md": b"# Our own model\n", "model.safetensors": b"\0their weights",
          "notes.md": b"do not delete\n"}


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    with FakeHub(token=TOKEN, orgs=(ORG,)) as server:
        server.point_client(monkeypatch, tmp_path)
        yield server


@pytest.fixture
def run(tmp_path: Path) -> Path:
    return make_run(tmp_path / "a")


def go(run: Path, **kw: Any) -> Any:
    return publish(PublishOptions(run=run, org=ORG, base_model="acme-base/Tiny-Base",
                                  backoff_s=0.01, **kw))


def writes(hub: FakeHub) -> list[dict[str, Any]]:
    """Every request that could change the Hub (anything but a read)."""
    return [r for r in hub.requests if r["method"] in ("POST", "PUT", "DELETE")
            and r["path"] != "/api/validate-yaml"]


def sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


# --- the marker ------------------------------------------------------------------------------
def test_a_new_repo_gets_the_marker_listing_what_was_uploaded(run: Path, hub: FakeHub) -> None:
    res = go(run)
    assert res.changed and res.repo_id == REPO
    files = hub.files(REPO)
    marker = json.loads(files[MARKER].data)
    assert marker["tool"] == "quantize" and marker["recipe"] == "tiny-gptq"
    assert set(marker["files"]) == set(files) - {MARKER, ".gitattributes"}
    outputs = read_manifest(run)["stages"]["export"]["outputs"]
    for rel, digest in outputs.items():
        if rel != "manifest.json":
            assert files[rel].sha256 == digest, rel


def test_existing_repo_not_made_by_quantize_is_refused(run: Path, hub: FakeHub) -> None:
    hub.seed(REPO, THEIRS)
    before = hub.commits(REPO)
    with pytest.raises(PublishError) as err:
        go(run)
    assert err.value.problem is not None and err.value.problem.startswith(
        f"{REPO} already exists and was not made by quantize (it has no {MARKER})")
    assert err.value.hint is not None and "--overwrite" in err.value.hint
    assert "\n" not in str(err.value)
    assert hub.commits(REPO) == before and writes(hub) == []  # nothing uploaded


def test_overwrite_adds_the_run_and_deletes_none_of_their_files(run: Path, hub: FakeHub) -> None:
    hub.seed(REPO, THEIRS)
    res = go(run, overwrite=True)
    assert res.changed and res.overwritten and res.deleted == []
    files = hub.files(REPO)
    assert files["notes.md"].data == THEIRS["notes.md"]  # theirs, kept
    assert files["model.safetensors"].data != THEIRS["model.safetensors"]  # ours now
    # the marker lists only our files: a later publish may delete those, never notes.md
    assert "notes.md" not in json.loads(files[MARKER].data)["files"]
    again = go(run)  # now the repo is ours: no --overwrite needed
    assert not again.changed and "notes.md" in hub.files(REPO)


def test_cli_refuses_an_existing_repo_with_one_line_and_exit_2(run: Path, hub: FakeHub) -> None:
    hub.seed(REPO, THEIRS)
    res = CliRunner().invoke(main, ["publish", str(run), "--org", ORG, "--base-model",
                                    "acme-base/Tiny-Base"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and "was not made by quantize" in lines[0]
    assert TOKEN not in res.output and writes(hub) == []


def test_a_marker_of_another_tool_does_not_count(run: Path, hub: FakeHub) -> None:
    hub.seed(REPO, {**THEIRS, MARKER: b'{"tool": "other", "files": ["notes.md"]}'})
    with pytest.raises(PublishError) as err:
        go(run)
    assert err.value.problem is not None and "was not made by quantize" in err.value.problem
    assert writes(hub) == []


def test_a_repo_of_another_recipe_is_refused(tmp_path: Path, run: Path, hub: FakeHub) -> None:
    go(run)
    other = make_run(tmp_path / "b", recipe="rtn-tiny")
    before = hub.commits(REPO)
    with pytest.raises(PublishError) as err:
        go(other, name=REPO.split("/")[1])  # --name of the first run's repo
    assert err.value.problem is not None and "holds another model (recipe 'tiny-gptq'" in \
        err.value.problem
    assert hub.commits(REPO) == before
    # by default the second recipe gets its own repo: nothing is replaced
    res = go(other)
    assert res.repo_id == f"{ORG}/Tiny-Base-rtn-tiny" and len(hub.commits(REPO)) == 2


# --- deletions ---------------------------------------------------------------------------
def test_only_files_this_tool_uploaded_are_deleted(run: Path, hub: FakeHub) -> None:
    (run / "export" / "extra_shard.json").write_text("{}")
    relist(run)
    go(run)
    repo = hub.repos[REPO]
    hub._commit(repo, "someone else's file", "", {**repo.head.files,
                                                  **hub.seed("x/y", THEIRS).head.files})
    (run / "export" / "extra_shard.json").unlink()
    relist(run)
    res = go(run)
    assert res.changed and res.deleted == ["extra_shard.json"]  # ours, listed in the marker
    files = hub.files(REPO)
    assert "extra_shard.json" not in files
    for rel in ("notes.md", ".gitattributes"):  # never uploaded by us: kept
        assert rel in files


def test_a_forged_marker_cannot_delete_what_is_not_there(run: Path, hub: FakeHub) -> None:
    go(run)
    repo = hub.repos[REPO]
    forged = json.loads(repo.head.files[MARKER].data)
    forged["files"] += ["../../etc/passwd", ".gitattributes", "missing.bin"]
    from fixtures.hub import Blob

    hub._commit(repo, "forged", "", {**repo.head.files,
                                     MARKER: Blob(json.dumps(forged).encode(), False)})
    res = go(run)
    assert res.deleted == [] and ".gitattributes" in hub.files(REPO)


# --- bytes checked at upload time ------------------------------------------------------------
def test_file_changed_between_hash_and_upload_is_refused(run: Path, hub: FakeHub,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import quantize.stages.publish.flow as flow

    def tamper(point: str) -> None:  # after staging, before the upload: rewrite in place
        with open(run / "export" / "tokenizer.json", "r+b") as f:
            f.write(b"[]")

    monkeypatch.setattr(flow, "pause_point", tamper)
    with pytest.raises(PublishError) as err:
        go(run)
    assert err.value.problem is not None and err.value.problem.endswith(
        "tokenizer.json changed after publish checked it (its sha256 is not the one the run "
        "recorded)")
    assert hub.requests == []  # refused before the first request


def test_staged_file_swapped_for_a_symlink_is_refused(run: Path, hub: FakeHub, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import quantize.stages.publish.flow as flow

    secret = tmp_path / "secret"
    secret.write_text("{}")  # even the same bytes: never through a link

    def swap(point: str) -> None:
        staged = run / "publish" / ORG / REPO.split("/")[1] / "tokenizer.json"
        staged.unlink()
        staged.symlink_to(secret)

    monkeypatch.setattr(flow, "pause_point", swap)
    with pytest.raises(PublishError) as err:
        go(run)
    assert err.value.problem is not None and err.value.problem.endswith(
        "tokenizer.json is a symbolic link")
    assert hub.requests == []


def test_file_renamed_over_after_the_check_is_not_what_goes_up(
        run: Path, hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client reads the descriptor that was checked, not the path again."""
    from quantize.stages.publish import pinned

    evil = tmp_path / "evil"
    evil.write_bytes(b'{"evil": true}')
    staged = run / "publish" / ORG / REPO.split("/")[1] / "tokenizer.json"
    real_ops = pinned.Pinned.ops

    def ops_then_swap(self: pinned.Pinned) -> Any:
        os.replace(evil, staged)
        return real_ops(self)

    monkeypatch.setattr(pinned.Pinned, "ops", ops_then_swap)
    go(run)
    got = hub.files(REPO)["tokenizer.json"].data
    assert sha(got) == read_manifest(run)["stages"]["export"]["outputs"]["tokenizer.json"]


# --- retries ---------------------------------------------------------------------------------
def test_a_lost_create_answer_is_not_mistaken_for_a_foreign_repo(run: Path,
                                                                hub: FakeHub) -> None:
    hub.fail("POST", r"^/api/repos/create$", status=503, after=True)  # created, answer lost
    res = go(run)
    assert res.changed and len(hub.commits(REPO)) == 2


def test_an_empty_repo_left_by_a_failed_first_publish_is_taken(run: Path, hub: FakeHub) -> None:
    hub.fail("POST", r"/commit/main$", status=403)  # created the repo, then failed
    with pytest.raises(PublishError):
        go(run)
    assert set(hub.files(REPO)) == {".gitattributes"}
    res = go(run)  # nothing in it to replace: no --overwrite needed
    assert res.changed and not res.overwritten and MARKER in hub.files(REPO)
