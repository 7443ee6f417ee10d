"""publish without a Hub: naming, the model card, refusals, the dry run, credentials.

The run folders here are synthetic (tiny files in the run-folder contract's shape, hashed
into a manifest exactly as the pipeline does), so these tests take a few seconds; the
integration tests publish a real pipeline export to a local fake Hub.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from fixtures.hub.runs import CALIBRATION, RECIPE, dry, make_run
from huggingface_hub import ModelCard

from quantize.cli import main
from quantize.errors import PublishError
from quantize.model.config import ModelConfig
from quantize.recipe.recipe import load_recipe
from quantize.report.card import default_repo_name, kv_bytes_per_token, scheme_tag
from quantize.run.files import hash_tree
from quantize.stages.publish import PublishOptions, publish, redact
from tests.fixtures.manifests import read_manifest, write_manifest

FAKE_TOKEN = "hf_QuantizeFakeToken0123456789XYZ"
REPO_NAME = "Tiny-Base-tiny-gptq"  # the default: <base>-<recipe>


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_a: Any, **_k: Any) -> None:
        raise AssertionError("the test tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


# --- naming -------------------------------------------------------------------------------
@pytest.mark.parametrize(("recipe", "tag"), [
    ("gptq-int4", "W4A16"), ("rtn-int4", "W4A16"), ("awq-int4", "W4A16-asym"),
    ("w8a8-int8", "W8A8"), ("fp8-dynamic", "FP8-dynamic"), ("fp8-kv", "FP8-KV"),
    ("rtn-int2", "W2A16")])
def test_scheme_tags_follow_known_conventions(recipe: str, tag: str) -> None:
    r = load_recipe(recipe)
    assert scheme_tag(r.scheme, r.kv_cache) == tag
    assert default_repo_name("SmolLM2-135M-Instruct", r) == f"SmolLM2-135M-Instruct-{recipe}"


@pytest.mark.parametrize(("org", "name"), [("acme", "bad--name"), ("ac me", None),
                                           ("acme", "-lead"), ("acme", "x" * 97)])
def test_invalid_hub_names_are_refused(tmp_path: Path, org: str, name: str | None) -> None:
    run = make_run(tmp_path)
    with pytest.raises(PublishError) as err:
        publish(PublishOptions(run=run, org=org, name=name, dry_run=True))
    flag, value = ("--org", org) if " " in org else ("--name", name)
    assert err.value.problem == f"{flag} {value!r} is not a valid Hub name"
    assert err.value.hint is not None and "at most 96 characters" in err.value.hint


def test_kv_bytes_per_token_from_config() -> None:
    smol = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
            "hidden_size": 576}
    assert kv_bytes_per_token(ModelConfig.model_validate(smol), 2) == 2 * 30 * 3 * 64 * 2
    assert kv_bytes_per_token(ModelConfig.model_validate({**smol, "head_dim": 32}), 1) == \
        2 * 30 * 3 * 32
    assert kv_bytes_per_token(ModelConfig(hidden_size=8), 2) is None


# --- the card and the dry run ------------------------------------------------------------
def test_dry_run_writes_repo_contents_and_card(tmp_path: Path, no_network: None) -> None:
    run = make_run(tmp_path)
    res = dry(run, base_model="acme-base/Tiny-Base")
    assert res.repo_id == f"acme/{REPO_NAME}" and res.commit is None
    export_files = set(hash_tree(run / "export")) - {"manifest.json"}
    assert set(res.files) == export_files | {"README.md", "quantize/export-manifest.json",
                                             "quantize/eval.json", "quantize/gate.json",
                                             "quantize/repo.json"}
    marker = json.loads((res.folder / "quantize" / "repo.json").read_text())
    assert marker == {"tool": "quantize", "schema": 1, "recipe": "tiny-gptq",
                      "base_model": "acme-base/Tiny-Base",
                      "files": sorted(set(res.files) - {"quantize/repo.json"})}
    for rel in export_files:  # the export's files, unchanged
        assert res.files[rel][1] == hash_tree(run / "export")[rel]
    shipped = (res.folder / "quantize" / "export-manifest.json").read_text()
    assert str(tmp_path) not in shipped  # local paths scrubbed

    card = ModelCard.load(res.folder / "README.md")
    meta = card.data.to_dict()
    assert meta["base_model"] == "acme-base/Tiny-Base"
    assert meta["base_model_relation"] == "quantized"
    assert meta["license"] == "mit"  # inherited from the base model's README
    assert meta["library_name"] == "transformers"
    assert {"quantized", "w4a16", "vllm", "compressed-tensors", "gptq"} <= set(meta["tags"])
    ev = json.loads((run / "eval" / "eval.json").read_text())
    gate = json.loads((run / "gate" / "gate.json").read_text())
    results = {r.dataset_name: r for r in card.data.eval_results}
    scores = [m for m in ev["metrics"] if m["kind"] != "consumer_agreement"]
    assert len(results) == len(scores)  # consumer rows have their own table, not model-index
    for m in scores:
        match = [r for r in results.values() if r.metric_value == round(m["candidate"], 6)]
        assert match, m["name"]
    text = card.text
    for row in gate["rows"]:
        if row["kind"] == "consumer_agreement":
            assert "| agrees | KL 1e-05 nats, top-1 99.9%" in text
            continue
        assert f"{row['recovery']:.1%}" in text and f"{row['threshold']:.1%}" in text
    assert f"**Release gate: {gate['verdict'].upper()}**" in text
    assert "physical_intuition" in text and "warnings: physical_intuition" in text
    assert CALIBRATION["fingerprint"] in text and "4 × 64 tokens" in text
    assert "groups of 64" in text and "`lm_head`" in text
    assert "Not verified" in text
    # vLLM was not checked by this run: no vLLM snippet, and the card says why
    assert f"vllm serve acme/{REPO_NAME}" not in text
    assert "did not load the checkpoint in vLLM" in text
    assert f'repo = "acme/{REPO_NAME}"' in text and "from_pretrained(repo" in text
    assert f"{2 * 2 * 2 * 16 * 2:,} B" in text  # KV bytes/token: 2 × layers × kv × dim × 2
    assert RECIPE.strip() in text
    assert "| quantize | 0.1.0 |" in text


def test_default_model_gets_its_hub_id_licence_and_provenance_note(tmp_path: Path) -> None:
    run = make_run(tmp_path, source="default")
    (tmp_path / "Tiny-Base" / "README.md").unlink()
    res = dry(run)
    assert res.repo_id == "acme/SmolLM2-135M-Instruct-tiny-gptq"
    card = ModelCard.load(res.folder / "README.md")
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert card.data.license == "apache-2.0"
    assert "Q4_1 GGUF" in card.text


def test_unknown_base_model_has_no_base_model_field(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    res = dry(make_run(tmp_path), name="tiny")
    card = ModelCard.load(res.folder / "README.md")
    assert card.data.base_model is None and "base_model_relation" not in card.data.to_dict()
    assert "--base-model" in capsys.readouterr().err


VERIFY = {"checkpoint": "", "format": "W4A16 pack-quantized", "host": "cpu, vLLM 0.32.0",
          "tp": 1, "kv_cache_dtype": "auto", "level": "vllm", "verdict": "pass",
          "metrics": {"agreement": 1.0}, "passed": True, "duration_s": 12.5,
          "result": "vLLM 0.32.0 loaded it; greedy agreement with transformers 100.0%"}


def write_verify(run: Path, *, record: bool = True, **kw: Any) -> None:
    """verify.json as `quantize verify` writes it, recorded in the manifest for the current
    export (`record=False`: a run folder from before verify was a recorded stage)."""
    (run / "verify").mkdir(exist_ok=True)
    data = {**VERIFY, "checkpoint": str(run / "export"), **kw}
    (run / "verify" / "verify.json").write_text(json.dumps(data))
    if record:
        m = read_manifest(run)
        m["stages"]["verify"] = {"key": "v" * 64, "status": "done",
                                 "inputs": {"export": m["stages"]["export"]["key"]},
                                 "outputs": hash_tree(run / "verify"), "summary": data}
        write_manifest(run, m)


def test_verify_result_is_shown(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    write_verify(run)
    res = dry(run)
    text = (res.folder / "README.md").read_text()
    assert "Verification level `vllm`" in text and "**passed**" in text
    assert VERIFY["result"] in text and "| format | W4A16 pack-quantized |" in text
    assert str(tmp_path) not in text  # the checkpoint's local path stays out
    assert "quantize/verify.json" in res.files


def test_verify_older_than_the_export_is_ignored(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    # a verify.json no manifest record ties to the current export (written before verify
    # was a recorded stage): its freshness is unknown, so it does not count
    write_verify(run, record=False)
    res = dry(run)
    assert "Not verified" in (res.folder / "README.md").read_text()
    assert "quantize/verify.json" not in res.files


def test_verify_recorded_for_an_older_export_is_refused(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    write_verify(run)
    m = read_manifest(run)
    m["stages"]["verify"] = {"key": "v" * 64, "status": "done", "inputs": {"export": "0" * 64},
                             "outputs": hash_tree(run / "verify"), "summary": {}}
    write_manifest(run, m)
    with pytest.raises(PublishError) as err:
        dry(run)
    assert err.value.problem == "the verify result belongs to an older export"
    assert err.value.hint == "re-run `quantize verify`"
    assert str(err.value).startswith("refused: ")


# --- refusals ----------------------------------------------------------------------------
def test_a_gate_without_consumer_rows_is_refused(tmp_path: Path) -> None:
    """A gate from before the consumer checks vouches for no consumer the card would name."""
    from fixtures.hub.runs import write_eval_gate

    run = make_run(tmp_path)
    write_eval_gate(run, consumers=False)
    with pytest.raises(PublishError) as err:
        dry(run)
    assert err.value.problem is not None and "\n" not in str(err.value)
    assert err.value.problem.startswith("the gate does not show that transformers, lm-eval-hf "
                                        "load this export right")


def test_failed_gate_is_refused_and_force_says_so_in_the_card(tmp_path: Path) -> None:
    run = make_run(tmp_path, gate="fail")
    with pytest.raises(PublishError) as err:
        dry(run)
    assert err.value.problem == "the release gate failed on wiki_ppl"
    assert err.value.hint is not None and "--force" in err.value.hint
    res = dry(run, force=True)
    assert res.forced
    text = (res.folder / "README.md").read_text()
    assert "Published with `--force` although the release gate failed" in text
    assert "**Release gate: FAIL** (blocking failures: wiki_ppl" in text


def test_ungated_run_is_refused(tmp_path: Path) -> None:
    run = make_run(tmp_path, gate=None)
    with pytest.raises(PublishError) as err:
        dry(run)
    assert err.value.problem == "the run has not been evaluated and gated"
    assert err.value.hint is not None and "`quantize gate RUN`" in err.value.hint
    text = (dry(run, force=True).folder / "README.md").read_text()
    assert "without a release gate" in text and "Not evaluated" in text


_CHANGED = "does not match its recorded sha256 (changed or truncated)"


@pytest.mark.parametrize(("damage", "where", "problem"), [
    (lambda e: (e / "tokenizer.json").unlink(), "", "lacks ['tokenizer.json']"),
    (lambda e: (e / "config.json").write_text("{}"), "config.json", _CHANGED),
    (lambda e: (e / "model.safetensors").write_bytes(b"x"), "model.safetensors", _CHANGED),
])
def test_damaged_export_is_refused_even_with_force(tmp_path: Path, damage: Any, where: str,
                                                    problem: str) -> None:
    run = make_run(tmp_path)
    damage(run / "export")
    with pytest.raises(PublishError) as err:
        dry(run, force=True)
    assert (err.value.path, err.value.problem) == (str(run / "export" / where), problem)
    assert err.value.hint is not None and "re-run" in err.value.hint


def test_changed_eval_result_is_refused(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    ev = json.loads((run / "eval" / "eval.json").read_text())
    ev["metrics"][0]["candidate"] = 1.0  # a prettier number typed in by hand
    (run / "eval" / "eval.json").write_text(json.dumps(ev))
    with pytest.raises(PublishError) as err:
        dry(run, force=True)
    assert (err.value.path, err.value.problem) == (str(run / "eval" / "eval.json"), _CHANGED)


def test_gate_of_an_older_export_is_refused(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    m = read_manifest(run)
    m["stages"]["eval"]["inputs"]["export"] = "0" * 64
    write_manifest(run, m)
    with pytest.raises(PublishError) as err:
        dry(run, force=True)
    assert err.value.problem == "the eval results belong to an older export"
    assert err.value.hint is not None and "`quantize run`" in err.value.hint


def test_failed_verification_is_refused(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    write_verify(run, passed=False, verdict="fail", result="greedy agreement 41.0%")
    with pytest.raises(PublishError) as err:
        dry(run, force=True)
    assert err.value.problem == "verification at level 'vllm' failed (greedy agreement 41.0%)"
    assert err.value.hint is not None and "`quantize verify`" in err.value.hint


def test_not_a_run_folder(tmp_path: Path) -> None:
    with pytest.raises(PublishError) as err:
        dry(tmp_path)
    assert err.value.path == str(tmp_path)
    assert err.value.problem == f"{tmp_path} is not a run folder (no manifest.json)"


# --- credentials -------------------------------------------------------------------------
def test_no_token_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   no_network: None) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # conftest makes tests offline
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    with pytest.raises(PublishError) as err:
        publish(PublishOptions(run=make_run(tmp_path), org="acme"))
    assert err.value.problem == "no Hugging Face token"
    assert err.value.hint is not None and err.value.hint.startswith("set HF_TOKEN or run `hf")


def test_offline_mode_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(PublishError) as err:
        publish(PublishOptions(run=make_run(tmp_path), org="acme"))
    assert err.value.problem == "HF_HUB_OFFLINE is set, so nothing can be uploaded"
    assert err.value.hint is not None and "--dry-run" in err.value.hint


def test_redact_removes_the_token_and_token_like_strings() -> None:
    text = f"401 for Bearer {FAKE_TOKEN}; other hf_abcdefghijklmnop"
    out = redact(text, FAKE_TOKEN)
    assert FAKE_TOKEN not in out and "hf_abcdefghijklmnop" not in out and "***" in out


# --- the command -------------------------------------------------------------------------
def test_cli_dry_run_lists_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 no_network: None) -> None:
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    run = make_run(tmp_path)
    out = tmp_path / "repo"
    res = CliRunner().invoke(main, ["publish", str(run), "--org", "acme", "--dry-run",
                                    "--out", str(out), "--base-model", "acme-base/Tiny-Base"])
    assert res.exit_code == 0, res.output
    assert "dry run: nothing was uploaded" in res.output
    assert f"acme/{REPO_NAME} (private)" in res.output
    for rel in ("README.md", "model.safetensors", "quantize/gate.json"):
        assert rel in res.output and (out / rel).is_file()
    assert FAKE_TOKEN not in res.output
    again = CliRunner().invoke(main, ["publish", str(run), "--org", "acme", "--dry-run",
                                      "--out", str(out)])
    assert again.exit_code == 2 and "exists and is not empty" in again.output


def test_cli_refusal_exits_2_with_one_line(tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["publish", str(make_run(tmp_path, gate="fail")),
                                    "--org", "acme", "--dry-run"])
    assert res.exit_code == 2
    assert res.output.strip().startswith("error: refused: the release gate failed on wiki_ppl")
