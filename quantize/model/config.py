"""The one reader of a model's config.json: the file, its dtype and its shape.

Every module that needs a fact of config.json asks here: `read_config` opens the file (the
only place that does) as a typed `ModelConfig`, `config_dtype` names its dtype, `dtype_bytes` /
`serving_dtype_bytes` answer the two different byte questions (what the checkpoint stores,
what vLLM serves), and `model_shape` reads the architecture (GQA/MQA/MLA, sliding windows,
MoE) through transformers' own config class, so defaults and multimodal `text_config`s are
resolved as transformers resolves them.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from quantize.errors import ModelError

CONFIG = "config.json"
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
                "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}
_SERVED = ("bfloat16", "float16", "float32")


class ModelConfig(BaseModel):
    """config.json as a typed view. Every key is kept exactly as written (extra="allow";
    nothing is coerced or refused here, so `to_json` gives back what was read and a config
    with a mistyped field still reaches the check that names it, e.g. transformers'); the
    properties are the fields this project reads, typed: a value of another JSON type reads
    as absent."""

    model_config = ConfigDict(extra="allow", frozen=True)

    def _get(self, key: str) -> Any:
        return (self.model_extra or {}).get(key)

    def _int(self, key: str) -> int | None:
        value = self._get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def _str(self, key: str) -> str | None:
        value = self._get(key)
        return value if isinstance(value, str) else None

    def has(self, key: str) -> bool:
        return key in (self.model_extra or {})

    @property
    def model_type(self) -> str | None:
        return self._str("model_type")

    @property
    def architectures(self) -> list[str]:
        """The model classes config.json names (vLLM picks its class from them)."""
        value = self._get("architectures")
        return [str(a) for a in value] if isinstance(value, list) else []

    @property
    def remote_code(self) -> bool:
        """Whether the config names classes from the model repo's own code (`auto_map`)."""
        return bool(self._get("auto_map"))

    @property
    def declared_dtype(self) -> str | None:
        """`dtype` (transformers 5) or `torch_dtype` (older), without a `torch.` prefix."""
        value = self._get("dtype") or self._get("torch_dtype")
        return str(value).removeprefix("torch.") if value else None

    @property
    def hidden_size(self) -> int | None:
        return self._int("hidden_size")

    @property
    def num_hidden_layers(self) -> int | None:
        return self._int("num_hidden_layers")

    @property
    def num_attention_heads(self) -> int | None:
        return self._int("num_attention_heads")

    @property
    def num_key_value_heads(self) -> int | None:
        return self._int("num_key_value_heads")

    @property
    def head_dim(self) -> int | None:
        return self._int("head_dim")

    @property
    def max_position_embeddings(self) -> int | None:
        return self._int("max_position_embeddings")

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self._get("tie_word_embeddings"))

    @property
    def hidden_act(self) -> str | None:
        return self._str("hidden_act")

    @property
    def topk_method(self) -> str | None:  # DeepSeek routing
        return self._str("topk_method")

    @property
    def n_group(self) -> int | None:
        return self._int("n_group")

    @property
    def text(self) -> ModelConfig:
        """The language model's config (`text_config` of multimodal models, else itself)."""
        value = self._get("text_config")
        return ModelConfig.model_validate(value) if isinstance(value, dict) and value else self

    @property
    def quantization_config(self) -> dict[str, Any] | None:
        """The checkpoint's quantization block: open third-party JSON (compressed-tensors,
        GPTQ, AWQ, fp8), parsed and written only by quantize.model.qconfig."""
        value = self._get("quantization_config")
        return value if isinstance(value, dict) else None

    def to_json(self) -> dict[str, Any]:
        """The config.json object as read (or as built), for json.dumps and transformers."""
        return self.model_dump()

    def architecture(self) -> dict[str, Any]:
        """The config as the unquantized architecture (for building a meta model)."""
        return self.model_dump(exclude={"quantization_config"})

    def without(self, *keys: str) -> ModelConfig:
        """The same config without `keys` (absent, not null)."""
        return ModelConfig.model_validate(self.model_dump(exclude=set(keys)))

    def updated(self, **values: Any) -> ModelConfig:
        """The same config with `values` set (an export's dtype and quantization block)."""
        return ModelConfig.model_validate(self.to_json() | values)

    def cache_key(self) -> str:
        """A stable text of the whole config (a cache key for built configs and models)."""
        return json.dumps(self.to_json(), sort_keys=True)

    @classmethod
    def from_json_text(cls, text: str) -> ModelConfig:
        return cls.model_validate(json.loads(text))


def config_path(folder: Path) -> Path:
    return folder / CONFIG


def read_config(folder: Path) -> ModelConfig:
    """config.json of a model or checkpoint folder, typed; ModelError (its fields: problem,
    hint, path) when the file is missing or not a JSON object."""
    path = folder / CONFIG
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(problem=f"has no {CONFIG}", path=folder, path_sep=" ",
                         hint="point at the folder that holds config.json and the "
                              "weights") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(problem=f"config.json is not valid JSON ({exc})", path=path,
                         hint="fix or re-download it") from None
    if not isinstance(data, dict):
        raise ModelError(problem="expected a JSON object", path=path)
    return ModelConfig.model_validate(data)


def write_config(folder: Path, config: ModelConfig) -> None:
    """config.json written atomically (exports and converted models)."""
    from quantize.run.files import atomic_write_text

    atomic_write_text(folder / CONFIG,
                      json.dumps(config.to_json(), indent=2, sort_keys=True) + "\n")


def config_dtype(config: ModelConfig) -> str | None:
    """The checkpoint's dtype name (`bfloat16`, `float16`, ...): transformers 5 writes
    `dtype`, older versions `torch_dtype`; None when the config names none."""
    return config.declared_dtype


def dtype_bytes(name: str | None) -> int | None:
    """Bytes per element of a dtype name; None for an unknown name."""
    return _DTYPE_BYTES.get(str(name).removeprefix("torch.")) if name else None


def weight_bytes(config: ModelConfig) -> int:
    """Bytes per weight as the checkpoint stores them (fp32 checkpoints stay fp32; bf16 when
    the config names no dtype): what loading it for calibration costs."""
    return 4 if (config_dtype(config) or "bfloat16") in ("float32", "float") else 2


def serving_dtype_bytes(config: ModelConfig) -> int:
    """Bytes per unquantized weight and KV element in vLLM: dtype=auto serves bf16/fp16
    checkpoints as they are and fp32 ones (e.g. gemma-2) in 16 bits, so always 2; a dtype
    that is not a float checkpoint dtype is refused."""
    name = config_dtype(config) or "bfloat16"
    if name not in _SERVED:
        raise ModelError(problem=f"config.json dtype {name!r} is not bfloat16/float16/float32",
                         hint="plan from the unquantized model's config")
    return 2


def torch_dtype(config: ModelConfig, *, allow_fp32: bool = False) -> Any:
    """The torch dtype to load the checkpoint in: its own 16-bit dtype, bf16 when it names
    none (or fp32, unless `allow_fp32`)."""
    import torch

    allowed = (torch.float16, torch.bfloat16) + ((torch.float32,) if allow_fp32 else ())
    dtype = getattr(torch, config_dtype(config) or "bfloat16", None)
    return dtype if dtype in allowed else torch.bfloat16


# --- the architecture -----------------------------------------------------------------------
def hf_config(config: ModelConfig) -> Any:
    """transformers' config object for this config.json (no weights, no remote code)."""
    return _hf_config(config.cache_key())


@functools.lru_cache(maxsize=16)
def _hf_config(config_json: str) -> Any:
    return build_hf_config(ModelConfig.from_json_text(config_json))


def build_hf_config(config: ModelConfig) -> Any:
    """A new transformers config object for the unquantized architecture of `config` (the
    meta model builder gets its own: building a model may set attributes on it)."""
    from transformers import AutoConfig

    fields = config.architecture()
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


@dataclass(frozen=True)
class Shape:
    """What the memory models (planner, card, resource check) need from config.json."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_position: int | None
    dtype_bytes: int
    layer_kinds: tuple[str, ...]  # "full" | "sliding" per decoder layer
    sliding_window: int | None
    mla_latent: int  # kv_lora_rank + qk_rope_head_dim; 0 when not MLA
    experts: int
    experts_per_token: int
    moe_intermediate: int
    shared_intermediate: int
    dense_mlp_layers: int  # MoE models whose first layers keep a dense MLP (DeepSeek)

    @property
    def attention(self) -> str:
        if self.mla_latent:
            return "MLA"
        if self.kv_heads == self.heads:
            return "MHA"
        return "MQA" if self.kv_heads == 1 else "GQA"

    def kv_heads_per_rank(self, tp: int) -> int:
        # vLLM splits KV heads over ranks and replicates them when there are fewer than ranks
        return max(1, self.kv_heads // tp)


def model_shape(config: ModelConfig, hf: Any = None) -> Shape:
    """The architecture of `config` (`hf`: its transformers config when already built)."""
    c = hf if hf is not None else hf_config(config)
    text = getattr(c, "text_config", None) or c
    hidden = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    layers = int(text.num_hidden_layers)
    window = getattr(text, "sliding_window", None)
    kinds = _layer_kinds(text, layers, window)
    mla = 0
    if getattr(text, "kv_lora_rank", None):
        mla = int(text.kv_lora_rank) + int(getattr(text, "qk_rope_head_dim", 0) or 0)
    experts = int(getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
                  or getattr(text, "n_routed_experts", None) or 0)
    moe_inter = int(getattr(text, "moe_intermediate_size", None) or
                    (text.intermediate_size if experts else 0) or 0)
    shared = int(getattr(text, "shared_expert_intermediate_size", None) or 0)
    if not shared and getattr(text, "n_shared_experts", None):
        shared = int(text.n_shared_experts) * moe_inter
    return Shape(
        model_type=config.model_type or "", hidden=hidden,
        intermediate=int(getattr(text, "intermediate_size", 0) or 0), layers=layers, heads=heads,
        kv_heads=kv, head_dim=head_dim, vocab=int(text.vocab_size),
        max_position=getattr(text, "max_position_embeddings", None),
        dtype_bytes=serving_dtype_bytes(config), layer_kinds=kinds,
        sliding_window=int(window) if window and "sliding" in kinds else None,
        mla_latent=mla, experts=experts,
        experts_per_token=int(getattr(text, "num_experts_per_tok", 0) or 0),
        moe_intermediate=moe_inter if experts else 0, shared_intermediate=shared,
        dense_mlp_layers=int(getattr(text, "first_k_dense_replace", 0) or 0)
        + len(getattr(text, "mlp_only_layers", None) or []))


def _layer_kinds(c: Any, layers: int, window: Any) -> tuple[str, ...]:
    types = getattr(c, "layer_types", None)
    if types:
        return tuple("sliding" if "sliding" in str(t) else "full" for t in types[:layers])
    if window and getattr(c, "use_sliding_window", True) is not False:
        return ("sliding",) * layers  # e.g. Mistral-7B-v0.1: every layer has the window
    return ("full",) * layers


def kv_dims(config: ModelConfig) -> tuple[int, int, int] | None:
    """(layers, KV heads, head dim) from the raw config (no transformers), for configs
    transformers cannot build (remote-code architectures); None if it lacks the sizes."""
    text = config.text
    dim = head_dim(config)
    kv_heads = text.num_key_value_heads or text.num_attention_heads
    if text.num_hidden_layers is None or kv_heads is None or dim is None:
        return None
    return text.num_hidden_layers, kv_heads, dim


def head_dim(config: ModelConfig) -> int | None:
    """The attention head size from the raw config (no transformers): for checks that must
    work on any checkpoint's config."""
    text = config.text
    if text.head_dim:
        return text.head_dim
    if text.hidden_size and text.num_attention_heads:
        return text.hidden_size // text.num_attention_heads
    return None
