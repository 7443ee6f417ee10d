"""What a conversion must not lose, checked field by field between the source and the
output: tensor-name sets (quantization side tensors folded into their weight; MTP / nextn
layers counted from the weights too), tied embeddings (no lm_head added, none lost), rope
parameters (YaRN / LongRoPE factors included), tokenizer files, chat template, generation
config and special-token ids. Any loss makes the conversion fail (quantize.convert.run)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantize.convert.produced import ROPE_CONFIG_KEYS, ModelFacts, Produced
from quantize.errors import NotImplementedFeature
from quantize.model.formats import SIDE_SUFFIXES, folder_tensors, mtp_layer_names

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
_SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
# why a source tensor may have no output and nothing is lost
EXPECTED_DROPS = ("tied", "activation / KV-cache scale")


@dataclass(frozen=True)
class PreservationRow:
    """One preservation check: what, whether it held, and the difference if not."""

    check: str
    ok: bool
    detail: str


def weight_name(name: str) -> str | None:
    """A tensor's weight name in HF terms: packed / native weights map to `.weight`, other
    quantization side tensors to None (they are not weights of the model)."""
    module, _, param = name.rpartition(".")
    if param in ("qweight", "weight_packed"):
        return f"{module}.weight"
    if param in SIDE_SUFFIXES:
        return None
    return name


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def chat_template(folder: Path) -> str | None:
    """The chat template wherever transformers keeps it (a .jinja file, chat_template.json,
    or tokenizer_config.json)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    tmpl = _json(folder / "chat_template.json").get("chat_template")
    if tmpl is None:
        tmpl = _json(folder / "tokenizer_config.json").get("chat_template")
    return tmpl if isinstance(tmpl, str) or tmpl is None else json.dumps(tmpl, sort_keys=True)


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    sub = cfg.get("text_config")
    return {**sub, **{k: v for k, v in cfg.items() if k in ROPE_CONFIG_KEYS}} if \
        isinstance(sub, dict) else cfg


_NOT_MODEL_FACTS = ("transformers_version", "_from_model_config", "use_cache",
                    "output_attentions", "output_hidden_states", "return_dict_in_generate")


def _generation(fields: dict[str, Any]) -> dict[str, Any]:
    """The generation config's information: bookkeeping keys, runtime output flags
    (`use_cache`, `output_attentions`, ...) and values equal to transformers' own defaults
    (what a loader gets anyway) are not something a conversion can lose, so they are left
    out of the comparison."""
    from transformers import GenerationConfig

    default = GenerationConfig().to_dict()
    return {k: v for k, v in fields.items()
            if k not in _NOT_MODEL_FACTS
            and not (k in default and default[k] == v)}


def facts_hf(folder: Path) -> ModelFacts:
    """An HF safetensors folder's facts, from config.json, the headers and tokenizer files."""
    cfg = _json(folder / "config.json")
    text = _text_config(cfg)
    names = {w for n in folder_tensors(folder) if (w := weight_name(n)) is not None}
    layers = text.get("num_hidden_layers")
    mtp_names = mtp_layer_names(names, layers if isinstance(layers, int) else None)
    mtp_idx = {n.split(".layers.")[1].split(".")[0] for n in mtp_names if ".layers." in n}
    inferred = len(mtp_idx) or (1 if mtp_names else 0)
    configured = text.get("num_nextn_predict_layers") or text.get("mtp_num_layers") or 0
    tie = text.get("tie_word_embeddings", cfg.get("tie_word_embeddings"))
    tied = bool(tie) if tie is not None else "lm_head.weight" not in names
    gen = _generation(_json(folder / "generation_config.json"))
    special = {k: text.get(k, cfg.get(k)) for k in _SPECIAL}
    vocab = text.get("vocab_size")
    return ModelFacts(tensor_names=names, tied_embeddings=tied,
                      rope={k: text[k] for k in ROPE_CONFIG_KEYS if k in text},
                      chat_template=chat_template(folder), special_tokens=special,
                      vocab_size=vocab if isinstance(vocab, int) else None,
                      generation=gen, mtp_layers=max(int(configured), inferred))


def facts_of(path: Path) -> ModelFacts:
    """Facts of either side: an HF folder here, a GGUF file through helper module
    quantize.convert.gguf_facts."""
    if path.is_file() and path.suffix == ".gguf":
        try:
            from quantize.convert.gguf_facts import facts_gguf
        except ImportError:
            raise NotImplementedFeature(problem="preservation facts of a GGUF file are not "
                                        "built yet", path=path,
                                        hint="quantize.convert.gguf_facts is missing") from None
        return facts_gguf(path)
    return facts_hf(path)


def _diff(a: Any, b: Any) -> str:
    return "same" if a == b else f"{_short(a)} -> {_short(b)}"


def _short(v: Any) -> str:
    s = json.dumps(v, sort_keys=True, default=str) if not isinstance(v, str) else repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def compare(src: ModelFacts, out: ModelFacts, produced: Produced | None = None,
            src_folder: Path | None = None, out_folder: Path | None = None
            ) -> list[PreservationRow]:
    """Every preservation row; `produced.dropped` entries with an expected reason are not
    counted as lost."""
    expected = {n for n, why in (produced.dropped if produced else {}).items()
                if any(why.startswith(e) for e in EXPECTED_DROPS)}
    expected_w = {w for n in expected if (w := weight_name(n)) is not None}
    lost = sorted(src.tensor_names - out.tensor_names - expected_w)
    added = sorted(out.tensor_names - src.tensor_names)
    rows = [PreservationRow("tensor names", not lost and not added,
                f"{len(src.tensor_names)} in, {len(out.tensor_names)} out" +
                (f"; lost {len(lost)} (first {lost[0]})" if lost else "") +
                (f"; added {len(added)} (first {added[0]})" if added else ""))]
    rows.append(PreservationRow("mtp/nextn layers", src.mtp_layers == out.mtp_layers,
                    f"{src.mtp_layers} -> {out.mtp_layers}"))
    dup = out.tied_embeddings and "lm_head.weight" in out.tensor_names
    tied_ok = src.tied_embeddings == out.tied_embeddings and not dup
    rows.append(PreservationRow("tied embeddings", tied_ok,
                    _diff(src.tied_embeddings, out.tied_embeddings) +
                    ("; a separate lm_head.weight was written" if dup else "")))
    rows.append(PreservationRow("rope parameters", src.rope == out.rope, _diff(src.rope, out.rope)))
    rows.append(PreservationRow("chat template", src.chat_template == out.chat_template,
                    "none" if src.chat_template is None and out.chat_template is None else
                    _diff(src.chat_template, out.chat_template)))
    rows.append(PreservationRow("generation config", src.generation == out.generation,
                    _diff(src.generation, out.generation)))
    rows.append(PreservationRow("special tokens", src.special_tokens == out.special_tokens,
                    _diff(src.special_tokens, out.special_tokens)))
    rows.append(PreservationRow("vocab size", src.vocab_size == out.vocab_size,
                    _diff(src.vocab_size, out.vocab_size)))
    if src_folder is not None and out_folder is not None and src_folder.is_dir() and \
            out_folder.is_dir():
        want = {f for f in TOKENIZER_FILES if (src_folder / f).is_file()}
        have = {f for f in want if (out_folder / f).is_file()}
        rows.append(PreservationRow("tokenizer files", want == have,
                        ", ".join(sorted(want)) or "none in the source" if want == have else
                        f"missing {sorted(want - have)}"))
    return rows


def lost(rows: list[PreservationRow]) -> list[PreservationRow]:
    return [r for r in rows if not r.ok]
