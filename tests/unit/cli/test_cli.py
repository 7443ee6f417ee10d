"""CLI errors: one line naming the problem and the fix, a non-zero exit, no traceback
(unless QUANTIZE_DEBUG=1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from quantize.cli import main


def invoke(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), env=env)
    return result.exit_code, result.output


def test_help_for_every_command() -> None:
    code, out = invoke("--help")
    assert code == 0
    for cmd in ("run", "recipes", "validate", "calibrate", "quantize", "export", "eval", "gate"):
        assert cmd in out
        c, text = invoke(cmd, "--help")
        assert c == 0 and "Usage:" in text


def test_recipes_lists_each_with_a_description() -> None:
    code, out = invoke("recipes")
    assert code == 0
    assert "gptq-int4" in out and "GPTQ INT4" in out and "fp8-kv" in out


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("run", "gptq-int5"), "did you mean 'gptq-int4'"),
        (("run", "gptq-int4", "--model", "/no/such/model"), "does not exist"),
        (("validate", "awq-int8", "--no-model"), "unknown recipe"),
        (("eval", "/no/such/run"), "not a run folder"),
    ],
)
def test_errors_are_one_line(args: tuple[str, ...], match: str) -> None:
    code, out = invoke(*args)
    assert code == 2
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0]
    assert "Traceback" not in out


def test_bad_recipe_type_names_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("name: bad\ndescription: d\nmethod: gptq\nscheme: W4A16\ngroup_size: x\n")
    code, out = invoke("validate", str(p), "--no-model")
    assert code == 2 and f"{p}:5: group_size" in out


def test_group_size_that_does_not_divide_is_caught_before_calibration(
        tmp_path: Path, default_model: Path) -> None:
    p = tmp_path / "g128.yaml"
    p.write_text("name: g128\ndescription: d\nmethod: gptq\nscheme: W4A16\ngroup_size: 128\n")
    code, out = invoke("run", str(p), "--out", str(tmp_path / "run"))
    assert code == 2
    assert "group_size 128 does not divide" in out and "in_features 576" in out
    assert "64" in out and "Traceback" not in out
    assert not (tmp_path / "run" / "calibrate").exists()  # nothing calibrated


def test_missing_config_and_pickle_only_models(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    code, out = invoke("validate", "gptq-int4", "--model", str(tmp_path / "m"))
    assert code == 2 and "no config.json" in out
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "m" / "pytorch_model.bin").write_bytes(b"\x80\x04")
    code, out = invoke("validate", "gptq-int4", "--model", str(tmp_path / "m"))
    assert code == 2 and "pickle" in out and "--allow-pickle" in out


def test_truncated_safetensors(tmp_path: Path, tiny_model: Path) -> None:
    import shutil

    m = tmp_path / "m"
    shutil.copytree(tiny_model, m)
    w = m / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-100])
    code, out = invoke("validate", "gptq-int4", "--model", str(m))
    assert code == 2 and "truncated" in out


def test_unsupported_architecture(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "nosuchformer"}))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    code, out = invoke("validate", "gptq-int4", "--model", str(tmp_path))
    assert code == 2 and "unsupported architecture" in out
    cfg = {"model_type": "nosuchformer", "auto_map": {"AutoModelForCausalLM": "m.M"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, out = invoke("validate", "gptq-int4", "--model", str(tmp_path))
    assert code == 2 and "trust_remote_code" in out


def test_debug_shows_the_traceback() -> None:
    env = {"QUANTIZE_DEBUG": "1"}
    proc = subprocess.run([sys.executable, "-m", "quantize.cli", "run", "gptq-int5"],
                          capture_output=True, text=True, env={**__import__("os").environ,
                                                               **env})
    assert proc.returncode != 0 and "Traceback" in proc.stderr


# --- --tp: the tensor-parallel pre-flight checks from the command line ----------------------
def _config_only_model(folder: Path, **over: object) -> Path:
    """A model folder for pre-flight: its config.json, and zero tensors of the names and
    shapes that config makes (pre-flight reads only the safetensors header of them)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 512,
           "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 4,
           "head_dim": 64, "num_hidden_layers": 1, "vocab_size": 1024,
           "tie_word_embeddings": True, **over}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in AutoModelForCausalLM.from_config(config)
                  .state_dict().items()}
    if cfg["tie_word_embeddings"]:
        shapes.pop("lm_head.weight", None)
    save_file({n: torch.zeros(s) for n, s in shapes.items()}, str(folder / "model.safetensors"))
    return folder


G128 = "name: r\ndescription: d\nmethod: rtn\nscheme: W4A16\ngroup_size: 128\n"
W8A8 = "name: r\ndescription: d\nmethod: rtn\nscheme: W8A8\n"


@pytest.mark.parametrize(
    ("config", "recipe", "tp", "match"),
    [
        ({"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576},
         G128.replace("group_size: 128", "group_size: 64"), 2,
         r"--tp 2: num_attention_heads 9 is not divisible by 2, .* use a tp in \[1, 3, 9\]"),
        ({"num_key_value_heads": 3}, G128, 2,
         r"--tp 2: num_key_value_heads 3 cannot be split or replicated over 2 ranks"),
        ({"intermediate_size": 1002}, W8A8, 4,
         r"--tp 4: model\.layers\.0\.mlp\.gate_proj shards its out_features \(1002\) over 4 "
         r"ranks, which does not divide; use a tp that divides 1002"),
        ({"intermediate_size": 1280}, G128, 4,
         r"--tp 4: model\.layers\.0\.mlp\.down_proj has in_features 1280, 320 per rank, which "
         r"group_size 128 does not divide"),
    ],
    ids=["attention-heads", "kv-heads", "sharded-dim", "group-straddles-ranks"],
)
def test_validate_tp_catches_each_sharding_failure(
        tmp_path: Path, config: dict[str, object], recipe: str, tp: int, match: str) -> None:
    import re

    model = _config_only_model(tmp_path / "m", **config)
    rec = tmp_path / "r.yaml"
    rec.write_text(recipe)
    code, out = invoke("validate", str(rec), "--model", str(model))
    assert code == 0 and "pre-flight ok" in out, out  # the same model is fine at tp 1
    code, out = invoke("validate", str(rec), "--model", str(model), "--tp", str(tp))
    assert code == 2 and "Traceback" not in out
    assert re.search(match, " ".join(out.split())), out


def test_validate_tp_that_fits(tmp_path: Path) -> None:
    model = _config_only_model(tmp_path / "m")
    rec = tmp_path / "r.yaml"
    rec.write_text(G128)
    code, out = invoke("validate", str(rec), "--model", str(model), "--tp", "2")
    assert code == 0 and "pre-flight ok" in out and "tp 2" in out, out
    code, out = invoke("validate", str(rec), "--model", str(model), "--tp", "0")
    assert code == 2 and "--tp" in out


def test_run_tp_is_checked_before_calibration(tmp_path: Path) -> None:
    model = _config_only_model(tmp_path / "m", intermediate_size=1280)
    rec = tmp_path / "r.yaml"
    rec.write_text(G128)
    out_dir = tmp_path / "run"
    code, out = invoke("run", str(rec), "--model", str(model), "--tp", "4",
                       "--out", str(out_dir), "--device", "cpu")
    assert code == 2 and "--tp 4: model.layers.0.mlp.down_proj" in " ".join(out.split()), out
    assert not (out_dir / "calibrate").exists()  # nothing calibrated


def test_progress_bars_are_throttled_when_the_output_is_not_a_terminal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TQDM_MININTERVAL", raising=False)
    res = CliRunner().invoke(main, ["recipes"])  # CliRunner's streams are not terminals
    assert res.exit_code == 0
    assert os.environ.get("TQDM_MININTERVAL") == "30"


@pytest.mark.parametrize(("given", "shown", "applied"), [(None, "PASSIVE", True),
                                                         ("ACTIVE", "ACTIVE", False)])
def test_openmp_waits_passively_unless_the_user_chose(given: str | None, shown: str,
                                                      applied: bool) -> None:
    """torch's OpenMP (libgomp) reads the policy when it loads; the variable is gone again
    afterwards (a child process gets the user's environment); a user's own value wins."""
    code = ("import os; from quantize.cli.app import openmp_waits_passively as f; "
            "r = f(); import torch; print(r, os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["OMP_DISPLAY_ENV"] = "TRUE"  # libgomp prints its settings at load
    if given:
        env["OMP_WAIT_POLICY"] = given
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True)
    assert f"OMP_WAIT_POLICY = '{shown}'" in out.stderr
    assert out.stdout.split() == [str(applied), given or "None"]
