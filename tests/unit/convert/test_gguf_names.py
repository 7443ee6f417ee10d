"""The GGUF <-> HF table (quantize.convert.gguf_names) on its own: supported architectures
both ways and the refusals, tensor names from gguf-py and the transformers class (attention,
MLP, embedding, norms, biases, q/k norms; MoE / nextn names as gguf-py gives them), the q/k
row permutation, rope scaling keys both ways, the tensor check's numbers, and the GGUF
parser against gguf-py's own reader. Small GGUFs written in code, no network."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixtures.gguf_models import toy_gguf

from quantize.convert.gguf_names import (
    GGUF_TO_HF_TYPE,
    HF_TO_GGUF_ARCH,
    ROPE_PERMUTED,
    NameTable,
    dequantize,
    gguf_arch,
    hf_model_type,
    permute_qk,
    qk_heads,
    read_gguf,
    rope_from_gguf,
    rope_to_gguf,
    tensor_check,
    unpermute_qk,
)
from quantize.errors import ModelError

SUPPORTED = "supported: llama, qwen2, qwen3"


def _config(model_type: str, tied: bool = False) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, vocab_size=32, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, tie_word_embeddings=tied)


# --- architectures ----------------------------------------------------------------------


def test_supported_architectures_map_both_ways() -> None:
    assert {a: hf_model_type(a) for a in GGUF_TO_HF_TYPE} == {
        "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
    # every GGUF arch read comes back as itself when written
    assert all(gguf_arch(hf_model_type(a)) == a for a in GGUF_TO_HF_TYPE)
    assert gguf_arch("mistral") == "llama"  # llama.cpp writes Mistral as llama
    assert set(HF_TO_GGUF_ARCH.values()) == set(GGUF_TO_HF_TYPE)
    assert set(ROPE_PERMUTED) <= set(GGUF_TO_HF_TYPE)


@pytest.mark.parametrize("arch", ["gpt2", "qwen3moe", "deepseek2", "mistral"])
def test_unsupported_gguf_architectures_are_refused(arch: str, tmp_path: Path) -> None:
    with pytest.raises(ModelError) as e:
        hf_model_type(arch, tmp_path / "m.gguf")
    assert e.value.problem == f"GGUF architecture {arch!r} is not supported for conversion"
    assert e.value.hint == SUPPORTED
    assert e.value.path == str(tmp_path / "m.gguf")


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt2"])
def test_unsupported_model_types_are_refused(model_type: str) -> None:
    with pytest.raises(ModelError) as e:
        gguf_arch(model_type)
    assert e.value.problem == f"model_type {model_type!r} cannot be written as GGUF"
    assert e.value.hint == "supported: llama, mistral, qwen2, qwen3"


# --- tensor names -----------------------------------------------------------------------

LLAMA_LAYER = {
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight"}
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
          "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
EXTRA = {"llama": {}, "qwen2": {f"self_attn.{p}_proj.bias": f"attn_{p}.bias" for p in "qkv"},
         "qwen3": {"self_attn.q_norm.weight": "attn_q_norm.weight",
                   "self_attn.k_norm.weight": "attn_k_norm.weight"}}


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_every_weight_of_the_class_is_named_both_ways(model_type: str) -> None:
    table = NameTable.for_config(_config(model_type))
    layer = LLAMA_LAYER | EXTRA[model_type]
    want = dict(GLOBAL)
    for i in range(2):
        want |= {f"model.layers.{i}.{hf}": f"blk.{i}.{g}" for hf, g in layer.items()}
    assert table.arch == model_type and table.tied is False
    assert table.to_gguf == want
    assert table.to_hf == {g: hf for hf, g in want.items()}


def test_tied_embeddings_come_from_the_config() -> None:
    assert NameTable.for_config(_config("llama", tied=True)).tied is True
    assert NameTable("llama", 2, []).tied is False


def test_unknown_names_get_no_gguf_name_and_no_table_entry() -> None:
    known = "model.layers.1.mlp.down_proj.weight"
    unknown = ["model.foo.weight", "model.layers.2.self_attn.q_proj.weight",  # past n_layers
               "model.layers.0.mlp.experts.0.gate_proj.weight",  # one expert of an MoE
               "model.layers.1.eh_proj.weight"]  # a nextn tensor of an arch without them
    table = NameTable("llama", 2, [known, *unknown])
    assert all(table.gguf_name(n) is None for n in unknown)
    assert table.to_gguf == {known: "blk.1.ffn_down.weight"}
    assert table.to_hf == {"blk.1.ffn_down.weight": known}


def test_moe_and_nextn_names_are_gguf_pys() -> None:
    # Mixtral's router in the llama arch; experts are merged tensors in GGUF, so a single
    # expert's weight has no name of its own
    llama = NameTable("llama", 2, [])
    assert llama.gguf_name("model.layers.0.block_sparse_moe.gate.weight") == \
        "blk.0.ffn_gate_inp.weight"
    moe = NameTable("deepseek2", 2, [])
    assert moe.gguf_name("model.layers.0.mlp.shared_experts.gate_proj.weight") == \
        "blk.0.ffn_gate_shexp.weight"
    assert moe.gguf_name("model.layers.0.mlp.experts.0.gate_proj.weight") is None
    # nextn layers are `blk.N.nextn.*`: the names gguf_facts counts MTP layers by
    nextn = NameTable("glm4moe", 2, ["model.layers.1.eh_proj.weight",
                                     "model.layers.1.enorm.weight"])
    assert nextn.to_hf == {"blk.1.nextn.eh_proj.weight": "model.layers.1.eh_proj.weight",
                           "blk.1.nextn.enorm.weight": "model.layers.1.enorm.weight"}


# --- q/k permutation --------------------------------------------------------------------


def test_permute_interleaves_the_two_rope_halves_of_each_head() -> None:
    w = np.arange(16, dtype=np.float32).reshape(16, 1)
    got = permute_qk(w, n_head=2)[:, 0].astype(int).tolist()
    # HF rotates halves (0..3 with 4..7), llama.cpp adjacent pairs
    assert got == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    # k rows permute with the kv head count
    assert permute_qk(w, n_head=4, n_kv_head=2).tolist() == permute_qk(w, 2).tolist()
    assert permute_qk(w, n_head=4, n_kv_head=4).tolist() != permute_qk(w, 2).tolist()


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.3.attn_k.weight"])
def test_unpermute_is_the_inverse_with_the_heads_qk_heads_gives(name: str) -> None:
    heads = qk_heads(name, n_head=8, n_kv_head=2)
    assert heads == ((8, 8) if "attn_q" in name else (8, 2))
    rows = 64 if "attn_q" in name else 16  # head_dim 8
    w = np.random.default_rng(0).standard_normal((rows, 12)).astype(np.float32)
    p = permute_qk(w, *heads)
    assert not np.array_equal(p, w)
    assert np.array_equal(unpermute_qk(p, *heads), w)


@pytest.mark.parametrize("name", ["blk.0.attn_v.weight", "blk.0.attn_output.weight",
                                  "blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight",
                                  "blk.0.ffn_gate.weight", "token_embd.weight"])
def test_only_q_and_k_weights_are_permuted(name: str) -> None:
    assert qk_heads(name, 8, 2) is None


# --- rope scaling -----------------------------------------------------------------------

YARN_FULL = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
             "original_max_position_embeddings": 4096, "attention_factor": 0.8,
             "beta_fast": 32.0, "beta_slow": 1.0}


def test_rope_scaling_round_trips_through_gguf_keys() -> None:
    out = rope_to_gguf(YARN_FULL)
    assert out == {"type": "yarn", "factor": 4.0, "original_context_length": 4096,
                   "attn_factor": 0.8, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0}
    fields = {f"qwen2.rope.scaling.{k}": v for k, v in out.items()}
    back = rope_from_gguf(fields, "qwen2")
    assert back == {k: v for k, v in YARN_FULL.items() if k != "rope_theta"}
    assert isinstance(back["original_max_position_embeddings"], int)
    assert isinstance(back["factor"], float)


def test_rope_values_read_from_gguf_take_hf_types() -> None:
    fields = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": np.float32(2),
              "llama.rope.scaling.original_context_length": np.uint32(2048)}
    back = rope_from_gguf(fields, "llama")
    assert back == {"rope_type": "linear", "factor": 2.0,
                    "original_max_position_embeddings": 2048}
    assert type(back["factor"]) is float
    assert type(back["original_max_position_embeddings"]) is int


def test_default_rope_and_missing_values_write_nothing() -> None:
    assert rope_to_gguf({"rope_type": "default", "rope_theta": 1e4}) == {}
    assert rope_to_gguf({}) == {}
    # the legacy `type` key, and None values left out
    assert rope_to_gguf({"type": "linear", "factor": 2.0, "beta_fast": None}) == \
        {"type": "linear", "factor": 2.0}


def test_no_scaling_in_the_file_reads_as_none() -> None:
    assert rope_from_gguf({}, "llama") == {}
    assert rope_from_gguf({"llama.rope.scaling.type": "none"}, "llama") == {}
    # another arch's keys are not this file's
    assert rope_from_gguf({"qwen2.rope.scaling.type": "yarn"}, "llama") == {}


@pytest.mark.parametrize("kind", ["llama3", "longrope", "dynamic"])
def test_rope_types_gguf_stores_otherwise_are_refused(kind: str) -> None:
    with pytest.raises(ModelError) as e:
        rope_to_gguf({"rope_type": kind, "factor": 8.0})
    assert e.value.problem == f"rope_type {kind!r} is not written to GGUF yet"
    assert e.value.hint == "supported rope types: default, linear, yarn"


def test_unknown_gguf_rope_scaling_is_refused() -> None:
    with pytest.raises(ModelError) as e:
        rope_from_gguf({"llama.rope.scaling.type": "longrope"}, "llama")
    assert e.value.problem == "GGUF rope scaling type 'longrope' is not supported"


# --- tensor check -----------------------------------------------------------------------


def test_tensor_check_numbers() -> None:
    import torch

    a = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    same = tensor_check("s", "t", a, a.clone())
    assert (same.source, same.target, same.max_abs, same.cosine) == ("s", "t", 0.0, 1.0)
    neg = tensor_check("s", "t", a, -a)
    assert neg.cosine == pytest.approx(-1.0, abs=1e-12)
    assert neg.max_abs == pytest.approx(2 * float(a.abs().max()))
    b = a.clone()
    b[3, 4] += 0.25
    off = tensor_check("s", "t", a, b.to(torch.bfloat16))
    assert 0.25 - 0.02 < off.max_abs < 0.25 + 0.02 and 0.99 < off.cosine < 1.0
    z = torch.zeros(8)
    assert tensor_check("s", "t", z, z).cosine == 1.0
    assert tensor_check("s", "t", z, torch.ones(8)).cosine == 0.0
    empty = tensor_check("s", "t", torch.zeros(0, 4), torch.zeros(0, 4))
    assert (empty.max_abs, empty.cosine) == (0.0, 1.0)


def test_tensor_check_sums_a_million_values_without_drift() -> None:
    import torch

    a = torch.randn(1 << 20, generator=torch.Generator().manual_seed(1)) * 100
    assert tensor_check("s", "t", a, a.clone()).cosine == pytest.approx(1.0, abs=1e-12)


# --- the GGUF parser --------------------------------------------------------------------


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, Any]], alignment: int | None = None,
           kv: Any = None) -> Path:
    """A GGUF with only an architecture, `tensors` (values, GGML type) and `kv(writer)`."""
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    if kv is not None:
        kv(w)
    for name, (arr, qtype) in tensors.items():
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_reader_agrees_with_gguf_pys_own_reader(tmp_path: Path) -> None:
    import gguf

    path = toy_gguf(tmp_path / "toy.gguf", layers=2, tied=False)
    gf = read_gguf(path)
    assert gf.path == path and gf.arch == "llama"
    md = gf.metadata
    assert (md["llama.block_count"], md["llama.embedding_length"]) == (2, 32)
    assert md["llama.rope.freq_base"] == 10000.0
    assert md["tokenizer.ggml.tokens"] == [f"t{i}" for i in range(32)]
    assert (md["tokenizer.ggml.bos_token_id"], md["tokenizer.ggml.eos_token_id"]) == (1, 2)
    ref = gguf.GGUFReader(path)
    assert [t.name for t in gf.tensors] == [t.name for t in ref.tensors]
    shapes = {t.name: t.shape for t in gf.tensors}
    assert shapes["blk.1.attn_k.weight"] == (16, 32)  # torch order: [out, in]
    assert shapes["output_norm.weight"] == (32,)
    for mine, theirs in zip(gf.tensors, ref.tensors, strict=True):
        assert mine.shape == tuple(int(d) for d in reversed(theirs.shape))
        assert mine.qtype == theirs.tensor_type == gguf.GGMLQuantizationType.F32
        assert not mine.data.flags.writeable  # a view of the memory map
        assert np.array_equal(dequantize(mine).ravel(), np.asarray(theirs.data).ravel())


def test_reader_reads_every_metadata_type(tmp_path: Path) -> None:
    def kv(w: Any) -> None:
        w.add_uint8("x.u8", 200)
        w.add_int16("x.i16", -7)
        w.add_uint64("x.u64", 1 << 40)
        w.add_float64("x.f64", 0.125)
        w.add_bool("x.yes", True)
        w.add_string("x.s", "héllo")
        w.add_array("x.ints", [3, 1, 2])
        w.add_array("x.strs", ["a", "", "ü"])
        w.add_array("x.floats", [0.5, 1.5])

    gf = read_gguf(_write(tmp_path / "kv.gguf", {}, kv=kv))
    got = {k: v for k, v in gf.metadata.items() if k.startswith("x.")}
    assert got == {"x.u8": 200, "x.i16": -7, "x.u64": 1 << 40, "x.f64": 0.125, "x.yes": True,
                   "x.s": "héllo", "x.ints": [3, 1, 2], "x.strs": ["a", "", "ü"],
                   "x.floats": [0.5, 1.5]}
    assert gf.tensors == []


def test_reader_slices_quantized_tensors_at_a_custom_alignment(tmp_path: Path) -> None:
    import gguf

    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    values = {"a": (3, 64), "b": (5, 32), "c": (7, 96), "d": (33,), "e": (2, 3, 64)}
    arrays = {k: rng.standard_normal(s).astype(np.float32) for k, s in values.items()}
    types = {"a": T.Q8_0, "b": T.BF16, "c": T.Q4_0, "d": T.F32, "e": T.F16}
    tensors = {k: (arrays[k] if types[k] != T.F16 else arrays[k].astype(np.float16), types[k])
               for k in values}
    gf = read_gguf(_write(tmp_path / "q.gguf", tensors, alignment=64))
    assert gf.metadata["general.alignment"] == 64
    got = {t.name: t for t in gf.tensors}
    for k, arr in arrays.items():
        t = got[k]
        assert (t.shape, t.qtype) == (arr.shape, types[k])
        out = dequantize(t)
        assert out.dtype == np.float32 and out.shape == arr.shape
        if types[k] == T.F32:
            assert np.array_equal(out, arr)
        elif types[k] == T.F16:
            assert np.array_equal(out, arr.astype(np.float16).astype(np.float32))
        elif types[k] == T.BF16:
            np.testing.assert_allclose(out, arr, rtol=2 ** -8)
        else:  # per 32-value block: Q8_0 rounds to half a step, Q4_0 (codes -8..7, so the
            # side opposite the block's largest value clamps) to within one step
            amax = np.abs(arr.reshape(-1, 32)).max(-1, keepdims=True)
            bound = amax / 127 / 2 if types[k] == T.Q8_0 else amax / 8
            assert (np.abs(out - arr).reshape(-1, 32) <= bound * 1.01 + 1e-6).all(), k


def test_tensor_data_starts_at_the_files_alignment(tmp_path: Path) -> None:
    import gguf

    arr = np.arange(64, dtype=np.float32).reshape(2, 32)
    # headers of several lengths, so the data start falls between the default 32-byte
    # boundary and the file's 256-byte one
    for pad in range(0, 256, 24):
        path = _write(tmp_path / f"a{pad}.gguf", {"w": (arr, gguf.GGMLQuantizationType.F32)},
                      alignment=256, kv=lambda w, pad=pad: w.add_string("x.pad", "p" * pad))
        assert np.array_equal(dequantize(read_gguf(path).tensors[0]), arr), pad


def _header(version: int, n_tensors: int = 0, n_kv: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


@pytest.mark.parametrize(("content", "why"), [
    (b"not a gguf file at all, sorry", "no GGUF magic bytes"),
    (_header(1), "GGUF version 1"),
    (_header(3), "no general.architecture"),
    (_header(3, n_kv=1) + struct.pack("<Q", 3) + b"abc" + struct.pack("<I", 99),
     "metadata value type 99"),
    (_header(3, n_kv=5)[:20], "unpack_from requires"),
])
def test_files_that_are_not_gguf_are_one_model_error(tmp_path: Path, content: bytes,
                                                      why: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelError) as e:
        read_gguf(path)
    assert e.value.problem is not None
    assert e.value.problem.startswith("cannot be read as GGUF (") and why in e.value.problem
    assert e.value.hint == "check that the file is a complete GGUF v2/v3 file"
    assert e.value.path == str(path)


def test_truncated_and_missing_files_are_one_model_error(tmp_path: Path) -> None:
    whole = toy_gguf(tmp_path / "toy.gguf").read_bytes()
    for cut in (30, len(whole) // 2, len(whole) - 8):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(whole[:cut])
        with pytest.raises(ModelError, match="cannot be read as GGUF"):
            read_gguf(path)
    with pytest.raises(ModelError, match="cannot be read as GGUF"):
        read_gguf(tmp_path / "absent.gguf")
