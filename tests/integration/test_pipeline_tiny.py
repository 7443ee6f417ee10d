"""The real pipeline (real llm-compressor algorithms) on a tiny random Llama, for every recipe:
mechanics, the written config, reload through transformers, skip/rerun and the gate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from quantize.errors import GateFailed
from quantize.pipeline import RunOptions, run
from quantize.recipe.recipe import available, load_recipe

# Relative L2 error of the reloaded export's logits vs the unquantized model, on a random
# model (no outlier structure, so these are loose upper bounds, not quality claims). They
# follow the format's precision: INT8 keeps ~2^-8 per weight, FP8 e4m3 only 3 mantissa bits
# (~6% per element, weights and activations), INT4 ~1/15 of each group's range. 2-bit is
# only checked to be finite.
TOLERANCE = {"W8A8": 0.05, "W8A16": 0.03, "FP8_DYNAMIC": 0.12, "W4A16": 0.35, "W4A16_ASYM": 0.35}


@pytest.fixture(scope="module")
def small_calibration(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("spec") / "small.yaml"
    p.write_text("name: small\nbuiltin: wiki\nnum_samples: 8\nseq_len: 128\n")
    return p


def logits(path: Path, ids: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    from quantize.model.decode import load_dequantized

    if "quantization_config" in json.loads((path / "config.json").read_text()):
        # decompressed once (FP4 weights come back in bfloat16 there; load_dequantized gives
        # them the model dtype)
        model = load_dequantized(path, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.inference_mode():
        return model(input_ids=ids).logits


# llm-compressor's recipes; the native-format engines have tests/integration/test_engines.py;
# block FP8 needs 128-multiple shapes the tiny model lacks (tests/integration/
# test_blackwell_pipeline.py runs it on one that has them)
LLMC_RECIPES = [n for n in available("recipes") if load_recipe(n).backend == "llmcompressor"
                and load_recipe(n).scheme != "FP8_BLOCK"]


@pytest.mark.parametrize("recipe", LLMC_RECIPES)
def test_every_recipe_exports_a_loadable_checkpoint(recipe: str, tiny_model: Path,
                                                    small_calibration: Path,
                                                    tmp_path: Path) -> None:
    import torch

    r = load_recipe(recipe)
    source = recipe
    if r.autoround is not None:  # mechanics: 10 tuning steps per layer, not the shipped 200
        import yaml

        data = r.model_dump(mode="json", exclude_defaults=True)
        data["autoround"]["iters"] = 10
        source = str(tmp_path / f"{recipe}.yaml")
        Path(source).write_text(yaml.safe_dump(data))
    pipe = run(RunOptions(recipe=source, model=str(tiny_model), dataset=str(small_calibration),
                          out=tmp_path / "run", until="export", device="cpu"))
    export = tmp_path / "run" / "export"
    cfg = json.loads((export / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["ignore"] == ["lm_head"]
    bits = {"W4A16": 4, "W4A16_ASYM": 4, "W2A16": 2, "W8A8": 8, "W8A16": 8, "FP8_DYNAMIC": 8,
            "NVFP4": 4, "NVFP4A16": 4, "MXFP4": 4, "MXFP4A16": 4}[r.scheme]
    groups = [g["weights"] for g in qc["config_groups"].values()]
    # mixed_precision: the recipe's scheme and the 8-bit layers it chose, one group each (on
    # this tiny model 5.5 % of the bytes, mostly the embedding's, raises every layer)
    assert {g["num_bits"] for g in groups} <= ({bits, 8} if r.mixed_precision else {bits})
    w = next((g for g in groups if g["num_bits"] == bits), groups[0])
    if r.group_size:  # `auto`: what pre-flight resolved for this model
        group = pipe.facts.group_size if r.group_size == "auto" else r.group_size
        assert isinstance(group, int)
        assert (w["strategy"], w["group_size"]) == ("group", group)
    assert (qc["kv_cache_scheme"] is not None) == (r.kv_cache == "fp8")
    # the export holds our recipe, a manifest with hashes of every other file, safetensors only
    shipped = Path(source if source != recipe else f"recipes/{recipe}.yaml")
    assert (export / "recipe.yaml").read_text() == shipped.read_text()
    manifest = json.loads((export / "manifest.json").read_text())
    assert set(manifest["files"]) == {p.name for p in export.iterdir()} - {"manifest.json"}
    assert manifest["calibration"]["fingerprint"] == \
        pipe.manifest.stages["calibrate"].summary["fingerprint"]
    assert not [p for p in export.iterdir() if p.suffix in (".bin", ".pt")]
    # reloads through transformers + compressed-tensors and stays close to the original
    ids = torch.tensor([[1, 504, 3458, 314, 253, 1345, 30, 378, 9621, 282, 253, 2634]])
    ref, got = logits(tiny_model, ids), logits(export, ids)
    assert torch.isfinite(got).all()
    tol = TOLERANCE.get(r.scheme)
    if tol is not None:
        rel = float((got - ref).norm() / ref.norm())
        assert rel < tol, f"{recipe}: relative logit error {rel:.3f} >= {tol}"


def test_rerun_skips_unchanged_stages_and_rebuilds_tampered_ones(
        tiny_model: Path, small_calibration: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    opts = RunOptions(recipe="fp8-dynamic", model=str(tiny_model), out=tmp_path / "run",
                      dataset=str(small_calibration), until="export", device="cpu")
    first = run(opts).manifest
    capsys.readouterr()
    second = run(opts).manifest
    err = capsys.readouterr().err
    assert err.count("skip") == 3 and "inputs unchanged" in err
    assert second.stages["export"].ended == first.stages["export"].ended
    # tamper with the export's config: the next run notices and rebuilds the export only
    c = tmp_path / "run" / "export" / "config.json"
    c.write_text(c.read_text().replace("quantization_config", "quantisation_config"))
    third = run(opts).manifest
    err = capsys.readouterr().err
    assert "export: outputs no longer match the manifest" in err
    assert third.stages["export"].outputs == first.stages["export"].outputs
    assert third.stages["quantize"].ended == first.stages["quantize"].ended
    # truncate a weight file in place: it is hard-linked to the quantize stage's, so that
    # stage is found damaged too and both are rebuilt, to the same bytes
    w = tmp_path / "run" / "export" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-10])
    fourth = run(opts).manifest
    err = capsys.readouterr().err
    assert "quantize: outputs no longer match the manifest" in err
    assert "skip quantize" not in err
    # the same files; only the export's manifest.json differs (it records stage timings)
    outs = [{k: v for k, v in m.stages["export"].outputs.items() if k != "manifest.json"}
            for m in (first, fourth)]
    assert outs[0] == outs[1]


def test_the_model_is_fingerprinted_while_it_quantizes_and_a_changed_model_reruns(
        tiny_model: Path, small_calibration: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The fingerprint is hashed in the background on a first run, recorded all the same;
    new bytes carried in with the old size and mtime (`cp -p`, `rsync -a`) still re-run."""
    import os
    import shutil

    from quantize.model.source import model_fingerprint, resolve_model

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    opts = RunOptions(recipe="fp8-dynamic", model=str(model), out=tmp_path / "run",
                      dataset=str(small_calibration), until="export", device="cpu")
    first = run(opts).manifest
    fp = first.model.fingerprint
    assert fp == model_fingerprint(resolve_model(str(model)))
    assert first.stages["quantize"].inputs["model"]["fingerprint"] == fp
    export_meta = json.loads((tmp_path / "run" / "export" / "manifest.json").read_text())
    assert export_meta["model"]["fingerprint"] == fp
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["model"][
        "fingerprint"] == fp
    capsys.readouterr()
    w = model / "model.safetensors"
    st = w.stat()
    data = bytearray(w.read_bytes())
    data[-1] ^= 1  # the last byte of the last tensor
    w.write_bytes(bytes(data))
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))  # as `cp -p` leaves it
    second = run(opts).manifest
    err = capsys.readouterr().err
    assert "quantize: inputs changed (model)" in err
    assert second.model.fingerprint != fp


def _suite(tmp_path: Path, threshold: float) -> Path:
    p = tmp_path / f"tiny{int(threshold * 100)}.yaml"
    p.write_text(f"""\
name: tiny{int(threshold * 100)}
metrics:
  - name: wiki_ppl
    kind: perplexity
    direction: lower_is_better
    builtin: wiki-eval
    max_tokens: 512
    seq_len: 128
    threshold: {threshold}
  - name: general_knowledge
    kind: multiple_choice
    direction: higher_is_better
    task: bigbench:general_knowledge
    limit: 8
    threshold: 0.01
    on_fail: warn
""")
    return p


def test_gate_passes_and_fails_with_exit_codes_and_report(
        tiny_model: Path, small_calibration: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from quantize.cli import main

    out = tmp_path / "run"
    args = ["run", "fp8-dynamic", "--model", str(tiny_model), "--dataset",
            str(small_calibration), "--out", str(out), "--device", "cpu"]
    ok = CliRunner().invoke(main, [*args, "--suite", str(_suite(tmp_path, 0.5))])
    assert ok.exit_code == 0, ok.output
    gate = json.loads((out / "gate" / "gate.json").read_text())
    assert gate["verdict"] == "pass" and json.loads(
        (out / "manifest.json").read_text())["releasable"] is True
    ev = json.loads((out / "eval" / "eval.json").read_text())
    assert {m["name"] for m in ev["metrics"]} == {"wiki_ppl", "general_knowledge",
                                                  "consumer:transformers", "consumer:lm-eval-hf"}
    assert ev["metrics"][0]["n"] > 0 and ev["metrics"][0]["baseline"] > 1
    # an impossible threshold (candidate 50% better than baseline) fails the gate: exit 3,
    # only eval's rules changed, so quantize and export are reused
    bad = CliRunner().invoke(main, [*args, "--suite", str(_suite(tmp_path, 1.5))])
    assert bad.exit_code == GateFailed.exit_code
    assert "gate failed on wiki_ppl" in bad.output and "not releasable" in bad.output
    gate = json.loads((out / "gate" / "gate.json").read_text())
    assert gate["failures"] == ["wiki_ppl"]
    assert "| wiki_ppl |" in (out / "gate" / "gate.md").read_text()
    assert json.loads((out / "manifest.json").read_text())["releasable"] is False
    # the export folder alone (what a user downloads) is evaluated and gated the same way
    alone = CliRunner().invoke(main, ["eval", str(out / "export"), "--suite",
                                      str(_suite(tmp_path, 0.5)), "--out",
                                      str(tmp_path / "ck")])
    assert alone.exit_code == 0, alone.output
    ck = json.loads((tmp_path / "ck" / "eval.json").read_text())
    assert ck["metrics"][0]["candidate"] == ev["metrics"][0]["candidate"]
    assert json.loads((tmp_path / "ck" / "gate.json").read_text())["verdict"] == "pass"
    worse = CliRunner().invoke(main, ["eval", str(out / "export"), "--suite",
                                      str(_suite(tmp_path, 1.5)), "--out",
                                      str(tmp_path / "ck2")])
    assert worse.exit_code == GateFailed.exit_code and "gate failed: wiki_ppl" in worse.output
