"""GGUF -> HF (quantize.convert.gguf_in): the round trip HF -> GGUF -> HF on tiny random
models computes the source's logits in plain transformers, the config and tokenizer match
what transformers' own GGUF mapping builds, shards stream, and refusals come first. The
shipped default-model GGUF is checked against transformers' own GGUF load (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fixtures.gguf_models import CHAT_TEMPLATE, YARN, kl, logits, tiny_hf, toy_gguf

from quantize.convert.gguf_in import config_dict, gguf_to_hf
from quantize.convert.gguf_names import read_gguf
from quantize.convert.gguf_out import hf_to_gguf
from quantize.errors import ModelError

# the GGUF fixtures read a real tokenizer and write two GGUFs (~20 CPU s of setup on 2
# cores): past the fast tier's limit, so these run in `make test`
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tiny(default_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_hf(tmp_path_factory.mktemp("gguf-in") / "tiny", default_tokenizer)


class _Lazy:
    """Each file made on first use, so the cost spreads over the tests that need it (the
    fast tier limits each test's setup)."""

    def __init__(self, tiny: Path, factory: pytest.TempPathFactory) -> None:
        self.tiny, self.factory = tiny, factory
        self.ggufs: dict[str, Path] = {}
        self.backs: dict[str, tuple] = {}

    def gguf(self, kind: str) -> Path:
        if kind not in self.ggufs:
            work = self.factory.mktemp(f"g-{kind}")
            self.ggufs[kind] = work / hf_to_gguf(self.tiny, work, kind).files[0]
        return self.ggufs[kind]

    def back(self, kind: str) -> tuple:
        if kind not in self.backs:
            work = self.factory.mktemp(f"hf-{kind}")
            self.backs[kind] = (work, gguf_to_hf(self.gguf(kind), work))
        return self.backs[kind]


@pytest.fixture(scope="module")
def made(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> _Lazy:
    return _Lazy(tiny, tmp_path_factory)


def test_bf16_round_trip_computes_the_source_logits(tiny: Path, made: _Lazy) -> None:
    work, produced = made.back("bf16")
    ref, got = logits(tiny), logits(work)
    # the weights come back bit for bit; only rms_norm_eps passes through float32
    assert kl(ref, got) < 1e-6
    assert float((ref - got).abs().max()) < 1e-3
    assert all(c.max_abs == 0.0 for c in produced.checks)


def test_q8_0_round_trip_stays_close(tiny: Path, made: _Lazy) -> None:
    work, produced = made.back("q8_0")
    ref, got = logits(tiny), logits(work)
    # measured 2.0e-6 nats on this model; the bound leaves room for other seeds
    assert 0 < kl(ref, got) < 1e-4
    assert bool((ref.argmax(-1) == got.argmax(-1)).all())
    # q8_0 values are exact in bf16 times their scale: the bf16 write loses ~1e-3 at most
    assert min(c.cosine for c in produced.checks) > 0.99999


def test_names_tied_rope_template_special_tokens_survive(tiny: Path, made: _Lazy) -> None:
    from safetensors import safe_open

    work, produced = made.back("bf16")
    with safe_open(tiny / "model.safetensors", framework="pt") as fh:
        src_names = set(fh.keys())
    with safe_open(work / "model.safetensors", framework="pt") as fh:
        out_names = set(fh.keys())
    assert out_names == src_names and "lm_head.weight" not in out_names
    assert set(produced.mapped.values()) == out_names and produced.dropped == {}
    src_cfg = json.loads((tiny / "config.json").read_text())
    cfg = json.loads((work / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True
    assert cfg["rope_parameters"] == src_cfg["rope_parameters"] == YARN
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "vocab_size",
                "bos_token_id", "eos_token_id", "architectures", "head_dim"):
        assert cfg[key] == src_cfg[key], key
    assert cfg["rms_norm_eps"] == pytest.approx(src_cfg["rms_norm_eps"])
    assert (work / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    gen = json.loads((work / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (src_cfg["bos_token_id"],
                                                          src_cfg["eos_token_id"])
    from transformers import AutoTokenizer

    a, b = AutoTokenizer.from_pretrained(tiny), AutoTokenizer.from_pretrained(work)
    text = "Hello world, 123 <|im_start|>user\nhi<|im_end|>"
    assert a(text).input_ids == b(text).input_ids
    assert (a.bos_token_id, a.eos_token_id) == (b.bos_token_id, b.eos_token_id)
    assert any("un-permuted" in n for n in produced.notes)


def test_config_is_the_one_transformers_gguf_mapping_builds(made: _Lazy) -> None:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = made.gguf("bf16")
    want = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    assert config_dict(read_gguf(path)) == want


def test_shards_stream_with_an_index(made: _Lazy, tiny: Path, tmp_path: Path) -> None:
    produced = gguf_to_hf(made.gguf("bf16"), tmp_path, shard_bytes=64 << 10)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(produced.mapped.values())
    assert {p.name for p in shards} <= set(produced.files)
    assert kl(logits(tiny), logits(tmp_path)) < 1e-6


def test_rope_freqs_is_reported_dropped_and_other_archs_refused(tmp_path: Path) -> None:
    path = toy_gguf(tmp_path / "toy.gguf", extra_tensors={"rope_freqs.weight": np.ones(4)})
    gf = read_gguf(path)
    assert "rope_freqs.weight" in {t.name for t in gf.tensors}
    work = tmp_path / "work"
    work.mkdir()
    gpt2 = toy_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ModelError, match="architecture 'gpt2' is not supported for "
                                         "conversion; supported: llama, qwen2, qwen3"):
        gguf_to_hf(gpt2, work)
    assert list(work.iterdir()) == []
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ModelError, match="cannot be read as GGUF"):
        gguf_to_hf(broken, work)


@pytest.mark.slow  # converts the 98 MB default-model GGUF and loads it twice: ~60 s
def test_shipped_gguf_matches_transformers_own_gguf_load(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from quantize.model.source import gguf_path

    src = gguf_path()
    produced = gguf_to_hf(src, tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name,
                                               dtype=torch.bfloat16)
    got = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    # the same dequantized values in the same layout: every weight identical
    ref_sd, got_sd = ref.state_dict(), got.state_dict()
    assert set(ref_sd) == set(got_sd)
    assert all(torch.equal(ref_sd[k], got_sd[k]) for k in ref_sd)
    ids = [1, 504, 3458, 282, 4649, 314, 7042, 30, 957, 28]
    # bf16 models with the same weights: the same logits, bit for bit
    assert torch.equal(logits(ref, ids), logits(got, ids))
    assert produced.dropped == {} and len(produced.mapped) == 272
