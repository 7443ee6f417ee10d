"""quantize.model.transforms with the loaders: a rotated export (QuIP's Hadamard on each
Linear's input, then GPTQ) loads with its online transforms, so the model built computes what
the quantized model computed in memory; the config parser names the transforms; `unrotated`
gives weights in the source's basis."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.e2e  # the fixture runs llm-compressor's oneshot (~8 s): make test only


@pytest.fixture(scope="module")
def rotated(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantize.backends.llmcompressor import build_modifiers
    from quantize.recipe.recipe import load_recipe

    out = tmp_path_factory.mktemp("rotated")
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    torch.manual_seed(0)
    ids = torch.randint(5, 1000, (4, 64)).tolist()
    ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 64] * 4})
    oneshot(model=model, processor=tok, dataset=ds, num_calibration_samples=4,
            max_seq_length=64, recipe=build_modifiers(load_recipe("gptq-int4-rotated"), 64))
    x = torch.randint(5, 1000, (1, 24))
    with torch.no_grad():
        ref = model(x).logits
    model.save_pretrained(out, save_compressed=True)
    tok.save_pretrained(out)
    return out, x, ref


def test_the_config_names_the_online_hadamard(rotated) -> None:  # type: ignore[no-untyped-def]
    from quantize.model.qconfig import parse

    out, _, _ = rotated
    raw = json.loads((out / "config.json").read_text())["quantization_config"]
    assert parse(raw).online_transforms == ("hadamard",)
    del raw["transform_config"]
    assert parse(raw).online_transforms == ()


def test_the_loaders_apply_the_online_transforms(rotated, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from quantize.model import decode
    from quantize.model.config import read_config

    out, x, ref = rotated
    loaded = decode.load_dequantized(out, dtype=torch.float32)
    reference, decoded = decode.build_reference(out, read_config(out))
    assert decoded
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(reference(x).logits, ref, rtol=1e-4, atol=1e-4)
        # without them the stored (rotated) weights compute another model
        monkeypatch.setattr(decode, "apply_online_transforms", lambda *a: 0)
        plain = decode.load_dequantized(out, dtype=torch.float32)
        assert not torch.allclose(plain(x).logits, ref, atol=1e-2)


def test_unrotated_weights_are_in_the_source_basis(rotated, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    from quantize.model.config import read_config
    from quantize.model.decode import build_reference, weight_similarity
    from quantize.model.transforms import unrotated

    out, _, _ = rotated
    reference, decoded = build_reference(out, read_config(out))
    stored, _ = weight_similarity(decoded, tiny_model)
    source, _ = weight_similarity(unrotated(reference, decoded), tiny_model)
    assert source > 0.9 > stored  # rotated columns do not resemble the source's; unrotated do
