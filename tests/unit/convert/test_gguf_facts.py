"""The facts of a GGUF file in HF terms (quantize.convert.gguf_facts): tensor names mapped to
HF names (names with no HF weight kept as they are, so a comparison shows them lost), tied
embeddings, rope parameters with YaRN scaling, special token ids, generation ids, chat
template, nextn / MTP layers, the refusals; and, end to end, that a faithful conversion either
way compares equal with the HF folder's facts (quantize.convert.preserve)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixtures.gguf_models import CHAT_TEMPLATE, YARN, tiny_hf, toy_gguf

from quantize.convert.gguf_facts import facts_gguf
from quantize.convert.preserve import compare, facts_hf, facts_of
from quantize.convert.produced import ROPE_CONFIG_KEYS
from quantize.errors import ModelError

LAYER0 = {f"model.layers.0.{n}.weight" for n in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
    "post_attention_layernorm")}
TOY_NAMES = LAYER0 | {"model.embed_tokens.weight", "model.norm.weight"}
DEFAULT_ROPE_FACTS = {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
                 "max_position_embeddings": 128}


def _toy_with(monkeypatch: pytest.MonkeyPatch, path: Path, add: Callable[[Any], None],
              **toy: Any) -> Path:
    """toy_gguf with more metadata: `add(writer)` runs right after the writer is made."""
    import gguf

    class Writer(gguf.GGUFWriter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            add(self)

    with monkeypatch.context() as m:
        m.setattr(gguf, "GGUFWriter", Writer)
        return toy_gguf(path, **toy)


def test_facts_of_a_tied_gguf_are_in_hf_terms(tmp_path: Path) -> None:
    path = toy_gguf(tmp_path / "toy.gguf")
    f = facts_gguf(path)
    assert f.tensor_names == TOY_NAMES  # no lm_head: the GGUF has no output.weight
    assert f.tied_embeddings is True
    assert f.rope == DEFAULT_ROPE_FACTS and set(f.rope) <= set(ROPE_CONFIG_KEYS)
    assert f.special_tokens == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None,
                                "unk_token_id": None}
    assert f.generation == {"bos_token_id": 1, "eos_token_id": 2}  # unset ids left out
    assert (f.vocab_size, f.chat_template, f.mtp_layers) == (32, None, 0)
    assert facts_of(path) == f  # preserve reads GGUF files through this module


def test_an_output_head_is_an_untied_lm_head(tmp_path: Path) -> None:
    f = facts_gguf(toy_gguf(tmp_path / "untied.gguf", tied=False, n_vocab=48))
    assert f.tensor_names == TOY_NAMES | {"lm_head.weight"}
    assert f.tied_embeddings is False and f.vocab_size == 48


def test_yarn_rope_template_and_every_special_token(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import gguf

    def add(w: Any) -> None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(256)
        w.add_rope_scaling_yarn_beta_fast(32.0)
        w.add_pad_token_id(0)
        w.add_unk_token_id(3)
        w.add_chat_template(CHAT_TEMPLATE)

    f = facts_gguf(_toy_with(monkeypatch, tmp_path / "yarn.gguf", add))
    assert f.rope == {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0,
                                          "factor": 4.0, "beta_fast": 32.0,
                                          "original_max_position_embeddings": 256},
                      "max_position_embeddings": 128}
    assert type(f.rope["rope_parameters"]["original_max_position_embeddings"]) is int
    assert f.special_tokens == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                                "unk_token_id": 3}
    # the generation config holds bos/eos/pad, not unk
    assert f.generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    assert f.chat_template == CHAT_TEMPLATE


def test_unsupported_rope_scaling_in_the_file_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _toy_with(monkeypatch, tmp_path / "longrope.gguf",
                     lambda w: w.add_string("llama.rope.scaling.type", "longrope"))
    with pytest.raises(ModelError, match="rope scaling type 'longrope' is not supported"):
        facts_gguf(path)


@pytest.mark.parametrize(("layers", "declared", "want"), [
    ([1], None, 1),  # inferred from the tensors
    ([1, 2], None, 2),
    ([1], 2, 2),  # the key counts when it says more
    ([], 1, 1),
])
def test_nextn_layers_are_counted_from_the_key_and_the_tensors(
        tmp_path: Path, layers: list[int], declared: int | None, want: int) -> None:
    extra = {f"blk.{i}.nextn.{n}.weight": np.ones((32, 64) if n == "eh_proj" else (32,))
             for i in layers for n in ("eh_proj", "enorm")}
    kv = {} if declared is None else {"llama.nextn_predict_layers": declared}
    f = facts_gguf(toy_gguf(tmp_path / "nextn.gguf", extra_tensors=extra, extra_kv=kv))
    assert f.mtp_layers == want
    # no HF weight of these names in a llama class: kept in GGUF terms, so a comparison
    # with an HF folder shows them (lost or added), never silently equal
    assert f.tensor_names == TOY_NAMES | set(extra)


def test_a_tensor_with_no_hf_weight_keeps_its_gguf_name(tmp_path: Path) -> None:
    path = toy_gguf(tmp_path / "freqs.gguf", extra_tensors={"rope_freqs.weight": np.ones(4)})
    src = facts_gguf(toy_gguf(tmp_path / "plain.gguf"))
    out = facts_gguf(path)
    assert out.tensor_names == TOY_NAMES | {"rope_freqs.weight"}
    row = compare(src, out)[0]
    assert row.check == "tensor names" and not row.ok
    assert "added 1 (first rope_freqs.weight)" in row.detail


def test_other_architectures_and_broken_files_are_refused(tmp_path: Path) -> None:
    gpt2 = toy_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ModelError) as e:
        facts_gguf(gpt2)
    assert e.value.problem == "GGUF architecture 'gpt2' is not supported for conversion"
    assert e.value.path == str(gpt2)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(toy_gguf(tmp_path / "ok.gguf").read_bytes()[:100])
    with pytest.raises(ModelError) as e:
        facts_of(broken)
    assert e.value.problem is not None and e.value.problem.startswith("cannot be read as GGUF")


@pytest.mark.e2e  # a real tokenizer, a tiny model, a GGUF and back: ~15 CPU s on 2 cores
@pytest.mark.parametrize("tied", [True, False])
def test_faithful_conversions_compare_equal_both_ways(default_tokenizer: Path, tmp_path: Path,
                                                      tied: bool) -> None:
    from quantize.convert.gguf_in import gguf_to_hf
    from quantize.convert.gguf_out import hf_to_gguf

    src = tiny_hf(tmp_path / "hf", default_tokenizer, rope=YARN, tied=tied)
    (tmp_path / "g").mkdir()
    written = hf_to_gguf(src, tmp_path / "g", "q8_0")
    path = tmp_path / "g" / written.files[0]
    hf, gg = facts_hf(src), facts_gguf(path)
    rows = compare(hf, gg, written)
    assert [r.check for r in rows if not r.ok] == []
    assert len(rows) == 8
    assert gg.rope["rope_parameters"] == YARN and gg.tied_embeddings is tied
    assert ("lm_head.weight" in gg.tensor_names) is not tied
    assert gg.chat_template == CHAT_TEMPLATE
    # and back: the HF folder gguf_to_hf writes has the GGUF's facts
    (tmp_path / "back").mkdir()
    read = gguf_to_hf(path, tmp_path / "back")
    rows = compare(gg, facts_hf(tmp_path / "back"), read, path, tmp_path / "back")
    assert [r.check for r in rows if not r.ok] == []
