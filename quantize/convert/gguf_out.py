"""Hugging Face folder -> one GGUF file llama.cpp and gguf-py read: architecture metadata,
the hyper-parameters llama.cpp needs, the byte-level BPE tokenizer with its chat template,
and every weight in the asked type (1-D tensors stay F32, as llama.cpp's converter does).

Streaming: GGUFWriter takes every tensor's name, shape and type before any data
(add_tensor_info, then header, key-values and tensor table), then the data one tensor at a
time (write_tensor_data). From safetensors the shapes come from the file headers, so memory
holds one tensor. A dequantizing source (`tensors`, a callable the convert runner passes for
compressed-tensors/GPTQ/FP8 inputs) only yields values, so its tensors are quantized as they
come and spilled to a file beside the output (gguf-py's own temp-file mode, pointed into the
work folder), then copied behind the header: one tensor in memory, the output size twice on
disk for the duration."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from quantize.convert.gguf_names import (
    ROPE_PERMUTED,
    NameTable,
    gguf_arch,
    permute_qk,
    qk_heads,
    rope_to_gguf,
    tensor_check,
)
from quantize.convert.produced import Produced
from quantize.errors import ModelError

TensorSource = Callable[[], Iterator[tuple[str, Any]]]
# the out types gguf.quants can write (its quantize_blocks exists for these)
OUT_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
# HF tensors that have no GGUF counterpart by design, and why
_NO_GGUF_TENSOR = {"rotary_emb.inv_freq": "rope inverse frequencies: recomputed by llama.cpp"}


def hf_to_gguf(src: Path, work: Path, out_type: str = "bf16",
               tensors: TensorSource | None = None) -> Produced:
    """Write `work/<src name>-<out_type>.gguf` from the HF folder `src`."""
    import gguf
    from transformers import AutoConfig

    from quantize.progress import step

    if out_type not in OUT_TYPES:
        raise ModelError(problem=f"GGUF type {out_type!r} cannot be written",
                         hint=f"use one of {', '.join(OUT_TYPES)}")
    config = AutoConfig.from_pretrained(src)
    arch = gguf_arch(config.model_type, src)
    rope = rope_to_gguf(dict(config.rope_parameters or {}), src)  # refuses before any work
    _check_tokenizer(src)
    table = NameTable.for_config(config)
    qtype = gguf.GGMLQuantizationType[out_type.upper()]
    path = work / f"{src.name}-{out_type}.gguf"
    writer = gguf.GGUFWriter(path, arch)
    _add_hparams(writer, config, rope, out_type, src.name)
    out = Produced(files=[path.name])
    with step(f"reading {src.name}'s tokenizer"):
        out.notes += _add_tokenizer(writer, src, config)
    permute = arch in ROPE_PERMUTED
    heads = (config.num_attention_heads, config.num_key_value_heads)
    with step(f"writing {path.name}"):
        if tensors is None:
            _from_safetensors(writer, src, table, qtype, permute, heads, out)
        else:
            _from_values(writer, path, tensors, table, qtype, permute, heads, out)
    if permute:
        out.notes.append("q/k rows permuted into llama.cpp's rope layout")
    if config.tie_word_embeddings:
        out.notes.append("tied embeddings: no output.weight written (llama.cpp reads "
                         "token_embd)")
    if config.model_type == "mistral":
        out.notes.append("mistral written as GGUF arch llama (llama.cpp's convention); it "
                         "reads back as a llama config")
    if rope:
        out.notes.append(f"rope scaling written as rope.scaling.*: {rope}")
    return out


def _check_tokenizer(src: Path) -> None:
    """Only byte-level BPE tokenizers (GPT-2 style: SmolLM, Llama 3, Qwen) are written;
    sentencepiece vocabularies need llama.cpp's own scores and byte tokens."""
    path = src / "tokenizer.json"
    if not path.is_file():
        raise ModelError(problem="has no tokenizer.json", path=src, path_sep=" ",
                         hint="save the tokenizer with transformers (save_pretrained) first")
    spec = json.loads(path.read_text())
    model = (spec.get("model") or {}).get("type")
    if model != "BPE" or "ByteLevel" not in json.dumps(spec.get("decoder")):
        raise ModelError(problem=f"tokenizer is {model} without byte-level decoding; only "
                                 "byte-level BPE tokenizers are written to GGUF", path=path,
                         hint="convert with llama.cpp's convert_hf_to_gguf.py instead")


def _add_hparams(writer: Any, config: Any, rope: dict[str, Any], out_type: str,
                 name: str) -> None:
    import gguf

    head_dim = getattr(config, "head_dim", None) or \
        config.hidden_size // config.num_attention_heads
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    if rope:
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope["type"]))
        for suffix, adder in (("factor", writer.add_rope_scaling_factor),
                              ("original_context_length", writer.add_rope_scaling_orig_ctx_len),
                              ("attn_factor", writer.add_rope_scaling_attn_factors),
                              ("yarn_beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                              ("yarn_beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
            if suffix in rope:
                adder(rope[suffix])
    writer.add_file_type(getattr(gguf.LlamaFileType, "ALL_F32" if out_type == "f32"
                                 else f"MOSTLY_{out_type.upper()}"))
    if out_type.startswith("q"):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _add_tokenizer(writer: Any, src: Path, config: Any) -> list[str]:
    """Tokens and types as llama.cpp's convert_hf_to_gguf builds a GPT-2 style vocabulary
    (get_vocab_base); merges, special ids, add_bos/eos and the chat template through gguf-py's
    SpecialVocab, which reads the same HF files llama.cpp does."""
    import gguf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    vocab_size = max(config.vocab_size, len(tok))
    reverse = {i: t for t, i in tok.get_vocab().items()}
    added = tok.get_added_vocab()
    decoder = tok.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif reverse[i] in added:
            tokens.append(reverse[i])
            is_special = decoder[i].special if i in decoder else True
            types.append(gguf.TokenType.CONTROL if is_special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    pre, notes = _pre_tokenizer(src, config)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(src, load_merges=True, n_vocab=len(tokens))
    # the model's ids are config.json's (what transformers generates with); the tokenizer
    # files' may differ, and an id the config does not set is not invented here
    for kind in ("bos", "eos", "pad", "unk"):
        want = getattr(config, f"{kind}_token_id", None)
        if isinstance(want, list):
            notes.append(f"{kind}_token_id {want}: GGUF holds one id, {want[0]} written")
            want = want[0] if want else None
        have = special.special_token_ids.get(kind)
        if want is None:
            special.special_token_ids.pop(kind, None)
            if have is not None:
                notes.append(f"tokenizer's {kind} id {have} not written: config.json has none")
        else:
            special.special_token_ids[kind] = int(want)
    special.add_to_gguf(writer, quiet=True)
    if special.chat_template is None:
        notes.append("no chat template in the source tokenizer files")
    return notes


def _pre_tokenizer(src: Path, config: Any) -> tuple[str, list[str]]:
    """llama.cpp's name for the pre-tokenizer regex. llama.cpp picks it by hashing the
    tokenization of a probe text; the families recognised here are read off tokenizer.json
    instead, and anything else gets "default" with a note (it changes how llama.cpp splits
    text into tokens, not the logits of given token ids)."""
    pre = json.dumps(json.loads((src / "tokenizer.json").read_text()).get("pre_tokenizer"))
    if config.model_type in ("qwen2", "qwen3"):
        return "qwen2", []
    if '"individual_digits": true' in pre and "ByteLevel" in pre:
        return "smollm", []
    if "\\\\p{N}{1,3}" in pre:
        return "llama-bpe", []
    return "default", ["tokenizer.ggml.pre set to 'default': llama.cpp may split text "
                       "differently from the HF tokenizer"]


def _target_type(shape: tuple[int, ...], qtype: Any) -> Any:
    """1-D tensors (norms, biases) stay F32; rows that are not a whole number of blocks
    fall back to F16, both as llama.cpp's converter does."""
    import gguf

    if len(shape) < 2:
        return gguf.GGMLQuantizationType.F32
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if shape[-1] % block:
        return gguf.GGMLQuantizationType.F16
    return qtype


def _gguf_name(hf: str, table: NameTable, out: Produced) -> str | None:
    name = table.to_gguf.get(hf) or table.gguf_name(hf)
    if name is None:
        out.dropped[hf] = next((why for key, why in _NO_GGUF_TENSOR.items() if key in hf),
                               "no GGUF tensor of this name in gguf-py's map")
    elif name == "output.weight" and table.tied:
        out.dropped[hf] = "tied lm_head: llama.cpp reads token_embd"
        return None
    return name


def _encode(w: np.ndarray, name: str, target: Any, permute: bool,
            heads: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(source values in GGUF layout, their encoding in the target type)."""
    import gguf

    hq = qk_heads(name, *heads) if permute else None
    if hq is not None:
        w = permute_qk(w, *hq)
    return w, gguf.quants.quantize(np.ascontiguousarray(w), target)


def _info(writer: Any, name: str, shape: tuple[int, ...], target: Any) -> None:
    import gguf

    if target in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        dtype = np.float32 if target == gguf.GGMLQuantizationType.F32 else np.float16
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        writer.add_tensor_info(name, shape, np.dtype(dtype), nbytes)
    else:
        byte_shape = gguf.quant_shape_to_byte_shape(shape, target)
        writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                               raw_dtype=target)


def _record(out: Produced, hf: str, name: str, w: np.ndarray, q: np.ndarray,
            target: Any) -> None:
    import gguf
    import torch

    back = gguf.quants.dequantize(q, target).reshape(w.shape)
    out.checks.append(tensor_check(hf, name, torch.from_numpy(np.ascontiguousarray(w)),
                                   torch.from_numpy(np.ascontiguousarray(back))))
    out.mapped[hf] = name


def _st_files(src: Path) -> list[Path]:
    index = src / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [src / f for f in files]
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ModelError(problem="has no safetensors weights", path=src, path_sep=" ",
                         hint="save the model with save_pretrained (safetensors) first")
    return files


def _from_safetensors(writer: Any, src: Path, table: NameTable, qtype: Any, permute: bool,
                      heads: tuple[int, int], out: Produced) -> None:
    from safetensors import safe_open

    plan: list[tuple[Path, str, str, Any]] = []
    for f in _st_files(src):
        with safe_open(f, framework="pt") as fh:
            for hf in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                out.source_names.add(hf)
                name = _gguf_name(hf, table, out)
                if name is None:
                    continue
                shape = tuple(fh.get_slice(hf).get_shape())
                target = _target_type(shape, qtype)
                _info(writer, name, shape, target)
                plan.append((f, hf, name, target))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    current: tuple[Path, Any] | None = None
    try:
        for f, hf, name, target in plan:
            if current is None or current[0] != f:
                if current is not None:
                    current[1].__exit__(None, None, None)
                current = (f, safe_open(f, framework="pt").__enter__())
            w = current[1].get_tensor(hf).float().numpy()
            w, q = _encode(w, name, target, permute, heads)
            writer.write_tensor_data(q)
            _record(out, hf, name, w, q, target)
    finally:
        if current is not None:
            current[1].__exit__(None, None, None)
        writer.close()


def _from_values(writer: Any, path: Path, tensors: TensorSource, table: NameTable, qtype: Any,
                 permute: bool, heads: tuple[int, int], out: Produced) -> None:
    spill = path.with_name(f".{path.name}.tensors")
    # GGUFWriter.add_tensor appends to writer.temp_file when set; set it to a real file in
    # the work folder (its default is a SpooledTemporaryFile in the system temp folder)
    writer.use_temp_file = True
    writer.temp_file = open(spill, "w+b")  # noqa: SIM115 - closed by write_tensors_to_file
    try:
        for hf, value in tensors():
            out.source_names.add(hf)
            name = _gguf_name(hf, table, out)
            if name is None:
                continue
            w = value.float().numpy() if hasattr(value, "numpy") else np.asarray(value)
            target = _target_type(tuple(w.shape), qtype)
            w, q = _encode(w.astype(np.float32, copy=False), name, target, permute, heads)
            writer.add_tensor(name, q, raw_dtype=None if q.dtype != np.uint8 else target)
            _record(out, hf, name, w, q, target)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
        spill.unlink(missing_ok=True)
