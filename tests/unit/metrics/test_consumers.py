"""Consumer agreement (quantize/metrics/consumers.py, spec/consumers.py, the gate's consumer
rows): a rotated export loaded by plain transformers and by lm-eval's `hf` model computes
another model (they do not apply its online transforms), the card's transform snippet
computes the reference's; the gate fails such an export for a transformers consumer in one
line naming it; a recipe that advertises a consumer its rotations cannot run in is refused
when it loads.

The tiny model here has sharp next-token distributions (weights drawn with std 0.2, not
0.02): on a near-uniform random model, dropping a rotation moves the output too little to
tell a wrong loader from rounding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.e2e  # llm-compressor's oneshot and three loads (~15 s): make test only


@pytest.fixture(scope="module")
def exports(default_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> dict[str, Path]:
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from quantize.backends.llmcompressor import build_modifiers
    from quantize.recipe.recipe import load_recipe

    tok = AutoTokenizer.from_pretrained(default_tokenizer)
    torch.manual_seed(0)
    src = tmp_path_factory.mktemp("sharp")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=True,
                      initializer_range=0.2, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(src)
    ids = torch.randint(5, 1000, (4, 64)).tolist()
    ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 64] * 4})
    out = {}
    for recipe in ("gptq-int4-rotated", "gptq-int4-asym"):
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        oneshot(model=model, processor=tok, dataset=ds, num_calibration_samples=4,
                max_seq_length=64, recipe=build_modifiers(load_recipe(recipe), 64))
        out[recipe] = tmp_path_factory.mktemp(recipe)
        model.save_pretrained(out[recipe], save_compressed=True)
        tok.save_pretrained(out[recipe])
    return out


def _rows(export: Path, consumers: list[str]) -> dict[str, object]:
    from quantize.stages.eval import consumer_rows

    return {r.name: r for r in consumer_rows(export, "cpu", consumers)}


def test_plain_loaders_drop_the_online_rotations(exports: dict[str, Path]) -> None:
    from quantize.metrics.consumers import measured_here
    from quantize.recipe.consumers import MAX_KL

    rows = _rows(exports["gptq-int4-rotated"], measured_here(True))
    assert set(rows) == {"consumer:transformers", "consumer:lm-eval-hf",
                         "consumer:transformers+transforms"}
    for name in ("consumer:transformers", "consumer:lm-eval-hf"):
        s = rows[name].settings  # type: ignore[attr-defined]
        assert s["kl"] > 10 * MAX_KL and s["top1_agreement"] < 0.5
    good = rows["consumer:transformers+transforms"].settings  # type: ignore[attr-defined]
    assert good["kl"] < MAX_KL / 100 and good["top1_agreement"] > 0.99
    assert good["ppl"] == pytest.approx(good["reference_ppl"], rel=1e-3)


def test_a_portable_export_agrees_in_every_local_consumer(exports: dict[str, Path]) -> None:
    from quantize.metrics.consumers import measured_here
    from quantize.recipe.consumers import MAX_KL

    assert measured_here(False) == ["transformers", "lm-eval-hf"]
    rows = _rows(exports["gptq-int4-asym"], measured_here(False))
    for r in rows.values():
        assert r.settings["kl"] < MAX_KL / 100, r  # type: ignore[attr-defined]
        assert r.settings["top1_agreement"] > 0.99  # type: ignore[attr-defined]


def test_the_gate_fails_a_rotated_export_for_transformers_in_one_line(
        exports: dict[str, Path]) -> None:
    from quantize.metrics.consumers import measured_here
    from quantize.run.results import EvalMetrics
    from quantize.stages import gate

    rows = list(_rows(exports["gptq-int4-rotated"], measured_here(True)).values())
    ev = EvalMetrics(metrics=rows)  # type: ignore[arg-type]
    # advertised as the rotated recipes do: the plain loaders only warn
    ok = gate.decide(gate.with_rules(ev, {}, ("vllm", "transformers+transforms")).metrics)
    assert ok.verdict == "pass"
    assert set(ok.warnings) == {"consumer:transformers", "consumer:lm-eval-hf"}
    # judged for a transformers consumer
    bad = gate.decide(gate.with_rules(ev, {}, ("transformers",)).metrics)
    assert bad.verdict == "fail" and bad.failures == ["consumer:transformers"]
    (line,) = gate.failure_lines(bad)
    assert "\n" not in line and line.startswith("transformers `AutoModelForCausalLM")
    assert "computes another model" in line and "top-1 agreement 0.0%" in line


def test_an_advertised_consumer_without_a_row_fails() -> None:
    """An eval.json from before consumers were checked vouches for none of them."""
    from quantize.run.results import EvalMetrics
    from quantize.stages import gate

    res = gate.decide(gate.with_rules(EvalMetrics(metrics=[]), {}, ("transformers", "vllm"))
                      .metrics)
    assert res.failures == ["consumer:transformers"]  # vLLM is verify's to check
    assert "not measured" in gate.failure_lines(res)[0]
