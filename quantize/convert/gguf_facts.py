"""What a GGUF file holds that a conversion must preserve, in HF terms, so that
quantize.convert.preserve compares it field by field with an HF folder's facts (facts_hf).
Each field is derived the way gguf_to_hf writes it, so a faithful GGUF -> HF conversion
compares equal, and the HF -> GGUF direction is checked against what llama.cpp will read."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from quantize.convert.gguf_in import hf_config
from quantize.convert.gguf_names import NameTable, hf_model_type, read_gguf
from quantize.convert.produced import ROPE_CONFIG_KEYS, ModelFacts

_SPECIAL = {"bos_token_id": "bos", "eos_token_id": "eos", "pad_token_id": "padding",
            "unk_token_id": "unknown"}
_NEXTN = re.compile(r"^blk\.(\d+)\.nextn\.")


def facts_gguf(path: Path) -> ModelFacts:
    """The facts of the GGUF file `path`, from its metadata and tensor table (no tensor data
    is read)."""
    gf = read_gguf(path)
    hf_model_type(gf.arch, path)
    config = hf_config(gf)
    table = NameTable.for_config(config)
    # names with no HF weight stay in GGUF terms, so a comparison shows them as lost
    names = {table.to_hf.get(t.name, t.name) for t in gf.tensors}
    cfg = config.to_dict()
    special = {k: _int(gf.metadata.get(f"tokenizer.ggml.{v}_token_id"))
               for k, v in _SPECIAL.items()}
    generation = {k: special[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if special[k] is not None}
    nextn = {int(m.group(1)) for t in gf.tensors if (m := _NEXTN.match(t.name))}
    declared = int(gf.metadata.get(f"{gf.arch}.nextn_predict_layers", 0) or 0)
    template = gf.metadata.get("tokenizer.chat_template")
    return ModelFacts(tensor_names=names,
                      tied_embeddings=all(t.name != "output.weight" for t in gf.tensors),
                      rope={k: cfg[k] for k in ROPE_CONFIG_KEYS if k in cfg},
                      chat_template=template if isinstance(template, str) else None,
                      special_tokens=special, vocab_size=config.vocab_size,
                      generation=generation, mtp_layers=max(declared, len(nextn)))


def _int(value: Any) -> int | None:
    return None if value is None else int(value)
