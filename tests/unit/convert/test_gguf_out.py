"""HF -> GGUF (quantize.convert.gguf_out) on tiny random models: what gguf-py's own reader
finds in the file, the q/k permutation, tied embeddings, the types, and transformers' own
GGUF loader (an independent consumer) computing the source model's logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fixtures.gguf_models import CHAT_TEMPLATE, DEFAULT_ROPE, kl, logits, tiny_hf

from quantize.convert.gguf_names import permute_qk, read_gguf
from quantize.convert.gguf_out import OUT_TYPES, hf_to_gguf
from quantize.errors import ModelError

# the GGUF fixtures read a real tokenizer and write two GGUFs (~20 CPU s of setup on 2
# cores): past the fast tier's limit, so these run in `make test`
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tiny(default_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_hf(tmp_path_factory.mktemp("gguf-out") / "tiny", default_tokenizer)


@pytest.fixture(scope="module")
def written(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    out = {}
    for kind in ("bf16", "q8_0"):
        work = tmp_path_factory.mktemp(f"gguf-{kind}")
        produced = hf_to_gguf(tiny, work, kind)
        out[kind] = (work / produced.files[0], produced)
    return out


@pytest.fixture(scope="module")
def readers(written: dict) -> dict:
    """gguf-py's own reader (an independent parser) on each written file: ~5 s each on the
    49k vocabulary, so once per module."""
    import gguf

    return {kind: gguf.GGUFReader(path) for kind, (path, _) in written.items()}


def test_gguf_reader_reads_metadata_types_and_every_tensor(tiny: Path, written: dict,
                                                           readers: dict) -> None:
    import gguf
    from safetensors import safe_open

    with safe_open(tiny / "model.safetensors", framework="pt") as fh:
        hf_names = set(fh.keys())
    for kind, qtype in (("bf16", gguf.GGMLQuantizationType.BF16),
                        ("q8_0", gguf.GGMLQuantizationType.Q8_0)):
        path, produced = written[kind]
        assert path.name == f"tiny-{kind}.gguf"
        r = readers[kind]
        f = {k: v.contents() for k, v in r.fields.items()
             if k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")}
        assert f["general.architecture"] == "llama"
        assert (f["llama.block_count"], f["llama.embedding_length"],
                f["llama.feed_forward_length"], f["llama.context_length"]) == (2, 64, 128, 1024)
        assert (f["llama.attention.head_count"], f["llama.attention.head_count_kv"]) == (4, 2)
        assert f["llama.rope.freq_base"] == 10000.0
        assert f["llama.rope.scaling.type"] == "yarn"
        assert f["llama.rope.scaling.factor"] == 4.0
        assert f["llama.rope.scaling.original_context_length"] == 256
        assert f["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
        assert f["tokenizer.chat_template"] == CHAT_TEMPLATE
        assert f["tokenizer.ggml.bos_token_id"] == 1
        assert f["tokenizer.ggml.model"] == "gpt2"
        assert len(r.fields["tokenizer.ggml.tokens"].data) == f["llama.vocab_size"] == 49152
        assert len(r.fields["tokenizer.ggml.merges"].data) > 40000
        # tied: the checkpoint has no lm_head and the GGUF no output.weight
        names = {t.name for t in r.tensors}
        assert "output.weight" not in names and "lm_head.weight" not in hf_names
        assert len(r.tensors) == len(hf_names) == len(produced.mapped)
        assert set(produced.mapped) == hf_names and set(produced.mapped.values()) == names
        for t in r.tensors:
            want = gguf.GGMLQuantizationType.F32 if len(t.shape) == 1 else qtype
            assert t.tensor_type == want, t.name


def test_checks_measure_the_encoding_loss(written: dict) -> None:
    _, bf16 = written["bf16"]
    _, q8 = written["q8_0"]
    assert len(bf16.checks) == len(q8.checks) == len(bf16.mapped)
    # a bf16 checkpoint written as bf16 is a copy; q8_0 loses a little on every matrix
    assert all(c.max_abs == 0.0 and c.cosine == pytest.approx(1.0) for c in bf16.checks)
    matrices = [c for c in q8.checks if "norm" not in c.target]
    assert all(0.9999 < c.cosine < 1.0 and c.max_abs > 0 for c in matrices)


def test_q_and_k_rows_are_in_llama_cpp_rope_layout(tiny: Path, readers: dict) -> None:
    import gguf
    from safetensors.torch import load_file

    sd = load_file(tiny / "model.safetensors")
    r = readers["bf16"]
    by = {t.name: t for t in r.tensors}
    for gname, hf, heads in (("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight",
                              (4, 4)),
                             ("blk.1.attn_k.weight", "model.layers.1.self_attn.k_proj.weight",
                              (4, 2))):
        t = by[gname]
        got = gguf.quants.dequantize(t.data, t.tensor_type)
        src = sd[hf].float().numpy()
        assert np.array_equal(got, permute_qk(src, *heads))
        assert not np.array_equal(got, src)
    v = by["blk.0.attn_v.weight"]
    assert np.array_equal(gguf.quants.dequantize(v.data, v.tensor_type),
                          sd["model.layers.0.self_attn.v_proj.weight"].float().numpy())


@pytest.mark.slow  # transformers parses the 49k vocabulary twice per load: ~20 s
def test_transformers_own_gguf_loader_computes_the_source_logits(
        default_tokenizer: Path, tmp_path: Path) -> None:
    # default rope: transformers' GGUF config mapping drops rope.scaling.* for llama, so a
    # YaRN file loads there with plain rope (gguf_in restores it)
    src = tiny_hf(tmp_path / "plain", default_tokenizer, rope=DEFAULT_ROPE, seed=1)
    produced = hf_to_gguf(src, tmp_path, "bf16")
    ref = logits(src)
    got = logits(tmp_path, gguf_file=produced.files[0])
    assert kl(ref, got) < 1e-6
    assert float((ref - got).abs().max()) < 1e-3


def test_a_value_source_writes_the_same_file_as_safetensors(tiny: Path, written: dict,
                                                           tmp_path: Path) -> None:
    from safetensors import safe_open

    def values():  # type: ignore[no-untyped-def]
        with safe_open(tiny / "model.safetensors", framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118
                yield name, fh.get_tensor(name).float()

    produced = hf_to_gguf(tiny, tmp_path, "q8_0", tensors=values)
    path = tmp_path / produced.files[0]
    assert path.read_bytes() == written["q8_0"][0].read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # the spill file is gone


@pytest.mark.parametrize("kind", ["q4_0", "q5_1", "f16"])
def test_legacy_types_gguf_py_can_quantize(tiny: Path, tmp_path: Path, kind: str) -> None:
    import gguf

    produced = hf_to_gguf(tiny, tmp_path, kind)
    gf = read_gguf(tmp_path / produced.files[0])
    types = {t.qtype for t in gf.tensors if len(t.shape) == 2}
    assert types == {gguf.GGMLQuantizationType[kind.upper()]}
    floor = 0.99 if kind.startswith("q4") else 0.995
    assert min(c.cosine for c in produced.checks) > floor
    assert gf.metadata["general.file_type"] == getattr(gguf.LlamaFileType,
                                                       f"MOSTLY_{kind.upper()}")


@pytest.mark.slow  # transformers' own GGUF load: ~20 s
def test_untied_model_writes_output_and_qwen2_keeps_rows_and_biases(
        default_tokenizer: Path, tmp_path: Path) -> None:
    src = tiny_hf(tmp_path / "q", default_tokenizer, model_type="qwen2", tied=False,
                  rope=DEFAULT_ROPE)
    produced = hf_to_gguf(src, tmp_path, "bf16")
    gf = read_gguf(tmp_path / produced.files[0])
    names = {t.name for t in gf.tensors}
    assert gf.arch == "qwen2"
    assert "output.weight" in names and "blk.0.attn_q.bias" in names
    assert not any("permuted" in n for n in produced.notes)  # qwen2 rows are not permuted
    assert kl(logits(src), logits(tmp_path, gguf_file=produced.files[0])) < 1e-6


def test_refusals_come_before_any_file(tiny: Path, tmp_path: Path) -> None:
    import json
    import shutil

    with pytest.raises(ModelError, match="q2_k"):
        hf_to_gguf(tiny, tmp_path, "q2_k")
    assert "q8_0" in OUT_TYPES and "q2_k" not in OUT_TYPES
    other = tmp_path / "other"
    shutil.copytree(tiny, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 256}
    (other / "config.json").write_text(json.dumps(cfg))
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(ModelError, match="rope_type 'llama3'"):
        hf_to_gguf(other, work, "bf16")
    cfg["model_type"] = "gpt2"
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="'gpt2' cannot be written as GGUF; supported: "):
        hf_to_gguf(other, work, "bf16")
    assert list(work.iterdir()) == []
