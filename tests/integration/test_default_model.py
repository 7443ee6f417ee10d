"""The real pretrained default model (SmolLM2-135M-Instruct) through the real pipeline:
GPTQ INT4 with a small calibration set, reloaded from disk, and real perplexity on real
text (a small slice, so the default test run stays fast).

The two GPTQ runs (gptq-int4 and the default recipe, to the gate on the smoke suite) are the
session's (fixtures/default_runs.py): `quantize run` subprocesses started side by side when
the session starts, each keeping one core busy for minutes while the suite goes on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from quantize.pipeline import RunOptions, run
from quantize.recipe.recipe import DEFAULT_RECIPE

# gptq-int4 and the default recipe, to the gate on the smoke suite with 8 x 256 calibration
# tokens: fixtures/default_runs.py
DEFAULT_RUNS = {"gptq-int4": "gate", DEFAULT_RECIPE: "gate"}


@pytest.fixture(scope="module")
def gptq_run(default_model: Path, default_runs: Any) -> Path:
    return default_runs("gptq-int4", until="gate")  # type: ignore[no-any-return]


def test_gptq_int4_export_config(gptq_run: Path) -> None:
    cfg = json.loads((gptq_run / "export" / "config.json").read_text())
    qc = cfg["quantization_config"]
    w = qc["config_groups"]["group_0"]["weights"]
    assert (qc["quant_method"], qc["format"]) == ("compressed-tensors", "pack-quantized")
    assert (w["num_bits"], w["symmetric"], w["strategy"], w["group_size"]) == (
        4, True, "group", 64)
    assert qc["ignore"] == ["lm_head"]
    assert cfg["tie_word_embeddings"] is True
    # bf16 is 257 MiB; INT4 layers plus the 16-bit (tied) embedding table: ~108 MiB
    size = (gptq_run / "export" / "model.safetensors").stat().st_size
    assert 90 * 2**20 < size < 130 * 2**20, size


def test_reloaded_export_tracks_the_original(gptq_run: Path, default_model: Path) -> None:
    """Next-token agreement with the bf16 original over ~430 tokens of held-out text.
    INT4 g64 on this 135M model (8×256 calibration) measured 64% top-1 agreement and 0.43
    relative logit error; a broken export (wrong scales, shuffled packing) agrees on a few
    percent at most. The bounds leave room for run-to-run variation, not for breakage."""
    import torch

    from quantize.metrics import BUILTIN_EVAL_TEXT
    from quantize.stages.eval import load_model

    ref, tok = load_model(default_model, "cpu")
    cand, _ = load_model(gptq_run / "export", "cpu")
    text = BUILTIN_EVAL_TEXT["wiki-eval"].read_text()[:2000]
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        a, b = ref(input_ids=ids).logits, cand(input_ids=ids).logits
    assert torch.isfinite(b).all()
    agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    rel = float((b - a).norm() / a.norm())
    assert agree >= 0.5, f"top-1 agreement {agree:.2f}"
    assert rel < 0.6, f"relative logit error {rel:.2f}"


def test_real_perplexity_on_real_text(gptq_run: Path) -> None:
    ev = json.loads((gptq_run / "eval" / "eval.json").read_text())
    ppl = next(m for m in ev["metrics"] if m["name"] == "wiki_ppl")
    # A pretrained 135M model on Wikipedia: token perplexity in the tens (random: ~49152)
    assert 5 < ppl["baseline"] < 60, ppl
    assert ppl["baseline"] < ppl["candidate"] < 2 * ppl["baseline"], ppl
    assert ppl["n"] >= 2000
    gate = json.loads((gptq_run / "gate" / "gate.json").read_text())
    scores = [r for r in gate["rows"] if r.get("kind") != "consumer_agreement"]
    assert gate["verdict"] in ("pass", "fail") and len(scores) == 2
    # the real export, loaded as plain transformers and lm-eval load it, is the reference
    consumers = {r["name"]: r for r in gate["rows"] if r.get("kind") == "consumer_agreement"}
    assert set(consumers) == {"consumer:transformers", "consumer:lm-eval-hf"}
    for r in consumers.values():
        assert r["verdict"] == "pass" and r["settings"]["top1_agreement"] > 0.99, r


# The native engines on the real model: tiny random models cannot tell a working engine from
# one that writes a destroyed model (AutoAWQ 0.2.9 on transformers 5.17 did exactly that, found
# only on this model: docs/engines.md), so each engine is held to the same bounds as GPTQ above.
@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["gptq-int4-gptqmodel", "awq-int4-gptqmodel"])
def test_native_engine_export_tracks_the_original(recipe: str, default_model: Path,
                                                  tmp_path: Path) -> None:
    import importlib.util

    import torch

    from quantize.metrics import BUILTIN_EVAL_TEXT
    from quantize.stages.eval import load_model

    if importlib.util.find_spec("gptqmodel") is None:
        pytest.skip("the gptqmodel extra is not installed: pip install -e .[gptqmodel]")
    spec = tmp_path / "calib.yaml"
    spec.write_text("name: calib\nbuiltin: wiki\nnum_samples: 8\nseq_len: 256\n")
    run(RunOptions(recipe=recipe, model="default", dataset=str(spec), out=tmp_path / "run",
                   until="export", device="cpu"))
    ref, tok = load_model(default_model, "cpu")
    cand, _ = load_model(tmp_path / "run" / "export", "cpu")
    ids = tok(BUILTIN_EVAL_TEXT["wiki-eval"].read_text()[:2000], return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        a, b = ref(input_ids=ids).logits, cand(input_ids=ids).logits
    agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    rel = float((b - a).norm() / a.norm())
    assert agree >= 0.5, f"{recipe}: top-1 agreement {agree:.2f}"
    assert rel < 0.6, f"{recipe}: relative logit error {rel:.2f}"


@pytest.fixture(scope="module")
def default_recipe_run(default_model: Path, default_runs: Any) -> Path:
    """The default recipe (quantize.recipe.recipe.DEFAULT_RECIPE) on the real default model with
    the same small calibration and the same smoke slice of the default suite as `gptq_run`."""
    return default_runs(DEFAULT_RECIPE, until="gate")  # type: ignore[no-any-return]


def _recovery(run_dir: Path, name: str) -> float:
    ev = json.loads((run_dir / "eval" / "eval.json").read_text())
    return float(next(m for m in ev["metrics"] if m["name"] == name)["recovery"])


def test_the_default_recipe_beats_the_old_symmetric_default(default_recipe_run: Path,
                                                            gptq_run: Path) -> None:
    """Issue #15 on a slice: same calibration, same 2,040 tokens, same bits and group size.
    Measured (8 x 256 calibration, 2,040 tokens): gptq-int4-asym 87.4% perplexity recovery
    (30.90 vs 27.00), gptq-int4 70.5% (38.32); eval/README.md has the full default suite:
    88.6% vs 75.2%. The paired noise of this slice is about +-5 points, so a 10-point margin
    is a real difference, and a regression of the default back to the symmetric min-max grid
    fails here."""
    new, old = _recovery(default_recipe_run, "wiki_ppl"), _recovery(gptq_run, "wiki_ppl")
    assert new >= 0.80, f"default recipe keeps {new:.1%} of perplexity on the smoke slice"
    assert new >= old + 0.10, f"default {new:.1%} vs gptq-int4 {old:.1%}"
    gate = json.loads((default_recipe_run / "gate" / "gate.json").read_text())
    assert gate["verdict"] == "pass", gate


def test_the_tokenizer_is_the_one_transformers_builds_from_the_gguf(
        default_model: Path, default_tokenizer: Path, tmp_path: Path) -> None:
    """The conversion builds its tokenizer from the GGUF's metadata (15 s faster than
    transformers' whole-file parse): it must be `AutoTokenizer.from_pretrained(gguf_file=)`'s,
    file for file; conftest's `default_tokenizer`, which stands in for it in every tiny model
    of the suite, must be the conversion's."""
    from fixtures.tokenizer import LOAD_ONLY_KEYS
    from transformers import AutoTokenizer

    from quantize.model.source import gguf_path

    gguf = gguf_path()
    reference = tmp_path / "transformers"
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(reference)

    def config(folder: Path) -> dict[str, object]:
        data = json.loads((folder / "tokenizer_config.json").read_text())
        return {k: v for k, v in data.items() if k not in LOAD_ONLY_KEYS}

    for other in (reference, default_tokenizer):
        for name in ("tokenizer.json", "chat_template.jinja"):
            assert (other / name).read_bytes() == (default_model / name).read_bytes(), name
        assert config(other) == config(default_model), other.name
