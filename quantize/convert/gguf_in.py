"""GGUF -> Hugging Face safetensors: config, tokenizer, chat template and generation config
rebuilt from the file's metadata, weights dequantized one tensor at a time.

The config and tokenizer come from transformers' own GGUF mapping (AutoConfig/AutoTokenizer
with `gguf_file=`, which read metadata only), so hyper-parameters come out as transformers
would load them; rope scaling (YaRN/linear), which that mapping drops for llama/qwen, is
restored from the `rope.scaling.*` keys (quantize.convert.gguf_names). Weights are read from
gguf.GGUFReader's memory map and written through a streaming safetensors writer, so memory
holds one tensor (its float32 dequantization and its output copy), never a shard."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from quantize.convert.gguf_names import (
    ROPE_PERMUTED,
    GgufFile,
    GgufTensor,
    NameTable,
    hf_model_type,
    qk_heads,
    read_gguf,
    rope_from_gguf,
    tensor_check,
    unpermute_qk,
)
from quantize.convert.gguf_names import dequantize as gguf_dequantize
from quantize.convert.produced import Produced
from quantize.errors import ModelError

SHARD_BYTES = 2 << 30  # output shard size bound; memory does not depend on it
_DTYPES = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}
# GGUF tensors with no HF weight, and why (the runner knows these reasons as expected ones)
_NO_HF_TENSOR = {"rope_freqs.weight": "llama3 rope frequency factors: transformers derives "
                                      "them from rope_parameters, no weight"}


def gguf_to_hf(src: Path, work: Path, dtype: str = "bfloat16",
               shard_bytes: int = SHARD_BYTES) -> Produced:
    """Convert the GGUF file `src` into an HF folder written into `work` (which exists)."""
    from quantize.progress import step

    if dtype not in _DTYPES:
        raise ModelError(problem=f"unknown output dtype {dtype!r}",
                         hint=f"use one of {', '.join(_DTYPES)}")
    gf = read_gguf(src)
    hf_model_type(gf.arch, src)  # refuses other archs before any work
    _check_types(gf)
    with step(f"reading {src.name}'s config and tokenizer"):
        config = hf_config(gf)
        notes = _write_tokenizer(gf, work)
        _write_generation_config(config, work)
    table = NameTable.for_config(config)
    out = Produced(source_names={t.name for t in gf.tensors}, notes=notes)
    plan: list[tuple[GgufTensor, str]] = []
    for t in gf.tensors:
        if t.name in table.to_hf:
            plan.append((t, table.to_hf[t.name]))
            out.mapped[t.name] = table.to_hf[t.name]
        else:
            out.dropped[t.name] = _NO_HF_TENSOR.get(t.name, "no transformers weight of this "
                                                            f"name in {config.model_type}")
    permute = gf.arch in ROPE_PERMUTED
    heads = (config.num_attention_heads, config.num_key_value_heads)
    with step(f"dequantizing {len(plan)} tensors of {src.name} to {dtype}"):
        out.files += _write_weights(plan, work, dtype, shard_bytes, permute, heads, out)
    config.save_pretrained(work)
    out.files = sorted(set(out.files) | {p.name for p in work.iterdir() if p.is_file()})
    counts: dict[str, int] = {}
    for t in gf.tensors:
        counts[t.qtype.name] = counts.get(t.qtype.name, 0) + 1
    out.notes.append("GGUF tensor types: " + ", ".join(f"{k} ×{v}" for k, v in
                                                     sorted(counts.items())))
    if permute:
        out.notes.append("q/k rows un-permuted from llama.cpp's rope layout")
    if config.tie_word_embeddings:
        out.notes.append("tied embeddings: the GGUF has no output.weight, no lm_head written")
    if config.rope_parameters.get("rope_type", "default") != "default":
        out.notes.append(f"rope scaling restored from rope.scaling.*: {config.rope_parameters}")
    return out


def _check_types(gf: GgufFile) -> None:
    """Dequantize one row of each tensor type the file uses: an unsupported type fails here,
    in one line, not after hours of conversion."""
    seen: set[Any] = set()
    for t in gf.tensors:
        if t.qtype in seen:
            continue
        seen.add(t.qtype)
        try:
            gguf_dequantize(t._replace(data=t.data[:1], shape=(1, t.shape[-1])))
        except NotImplementedError as e:
            raise ModelError(problem=f"holds {t.qtype.name} tensors, which gguf-py cannot "
                                     "dequantize", path=gf.path,
                             hint="re-quantize it to a k-quant or legacy type "
                                  "(llama-quantize) and convert that") from e


def config_dict(gf: GgufFile) -> dict[str, Any]:
    """The config dict transformers' load_gguf_checkpoint builds for these archs (its config
    part: GGUF_CONFIG_MAPPING renames, tie_word_embeddings from the absence of output.weight,
    vocab_size from the token list when absent), done on the already parsed metadata because
    load_gguf_checkpoint builds a gguf.GGUFReader (~6 s per call on a 49k vocabulary).
    tests/unit/convert/test_gguf_in.py holds the two equal."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    out: dict[str, Any] = {"tie_word_embeddings": all(t.name != "output.weight"
                                                      for t in gf.tensors)}
    for key, value in gf.metadata.items():
        prefix, _, rest = key.partition(".")
        section: Any = GGUF_CONFIG_MAPPING.get(prefix, {})
        renamed = section.get(rest)
        if renamed is not None and renamed != -1:
            out[renamed] = value
    if "vocab_size" not in out and "tokenizer.ggml.tokens" in gf.metadata:
        out["vocab_size"] = len(gf.metadata["tokenizer.ggml.tokens"])
    return out


def hf_config(gf: GgufFile) -> Any:
    """The transformers config of `gf`: config_dict, plus what transformers' mapping leaves
    out for these archs: rope scaling, the special token ids, the class name."""
    import torch
    from transformers import AutoConfig

    config = AutoConfig.for_model(**config_dict(gf))
    rope = dict(config.rope_parameters or {})
    rope.update(rope_from_gguf(gf.metadata, gf.arch))
    config.rope_parameters = rope
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"),
                      ("pad_token_id", "padding"), ("unk_token_id", "unknown")):
        value = gf.metadata.get(f"tokenizer.ggml.{name}_token_id")
        setattr(config, key, None if value is None else int(value))
    config.architectures = [_causal_lm_class(config)]
    config.dtype = torch.bfloat16
    config._name_or_path = ""
    return config


def _causal_lm_class(config: Any) -> str:
    from transformers import AutoModelForCausalLM

    cls: Any = AutoModelForCausalLM._model_mapping[type(config)]
    return str(cls.__name__)


def hf_tokenizer(gf: GgufFile) -> tuple[Any, list[str]]:
    """transformers' GGUF tokenizer conversion as AutoTokenizer.from_pretrained(gguf_file=)
    runs it (GGUF_TOKENIZER_MAPPING sections, convert_gguf_tokenizer, the file's
    add_space_prefix passed on), from the parsed metadata; then the file's special token ids,
    which the converter overrides by its own rules (SmolLM2: eos = bos, no pad). Returns the
    tokenizer and one note per special token changed."""
    from quantize.model.source import tokenizer_from_metadata

    tok = tokenizer_from_metadata(gf.metadata, hf_model_type(gf.arch))
    notes = []
    for attr, key in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding"),
                      ("unk_token", "unknown")):
        want = gf.metadata.get(f"tokenizer.ggml.{key}_token_id")
        if want is None or getattr(tok, f"{attr}_id") == int(want):
            continue
        token = tok.convert_ids_to_tokens(int(want))
        notes.append(f"tokenizer {attr} set to {token!r} (id {want}) from the GGUF, was "
                     f"{getattr(tok, attr)!r}")
        setattr(tok, attr, token)
    return tok, notes


def _write_tokenizer(gf: GgufFile, work: Path) -> list[str]:
    """Saved as transformers 5 saves any tokenizer: tokenizer.json, tokenizer_config.json,
    chat_template.jinja."""
    tok, notes = hf_tokenizer(gf)
    tok.save_pretrained(work)
    return notes


def _write_generation_config(config: Any, work: Path) -> None:
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(work)


def _write_weights(plan: list[tuple[GgufTensor, str]], work: Path, dtype: str, shard_bytes: int,
                   permute: bool, heads: tuple[int, int], out: Produced) -> list[str]:
    import torch

    st_dtype, itemsize = _DTYPES[dtype]
    entries = [(hf, list(t.shape)) for t, hf in plan]
    shards = _plan_shards([(hf, shape, int(np.prod(shape)) * itemsize) for hf, shape in entries],
                          shard_bytes)
    names = ([f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
             if len(shards) > 1 else ["model.safetensors"])
    index: dict[str, str] = {}
    by_name = {hf: t for t, hf in plan}
    total = 0
    for fname, shard in zip(names, shards, strict=True):
        with _StreamingSafetensors(work / fname, shard, st_dtype) as writer:
            for hf, _shape, nbytes in shard:
                t = by_name[hf]
                w = gguf_dequantize(t)
                hq = qk_heads(t.name, *heads) if permute else None
                if hq is not None:
                    w = unpermute_qk(w, *hq)
                # dequantize returns a read-only view of the map for F32 tensors: copy those
                ref = torch.from_numpy(w if w.flags.writeable else w.copy())
                cast = ref.to(getattr(torch, dtype))
                writer.write(hf, cast)
                out.checks.append(tensor_check(t.name, hf, ref, cast))
                index[hf] = fname
                total += nbytes
                del w, ref, cast
    if len(names) > 1:
        (work / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": index}, indent=2) + "\n")
        names.append("model.safetensors.index.json")
    return names


def _plan_shards(sizes: list[tuple[str, list[int], int]],
                 bound: int) -> list[list[tuple[str, list[int], int]]]:
    shards: list[list[tuple[str, list[int], int]]] = [[]]
    used = 0
    for entry in sizes:
        if shards[-1] and used + entry[2] > bound:
            shards.append([])
            used = 0
        shards[-1].append(entry)
        used += entry[2]
    return shards


class _StreamingSafetensors:
    """A safetensors file written tensor by tensor: names, shapes and byte offsets are known
    from the GGUF's tensor table before any value is computed, so the header goes first and
    no shard is ever held in memory. safetensors' own save_file takes every tensor of the
    file at once, hence this writer of its (simple, documented) format."""

    def __init__(self, path: Path, shard: list[tuple[str, list[int], int]],
                 st_dtype: str) -> None:
        self.path = path
        self.order = [name for name, _, _ in shard]
        self.sizes = {name: nbytes for name, _, nbytes in shard}
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, nbytes in shard:
            header[name] = {"dtype": st_dtype, "shape": shape,
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        self.header = raw + b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self.fh: BinaryIO | None = None
        self.written = 0

    def __enter__(self) -> _StreamingSafetensors:
        self.fh = open(self.path, "wb")
        self.fh.write(len(self.header).to_bytes(8, "little"))
        self.fh.write(self.header)
        return self

    def write(self, name: str, tensor: Any) -> None:
        """Write the next tensor, in the order the header lists them."""
        import torch

        assert self.fh is not None
        if name != self.order[self.written]:
            raise AssertionError(f"tensor {name} written out of order")
        data = tensor.contiguous().view(-1).view(torch.uint8).numpy()
        if data.nbytes != self.sizes[name]:
            raise AssertionError(f"{name}: {data.nbytes} bytes, planned {self.sizes[name]}")
        self.fh.write(memoryview(data))
        self.written += 1

    def __exit__(self, *exc: object) -> None:
        assert self.fh is not None
        self.fh.close()
        if exc[0] is None and self.written != len(self.order):
            raise AssertionError(f"{self.path.name}: {self.written} of {len(self.order)} "
                                 "tensors written")
