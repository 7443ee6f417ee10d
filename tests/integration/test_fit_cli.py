"""`quantize fit` end to end on the tiny model (mechanics), its bad inputs (one line, exit 2,
before any work), and one fit of the real default model at one budget (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from quantize.cli import main


def _fit(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(main, ["fit", *args])
    return res.exit_code, res.output


@pytest.mark.parametrize(("args", "words"), [
    (["--gpu", "rtx9999"], "unknown GPU 'rtx9999'"),
    (["--max-weights", "100MB", "--min-recovery", "1.2"], "--min-recovery 1.2 is outside"),
    (["--max-weights", "lots"], "is not a positive size"),
    (["--max-weights", "1MB"], "is below the smallest assignment"),
    (["--max-weights", "100MB", "--bits", "4,5"], "--bits 4,5: choose two or more"),
    ([], "give --gpu"),
])
def test_bad_inputs_one_line(tiny_model: Path, tmp_path: Path, args: list[str],
                             words: str) -> None:
    code, out = _fit(str(tiny_model), "--out", str(tmp_path / "run"), *args)
    assert code == 2, out
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert lines[-1].startswith("error: ") and words in lines[-1], out
    assert "Traceback" not in out
    assert not (tmp_path / "run" / "calibrate").exists()  # refused before any work


def test_nothing_fits_names_the_nearest_setup(tmp_path: Path) -> None:
    code, out = _fit("meta-llama/Llama-3.1-70B-Instruct", "--gpu", "rtx5090", "--gpus", "2",
                     "--max-model-len", "32768", "--concurrency", "16", "--dry-run",
                     "--out", str(tmp_path / "run"))
    assert code == 2, out
    assert "nothing fits" in out and "nearest fitting setup: --concurrency" in out


def test_dry_run_on_a_builtin_config(tmp_path: Path) -> None:
    code, out = _fit("meta-llama/Llama-3.1-70B-Instruct", "--gpu", "rtx5090", "--gpus", "4",
                     "--max-model-len", "32768", "--concurrency", "4", "--dry-run",
                     "--out", str(tmp_path / "run"))
    assert code == 0, out
    assert "fits: yes" in out and "vllm serve" in out and "prior" in out
    fit = json.loads((tmp_path / "run" / "fit" / "fit.json").read_text())
    assert fit["size_bytes"] <= fit["budget_bytes"] and not fit["measured"]
    assert set(fit["counts"]) >= {"4", "8"}


def test_fit_tiny_end_to_end(tiny_model: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    calib = tmp_path / "small.yaml"  # mechanics: a small calibration set and the smoke suite
    calib.write_text("name: small\nbuiltin: wiki\nnum_samples: 8\nseq_len: 128\n")
    # embeddings (tied) 12.6 MB at fp16 + 0.59 MB of Linear weights at fp16: room for some
    code, out = _fit(str(tiny_model), "--max-weights", "12.95MB", "--bits", "4,16",
                     "--out", str(run), "--no-verify", "--runs", str(tmp_path),
                     "--dataset", str(calib), "--suite", "smoke")
    assert code in (0, 3), out  # 3: the gate judged a random model's loss; mechanics here
    fit = json.loads((run / "fit" / "fit.json").read_text())
    assert fit["measured"] and 0 < fit["predicted_recovery"] <= 1
    assert fit["size_bytes"] <= 12_950_000
    assert fit["counts"]["4"][0] > 0 and fit["counts"]["16"][0] > 0  # mixed
    assert fit["measured_recovery"] is not None
    recipe = Path(fit["recipe"])
    assert recipe.is_file() and (run / "export" / "config.json").is_file()
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["recipe"]["name"] == recipe.stem
    assert set(manifest["stages"]) >= {"calibrate", "quantize", "export", "eval", "gate"}
    qc = json.loads((run / "export" / "config.json").read_text())["quantization_config"]
    ignored = [n for n in qc["ignore"] if n != "lm_head"]
    assert len(ignored) == fit["counts"]["16"][0]
    # the cached sensitivity is reused by a dry run with the same model and calibration
    code, out = _fit(str(tiny_model), "--max-weights", "12.95MB", "--bits", "4,16",
                     "--out", str(run), "--dry-run", "--dataset", str(calib))
    assert code == 0 and "reused" in out, out


@pytest.mark.slow
def test_fit_default_model_one_budget(tmp_path: Path) -> None:
    """The real default model at 140 MB (between its 4-bit ~117 MB and 8-bit ~167 MB)."""
    run = tmp_path / "run"
    code, out = _fit("default", "--max-weights", "140MB", "--out", str(run), "--no-verify",
                     "--runs", str(tmp_path))
    assert code == 0, out
    fit = json.loads((run / "fit" / "fit.json").read_text())
    assert fit["size_bytes"] <= 140_000_000
    assert fit["counts"]["4"][0] > 0 and fit["counts"]["8"][0] > 0  # mixed at this budget
    # not yet measured on this host (docs/fit.md): expected above gptq-int4's 75.2%
    assert 0 < fit["measured_recovery"] <= 1.05
