"""publish against a local fake Hub: the real `huggingface_hub` client, pointed at an HTTP
server on 127.0.0.1 (tests/fixtures/hub/) through HF_ENDPOINT. Nothing here reaches the
internet.

The fake Hub implements the endpoints create_repo, create_commit (preupload, the LFS batch
API with basic and multipart uploads, LFS verify, the ndjson commit), model_info/repo_info,
list_repo_tree and hf_hub_download/snapshot_download use: POST /api/repos/create,
POST /api/validate-yaml, GET /api/models/{repo}[/revision/{rev}],
GET /api/models/{repo}/tree/{rev}, POST /api/models/{repo}/preupload/{rev},
POST /{repo}.git/info/lfs/objects/batch, PUT/POST /_lfs/..., POST /api/models/{repo}/commit/{rev},
HEAD/GET /{repo}/resolve/{rev}/{path}, GET /api/whoami-v2. It does NOT implement Xet storage
(the client runs with HF_HUB_DISABLE_XET=1, so uploads take the LFS path), datasets/spaces,
branches/tags/PRs, repo settings or deletion, gated repos or pagination; see its docstring.

The run is a real pipeline export (rtn-int4) of conftest's tiny random Llama (the default
model's tokenizer); its eval/gate results are stand-ins in the run-folder contract's shape.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from fixtures.hub import Blob, FakeHub, write_eval_gate

from quantize.cli import main
from quantize.errors import PublishError
from quantize.run.files import hash_tree
from quantize.stages.publish import PublishOptions, publish

TOKEN = "hf_PublishTestToken7Qx9ZkLm3Np5Rs"  # recognisable: must never show up anywhere
ORG = "test-org"
BASE = "test-org/Tiny-Llama"  # the tiny model is a local folder: name its "Hub id"
REPO = f"{ORG}/Tiny-Llama-rtn-int4"  # the default name: <base>-<recipe>


@pytest.fixture(scope="module")
def tiny_export(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished rtn-int4 export of conftest's tiny random Llama (about 15 s)."""
    from quantize.pipeline import RunOptions, run

    out = tmp_path_factory.mktemp("publish") / "run"
    run(RunOptions(recipe="rtn-int4", model=str(tiny_model), out=out, until="export",
                   device="cpu"))
    return out


def opts(run_dir: Path, **kw: Any) -> PublishOptions:
    return PublishOptions(run=run_dir, org=kw.pop("org", ORG), base_model=BASE, **kw)


@pytest.fixture
def run_dir(tiny_export: Path, tmp_path: Path) -> Path:
    """A private copy of the export run, with a passing gate."""
    dst = tmp_path / "run"
    shutil.copytree(tiny_export, dst)
    write_eval_gate(dst)
    return dst


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    """A fake Hub, and the in-process client pointed at it (as `HF_ENDPOINT=... quantize
    publish` would be: huggingface_hub reads these variables at import, publish reads
    HF_ENDPOINT again when it runs)."""
    from huggingface_hub import constants

    with FakeHub(token=TOKEN, orgs=(ORG,), multipart_threshold=2 << 20,
                 multipart_chunk=1 << 20) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # conftest sets it
        # anything the client sends to its import-time endpoint lands here too (it fetches
        # a user-agent registry from ENDPOINT), and its cache file stays in tmp_path
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(tmp_path / "harnesses"),
                            raising=False)
        yield server


def _env(hub: FakeHub, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE",
                       "TRANSFORMERS_CACHE")}
    env |= {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HOME": str(tmp_path / "hf-home"),
            "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    return env


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from quantize.cli import main; main()", *args],
                          env=env, capture_output=True, text=True, timeout=300)


def _tree(folder: Path) -> dict[str, str]:
    return {rel: sha for rel, sha in hash_tree(folder).items() if not rel.startswith(".")}


LOADER = """
import hashlib, json, sys
from pathlib import Path
import torch
from huggingface_hub import ModelCard, snapshot_download
from transformers import AutoModelForCausalLM, AutoTokenizer
repo, local = sys.argv[1], sys.argv[2]
snap = Path(snapshot_download(repo))
files = {p.relative_to(snap).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
         for p in snap.rglob("*") if p.is_file()}
card = ModelCard.load(repo)
tok = AutoTokenizer.from_pretrained(repo)
hub_model = AutoModelForCausalLM.from_pretrained(repo, dtype=torch.float32)
ref = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32)
ids = tok("The capital of France is", return_tensors="pt")
with torch.no_grad():
    a, b = hub_model(**ids).logits, ref(**ids).logits
print(json.dumps({"files": files, "meta": card.data.to_dict(), "text": card.text,
                  "same_logits": bool(torch.equal(a, b)),
                  "quant_method": hub_model.config.quantization_config.quant_method
                  if hasattr(hub_model.config.quantization_config, "quant_method")
                  else hub_model.config.quantization_config["quant_method"]}))
"""


def test_publish_redownload_and_load(run_dir: Path, hub: FakeHub, tmp_path: Path) -> None:
    """The whole user path in subprocesses: `quantize publish` with HF_ENDPOINT/HF_TOKEN,
    then snapshot_download + ModelCard.load + transformers from the Hub id."""
    env = _env(hub, tmp_path)
    dry_out = tmp_path / "dry"
    base = ["--base-model", BASE]
    dry = _cli(["publish", str(run_dir), "--org", ORG, *base, "--dry-run", "--out",
                str(dry_out)], env)
    assert dry.returncode == 0, dry.stderr
    assert hub.requests == []  # the dry run touched no network

    res = _cli(["publish", str(run_dir), "--org", ORG, *base], env)
    assert res.returncode == 0, res.stderr
    assert f"published {REPO} (private): commit " in res.stdout
    staged = run_dir / "publish" / ORG / REPO.split("/")[1]
    # what the server holds is exactly the staged folder, in one commit after the initial one
    commits = hub.commits(REPO)
    assert len(commits) == 2 and commits[-1].title.startswith("quantize ")
    held = {p: b.sha256 for p, b in hub.files(REPO).items() if p != ".gitattributes"}
    assert held == _tree(staged)
    assert hub.files(REPO)["model.safetensors"].lfs
    assert len(hub.calls("PUT", r"/_lfs/.*/part/")) > 1  # the multipart LFS path
    assert hub.repos[REPO].private
    # the dry run wrote the same repo contents, card included
    assert _tree(dry_out) == _tree(staged)
    assert (dry_out / "README.md").read_bytes() == hub.files(REPO)["README.md"].data

    # the token was used, and never repeated
    assert {r["auth"] for r in hub.calls("POST", "/commit/")} == {TOKEN}
    assert TOKEN not in res.stdout + res.stderr + dry.stdout + dry.stderr
    for f in tmp_path.rglob("*"):  # the run folder, the dry run's folder and HF_HOME
        if f.is_file():
            assert TOKEN.encode() not in f.read_bytes(), f
    assert not [p for p, b in hub.files(REPO).items() if TOKEN.encode() in b.data]

    loaded = subprocess.run([sys.executable, "-c", LOADER, REPO, str(run_dir / "export")],
                            env=env, capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    out = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert {k: v for k, v in out["files"].items() if k != ".gitattributes"} == _tree(staged)
    assert out["same_logits"] and out["quant_method"] == "compressed-tensors"
    meta = out["meta"]
    assert meta["base_model"] == BASE
    assert meta["base_model_relation"] == "quantized" and "vllm" in meta["tags"]
    gate = json.loads((run_dir / "gate" / "gate.json").read_text())
    results = meta["model-index"][0]["results"]
    scores = [r for r in gate["rows"] if r.get("kind") != "consumer_agreement"]
    assert len(results) == len(scores)  # consumer rows: the "Where it loads" table
    for row in scores:
        assert f"{row['recovery']:.1%}" in out["text"]
    assert "**Release gate: PASS**" in out["text"]


def test_republishing_the_same_run_makes_no_commit(run_dir: Path, hub: FakeHub) -> None:
    first = publish(opts(run_dir))
    assert first.changed and first.commit == hub.repos[REPO].head.oid
    n_requests = len(hub.requests)
    again = publish(opts(run_dir))
    assert not again.changed and again.commit == first.commit
    assert len(hub.commits(REPO)) == 2
    later = hub.requests[n_requests:]
    assert not [r for r in later if r["method"] == "PUT" or "/commit/" in r["path"]]
    history = json.loads((run_dir / "publish" / "publish.json").read_text())
    assert [h["changed"] for h in history] == [True, False]


def test_transient_errors_are_retried_without_resending_or_double_commits(
        run_dir: Path, hub: FakeHub) -> None:
    hub.fail("POST", r"^/api/repos/create$", status=502)
    # the first commit is carried out but its response is lost: the retry must notice
    hub.fail("POST", r"/commit/main$", status=503, after=True)
    res = publish(opts(run_dir, backoff_s=0.01))
    assert res.changed
    assert len(hub.commits(REPO)) == 2  # initial + ours, no duplicate
    # every LFS part went up once: the retry found the object on the Hub (resumed)
    parts = [r["path"] for r in hub.calls("PUT", r"/_lfs/")]
    assert parts and len(parts) == len(set(parts))
    assert len(hub.calls("POST", r"/commit/main$")) == 1


def test_interrupted_upload_resumes_without_resending_finished_objects(
        run_dir: Path, hub: FakeHub) -> None:
    hub.fail("POST", r"/commit/main$", status=500)  # after every LFS object reached the Hub
    res = publish(opts(run_dir, backoff_s=0.01))
    assert res.changed
    batches = hub.calls("POST", r"\.git/info/lfs/objects/batch$")
    assert len(batches) == 2
    parts = [r["path"] for r in hub.calls("PUT", r"/_lfs/")]
    assert len(parts) == len(set(parts))  # the second attempt sent no LFS bytes again


def test_files_this_tool_did_not_upload_are_never_deleted(run_dir: Path,
                                                           hub: FakeHub) -> None:
    publish(opts(run_dir))
    repo = hub.repos[REPO]
    old = dict(repo.head.files)
    old["model-00001-of-00002.safetensors"] = Blob(b"\0someone else's", True)
    hub._commit(repo, "someone else's shard", "", old)
    res = publish(opts(run_dir))
    assert not res.changed and res.deleted == []  # not in our marker: not ours to delete
    assert "model-00001-of-00002.safetensors" in hub.files(REPO)
    assert ".gitattributes" in hub.files(REPO)
    # the marker lists what this tool uploaded: only those files may ever be deleted
    marker = json.loads(hub.files(REPO)["quantize/repo.json"].data)
    assert "quantize/gate.json" in marker["files"]


def test_errors_never_carry_the_token(run_dir: Path, hub: FakeHub) -> None:
    hub.echo_auth_in_errors = True  # a server that quotes the Authorization header back
    hub.fail("POST", r"/commit/main$", status=403)
    with pytest.raises(PublishError) as err:
        publish(opts(run_dir))
    assert TOKEN not in str(err.value) and "may not write" in str(err.value)
    assert "***" in str(err.value)  # the server did echo it; we redacted it
    hub.fail("POST", r"/commit/main$", status=403)
    res = CliRunner().invoke(main, ["publish", str(run_dir), "--org", ORG, "--base-model", BASE])
    assert res.exit_code == 2 and TOKEN not in res.output
    assert "error: publishing" in res.output


def test_a_wrong_token_or_namespace_is_explained(run_dir: Path, hub: FakeHub,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(PublishError) as err:
        publish(opts(run_dir, org="other-org"))
    assert err.value.problem is not None and err.value.problem.startswith(
        "publishing other-org/")
    assert err.value.hint is not None and err.value.hint.startswith(
        "the token may not write to 'other-org'")
    monkeypatch.setenv("HF_TOKEN", "hf_WrongTokenWrongToken123")
    with pytest.raises(PublishError) as err:
        publish(opts(run_dir))
    assert err.value.hint is not None and err.value.hint.startswith("the Hub refused the token")
    assert "WrongToken" not in str(err.value)


def test_failed_gate_is_refused_before_any_request(run_dir: Path, hub: FakeHub) -> None:
    write_eval_gate(run_dir, fail=True)
    with pytest.raises(PublishError) as err:
        publish(opts(run_dir))
    assert err.value.problem == "the release gate failed on wiki_ppl"
    assert err.value.hint is not None and "--force" in err.value.hint
    assert hub.requests == []
    res = publish(opts(run_dir, force=True, private=False))
    card = hub.files(REPO)["README.md"].data.decode()
    assert res.changed and "Published with `--force`" in card
    assert not hub.repos[REPO].private


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_the_hub_holds_the_bytes_of_the_export(run_dir: Path, hub: FakeHub) -> None:
    hub.multipart_threshold = 1 << 30  # this time the basic (single PUT) LFS transfer
    publish(opts(run_dir))
    assert len(hub.calls("PUT", r"^/_lfs/[0-9a-f]{64}$")) == 1
    files = hub.files(REPO)
    for rel, sha in hash_tree(run_dir / "export").items():
        if rel != "manifest.json":
            assert _sha(files[rel].data) == sha, rel
