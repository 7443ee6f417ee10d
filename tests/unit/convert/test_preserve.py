"""quantize.convert.preserve: each preservation row catches its own loss."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from fixtures.convert_models import YARN

from quantize.convert.preserve import compare, facts_hf, lost, weight_name
from quantize.convert.produced import Produced


def test_facts_of_an_hf_folder(bf16_mtp_dir: Path, bf16_dir: Path) -> None:
    f = facts_hf(bf16_mtp_dir)
    assert f.mtp_layers == 1 and not f.tied_embeddings
    assert f.rope["rope_parameters"]["rope_type"] == YARN["rope_type"]
    assert f.rope["rope_parameters"]["factor"] == YARN["factor"]
    assert f.chat_template and f.generation["temperature"] == 0.6
    assert f.special_tokens["bos_token_id"] == 1
    tied = facts_hf(bf16_dir)
    assert tied.tied_embeddings and "lm_head.weight" not in tied.tensor_names


def test_mtp_layers_are_inferred_when_the_config_lacks_the_key(bf16_mtp_dir: Path,
                                                               tmp_path: Path) -> None:
    m = tmp_path / "m"
    shutil.copytree(bf16_mtp_dir, m)
    cfg = json.loads((m / "config.json").read_text())
    del cfg["num_nextn_predict_layers"]
    (m / "config.json").write_text(json.dumps(cfg))
    assert facts_hf(m).mtp_layers == 1


def test_every_loss_is_its_own_row(bf16_dir: Path) -> None:
    src = facts_hf(bf16_dir)
    assert not lost(compare(src, src))
    cases = {
        "tensor names": dataclasses.replace(src, tensor_names=src.tensor_names - {
            "model.norm.weight"}),
        "mtp/nextn layers": dataclasses.replace(src, mtp_layers=1),
        "rope parameters": dataclasses.replace(src, rope={**src.rope, "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0}}),
        "chat template": dataclasses.replace(src, chat_template=None),
        "generation config": dataclasses.replace(src, generation={}),
        "special tokens": dataclasses.replace(src, special_tokens={
            **src.special_tokens, "eos_token_id": 5}),
        "vocab size": dataclasses.replace(src, vocab_size=1),
    }
    for check, out in cases.items():
        assert [r.check for r in lost(compare(src, out))] == [check]


def test_a_duplicate_lm_head_for_tied_embeddings_is_a_loss(bf16_dir: Path) -> None:
    src = facts_hf(bf16_dir)
    out = dataclasses.replace(src, tensor_names=src.tensor_names | {"lm_head.weight"})
    assert {r.check for r in lost(compare(src, out))} == {"tensor names", "tied embeddings"}


def test_an_expected_drop_is_not_a_loss(bf16_dir: Path) -> None:
    src = facts_hf(bf16_dir)
    src = dataclasses.replace(src, tensor_names=src.tensor_names | {"lm_head.weight"})
    out = dataclasses.replace(src, tensor_names=src.tensor_names - {"lm_head.weight"})
    produced = Produced(dropped={"lm_head.weight": "tied to the embedding"})
    assert not [r for r in lost(compare(src, out, produced)) if r.check == "tensor names"]


def test_tokenizer_files_are_compared(bf16_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(bf16_dir, out)
    (out / "tokenizer.json").unlink()
    rows = compare(facts_hf(bf16_dir), facts_hf(out), None, bf16_dir, out)
    assert [r.check for r in lost(rows)] == ["tokenizer files"]


def test_side_tensors_fold_into_their_weight() -> None:
    assert weight_name("a.qweight") == "a.weight"
    assert weight_name("a.weight_packed") == "a.weight"
    assert weight_name("a.weight_scale_inv") is None
    assert weight_name("a.weight") == "a.weight"


def test_generation_config_defaults_are_not_information(bf16_dir: Path, tmp_path: Path) -> None:
    """GGUF holds token ids, not transformers' bookkeeping: `_from_model_config` and values
    equal to GenerationConfig's defaults are left out; a real sampling setting stays."""
    folder = tmp_path / "m"
    shutil.copytree(bf16_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"_from_model_config": True, "use_cache": True, "bos_token_id": 1,
         "temperature": 0.2, "transformers_version": "5.17.0"}))
    assert facts_hf(folder).generation == {"bos_token_id": 1, "temperature": 0.2}
