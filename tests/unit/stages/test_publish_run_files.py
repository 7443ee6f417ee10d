"""What publish may read from a run folder (issue #47): exactly the files the manifest lists
and hashes, regular files only, never through a link, never a file the run did not write;
a dry run's --out never inside the run. Every refusal is one PublishError (exit 2 from the
CLI), and nothing is staged or uploaded. Synthetic run folders, no network: seconds."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from fixtures.hub.runs import dry, make_run, relist

from quantize.cli import main
from quantize.errors import PublishError
from quantize.recipe.recipe import load_recipe
from quantize.report.card import default_repo_name
from quantize.stages.publish import PublishOptions, publish
from tests.fixtures.manifests import read_manifest, write_manifest

SECRET = b"root:$6$very-secret-hash:19000:0:99999:7:::\n"


@pytest.fixture
def run(tmp_path: Path) -> Path:
    return make_run(tmp_path)


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A file outside the run that must never be read into a repo (a stand-in for
    /etc/shadow, which tests cannot read)."""
    path = tmp_path / "outside" / "shadow"
    path.parent.mkdir()
    path.write_bytes(SECRET)
    return path


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_a: Any, **_k: Any) -> None:
        raise AssertionError("the test tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.fixture(autouse=True)
def no_hang() -> Iterator[None]:
    """A FIFO opened for reading blocks until a writer comes: fail instead of hanging."""
    def boom(*_a: Any) -> None:
        raise AssertionError("publish blocked (opened a FIFO?)")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def nothing_staged(run: Path) -> None:
    staged = [p for p in (run / "publish").rglob("*") if p.is_file()] \
        if (run / "publish").exists() else []
    assert staged == [], staged


def refusal(run: Path, **kw: Any) -> PublishError:
    with pytest.raises(PublishError) as err:
        dry(run, force=True, **kw)  # --force overrides the gate only, never these
    assert "\n" not in str(err.value)
    nothing_staged(run)
    return err.value


# --- links, FIFOs, files the run did not write --------------------------------------------
def test_symlink_to_a_secret_in_export_is_refused(run: Path, secret: Path) -> None:
    (run / "export" / "shadow.txt").symlink_to(secret)
    err = refusal(run)
    assert err.path == str(run / "export" / "shadow.txt")
    assert err.problem == f"{run / 'export' / 'shadow.txt'} is a symbolic link"


def test_listed_file_replaced_by_a_symlink_is_refused_even_with_the_same_bytes(
        run: Path, tmp_path: Path) -> None:
    tok = run / "export" / "tokenizer.json"
    copy = tmp_path / "same-bytes.json"
    shutil.copy(tok, copy)
    tok.unlink()
    tok.symlink_to(copy)  # hashes to the manifest's digest: still never followed
    err = refusal(run)
    assert err.problem == f"{tok} is a symbolic link"


def test_export_folder_that_is_a_symlink_is_refused(run: Path, tmp_path: Path) -> None:
    real = tmp_path / "elsewhere"
    (run / "export").rename(real)
    (run / "export").symlink_to(real)
    err = refusal(run)
    assert err.problem == f"{run / 'export'} is a symbolic link"


def test_symlinked_folder_inside_export_is_refused(run: Path, secret: Path) -> None:
    (run / "export" / "extra").symlink_to(secret.parent, target_is_directory=True)
    err = refusal(run)
    assert err.problem == f"{run / 'export' / 'extra'} is a symbolic link"


def test_symlinked_eval_result_is_refused(run: Path, tmp_path: Path) -> None:
    ev = run / "eval" / "eval.json"
    copy = tmp_path / "eval-copy.json"
    shutil.copy(ev, copy)
    ev.unlink()
    ev.symlink_to(copy)
    assert refusal(run).problem == f"{ev} is a symbolic link"


def test_symlinked_run_manifest_is_refused(run: Path, tmp_path: Path) -> None:
    m = run / "manifest.json"
    copy = tmp_path / "manifest-copy.json"
    shutil.copy(m, copy)
    m.unlink()
    m.symlink_to(copy)
    assert refusal(run).problem == f"{m} is a symbolic link"


@pytest.mark.parametrize("name", [".env", "notes.txt", "sub/.hidden"])
def test_file_the_manifest_does_not_list_is_refused(run: Path, name: str) -> None:
    path = run / "export" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text("HF_TOKEN=hf_notForTheHub0123456789\n")
    err = refusal(run)
    assert err.path == str(path)
    assert err.problem == f"{path} is not a file the run wrote (the run manifest does not list it)"
    assert err.hint is not None and "only the files the manifest lists" in err.hint


def test_dotfile_the_run_wrote_is_shipped(run: Path) -> None:
    (run / "export" / ".keep").write_text("listed\n")
    relist(run)
    assert ".keep" in dry(run).files


def test_fifo_in_export_is_refused_without_blocking(run: Path) -> None:
    os.mkfifo(run / "export" / "pipe")
    assert refusal(run).problem == f"{run / 'export' / 'pipe'} is a FIFO"


def test_listed_file_replaced_by_a_fifo_is_refused_without_blocking(run: Path) -> None:
    tok = run / "export" / "tokenizer.json"
    tok.unlink()
    os.mkfifo(tok)
    assert refusal(run).problem == f"{tok} is a FIFO"


def test_socket_in_export_is_refused(tmp_path: Path) -> None:
    run = make_run(tmp_path / "r")  # a short path: AF_UNIX names are at most 107 bytes
    cwd = Path.cwd()
    os.chdir(run / "export")
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind("sock")
            assert refusal(run).problem == f"{run / 'export' / 'sock'} is a socket"
    finally:
        os.chdir(cwd)


def test_hardlink_replacing_a_listed_file_is_refused(run: Path, secret: Path) -> None:
    tok = run / "export" / "tokenizer.json"
    tok.unlink()
    os.link(secret, tok)  # a regular file, but not the bytes the run wrote
    err = refusal(run)
    assert (err.path, err.problem) == (
        str(tok), "does not match its recorded sha256 (changed or truncated)")


def test_unlisted_hardlink_is_refused(run: Path, secret: Path) -> None:
    os.link(secret, run / "export" / "shadow")
    assert refusal(run).problem.endswith("is not a file the run wrote (the run manifest does "
                                         "not list it)")


def test_hardlinked_export_files_that_match_are_shipped(run: Path, tmp_path: Path) -> None:
    tok = run / "export" / "tokenizer.json"
    os.link(tok, tmp_path / "another-name")  # nlink 2: the same bytes, still the run's file
    res = dry(run)
    assert (res.folder / "tokenizer.json").read_bytes() == tok.read_bytes()


# --- what the manifest lists ---------------------------------------------------------------
@pytest.mark.parametrize("rel", ["../manifest.json", "/etc/passwd", "a/../../x", "./config.json",
                                 "a//b", "sub\\..\\x"])
def test_manifest_path_that_is_not_plain_is_refused(run: Path, rel: str) -> None:
    m = read_manifest(run)
    m["stages"]["export"]["outputs"][rel] = "0" * 64
    write_manifest(run, m)
    err = refusal(run)
    assert err.problem == (f"{run / 'manifest.json'} lists {rel!r}, which is not a plain path "
                           "inside its folder")


def test_only_listed_files_are_staged(run: Path, tmp_path: Path) -> None:
    res = dry(run, out=tmp_path / "dry")
    m = read_manifest(run)
    listed = set(m["stages"]["export"]["outputs"]) - {"manifest.json"}
    own = {"README.md", "quantize/export-manifest.json", "quantize/eval.json",
           "quantize/gate.json", "quantize/repo.json"}
    assert set(res.files) == listed | own
    on_disk = {p.relative_to(res.folder).as_posix() for p in res.folder.rglob("*")
               if p.is_file()}
    assert on_disk == set(res.files)
    for rel in listed:
        assert res.files[rel][1] == m["stages"]["export"]["outputs"][rel]
        assert not (res.folder / rel).is_symlink()


# --- the dry run's --out ---------------------------------------------------------------------
@pytest.mark.parametrize("where", [
    lambda r: r / "export" / "dry", lambda r: r / "export", lambda r: r / "eval" / "x",
    lambda r: r, lambda r: r / "publish" / "x", lambda r: r.parent])
def test_out_inside_the_run_is_refused(run: Path, where: Callable[[Path], Path]) -> None:
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    out = where(run)
    with pytest.raises(PublishError) as err:
        dry(run, out=out)
    assert err.value.path == str(out)
    assert err.value.problem is not None
    assert err.value.problem.startswith(f"--out {out} is inside the run folder")
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # nothing written


def test_out_through_a_symlink_into_export_is_refused(run: Path, tmp_path: Path) -> None:
    link = tmp_path / "innocent"
    link.symlink_to(run / "export", target_is_directory=True)
    with pytest.raises(PublishError) as err:
        dry(run, out=link / "dry")
    assert err.value.problem is not None and "is inside the run folder" in err.value.problem


def test_out_inside_export_is_refused_by_the_cli(run: Path) -> None:
    res = CliRunner().invoke(main, ["publish", str(run), "--org", "acme", "--dry-run", "--out",
                                    str(run / "export" / "dry")])
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --out ")
    assert "Traceback" not in res.output and not (run / "export" / "dry").exists()


def test_cli_refuses_a_symlink_with_one_line(run: Path, secret: Path) -> None:
    (run / "export" / "shadow.txt").symlink_to(secret)
    res = CliRunner().invoke(main, ["publish", str(run), "--org", "acme", "--dry-run"])
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and "shadow.txt is a symbolic link" in lines[0]
    assert SECRET.decode() not in res.output


def test_staging_folder_reached_through_a_link_is_refused(
        run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_QuantizeFakeToken0123456789XYZ")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "publish").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(PublishError) as err:
        publish(PublishOptions(run=run, org="acme"))  # refused before any request
    assert err.value.problem == f"{run / 'publish'} is a symbolic link"
    assert list(elsewhere.iterdir()) == []


# --- default repo names --------------------------------------------------------------------
_HUB = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$")


def test_default_names_of_two_recipes_of_one_scheme_differ() -> None:
    gptq, rtn = load_recipe("gptq-int4"), load_recipe("rtn-int4")
    assert gptq.scheme == rtn.scheme
    assert default_repo_name("Llama-3.1-8B", gptq) != default_repo_name("Llama-3.1-8B", rtn)


@pytest.mark.parametrize("base", ["x" * 200, "a b/c..d--e", "--", "Qwen2.5-0.5B" * 9,
                                  "名前-model", ".hidden"])
def test_default_names_are_valid_hub_names(base: str) -> None:
    for recipe in ("gptq-int4", "rtn-int4", "fp8-dynamic"):
        name = default_repo_name(base, load_recipe(recipe))
        assert len(name) <= 96 and _HUB.match(name), name
        assert "--" not in name and ".." not in name and name.endswith(recipe)


def test_long_base_names_stay_apart() -> None:
    r = load_recipe("gptq-int4")
    a, b = default_repo_name("m" * 120 + "-A", r), default_repo_name("m" * 120 + "-B", r)
    assert a != b and len(a) == len(b) == 96


def test_two_recipes_in_one_folder_get_two_repos(tmp_path: Path) -> None:
    first = dry(make_run(tmp_path / "a", recipe="gptq-int4"), out=tmp_path / "o1")
    second = dry(make_run(tmp_path / "b", recipe="rtn-int4"), out=tmp_path / "o2")
    assert first.repo_id == "acme/Tiny-Base-gptq-int4"
    assert second.repo_id == "acme/Tiny-Base-rtn-int4"
    marker = json.loads((second.folder / "quantize" / "repo.json").read_text())
    assert marker["recipe"] == "rtn-int4"
