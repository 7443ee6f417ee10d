"""Security rules that need no model: user-only folders for credentials-derived data, no
empty run folder left by a refused run, and trust_remote_code stated on the model card."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from fixtures.hub.runs import dry, make_run, relist

from quantize.model.source import DEFAULT_MODEL, ModelRef
from quantize.pipeline import from_hub
from quantize.run.lock import run_lock
from tests.fixtures.manifests import read_manifest, write_manifest


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_private_run_folder_is_user_only(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "hub-model-run"
    with run_lock(run, private=True):
        assert mode(run) == 0o700
        (run / "manifest.json").write_text("{}")
    assert mode(run) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    with run_lock(shared, private=True):  # an existing folder is tightened too
        (shared / "f").write_text("x")
    assert mode(shared) == 0o700


def test_a_run_that_wrote_nothing_leaves_no_folder(tmp_path: Path) -> None:
    run = tmp_path / "new-run"
    with pytest.raises(RuntimeError), run_lock(run):
        raise RuntimeError("refused before any stage")
    assert not run.exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    with run_lock(existing):
        pass
    assert existing.is_dir()  # never removes a folder it did not create


def test_only_hub_models_make_private_run_folders(tmp_path: Path) -> None:
    assert from_hub(ModelRef("meta-llama/Llama-3.1-8B", tmp_path, "Llama-3.1-8B"))
    assert not from_hub(ModelRef(DEFAULT_MODEL, tmp_path, "SmolLM2-135M-Instruct"))
    assert not from_hub(ModelRef(str(tmp_path), tmp_path, tmp_path.name))


def _trust_remote_code(run: Path) -> None:
    """Rewrite the synthetic run's recipe with trust_remote_code: true, re-hashed."""
    export = run / "export"
    recipe = export / "recipe.yaml"
    recipe.write_text(recipe.read_text() + "trust_remote_code: true\n")
    relist(run)
    m = read_manifest(run)
    m["recipe"]["trust_remote_code"] = True
    write_manifest(run, m)


@pytest.mark.parametrize("trusted", [False, True])
def test_card_states_trust_remote_code(tmp_path: Path, trusted: bool) -> None:
    run = make_run(tmp_path)
    if trusted:
        _trust_remote_code(run)
    res = dry(run)
    card = (res.folder / "README.md").read_text()
    # (the vLLM snippets, with their --trust-remote-code, appear only once verify ran vLLM)
    marks = ("| trust_remote_code | **true**",
             "AutoTokenizer.from_pretrained(repo, trust_remote_code=True)",
             "from_pretrained(repo, trust_remote_code=True, device_map=")
    for mark in marks:
        assert (mark in card) == trusted, mark
    assert mode(run / "publish") == 0o700  # the staged repo contents are user-only
