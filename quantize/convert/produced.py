"""What one converter hands back to the convert runner: the files it wrote into its work
folder, the source tensors it read, and the per-tensor round-trip numbers. The runner turns
this into the preservation report (quantize.convert.preserve) and refuses a lossy result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# the config keys a model's rope facts (ModelFacts.rope) are read from, on either side:
# quantize.convert.preserve.facts_hf and quantize.convert.gguf_facts.facts_gguf
ROPE_CONFIG_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
                    "max_position_embeddings", "original_max_position_embeddings")


@dataclass(frozen=True)
class TensorCheck:
    """One output tensor against the source tensor(s) it was made from, both dequantized to
    float32: the largest absolute difference and the cosine similarity of the flattened
    values (1.0 for an exact copy). `source` and `target` are the names in each format."""

    source: str
    target: str
    max_abs: float
    cosine: float


@dataclass
class Produced:
    """`files`: paths relative to the work folder; `source_names`: every tensor name the
    source holds (read from headers, not guessed); `mapped`: source name -> output name for
    each tensor carried over (scale/zero tensors folded into their weight map to it too);
    `dropped`: source name -> why it has no output (the runner fails on any entry unless the
    reason is an expected one it knows, e.g. a tied lm_head); `notes`: one-line facts for
    the report (e.g. "q/k rows un-permuted from GGUF's rope layout")."""

    files: list[str] = field(default_factory=list)
    source_names: set[str] = field(default_factory=set)
    mapped: dict[str, str] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    checks: list[TensorCheck] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class ModelFacts:
    """What a conversion must preserve, read from one side (an HF folder or a GGUF file),
    in HF terms so the two sides compare field by field (quantize.convert.preserve):
    `tensor_names` in HF naming (a GGUF reader maps its names; quantization side tensors
    such as scales are left out, so the set means "the model's weights");
    `tied_embeddings`: the output head shares the embedding (no separate lm_head stored);
    `rope`: rope_theta and the scaling/rope_parameters dict as found (YaRN/LongRoPE factors
    included); `chat_template`; `special_tokens`: bos/eos/pad/unk ids; `generation`: the
    generation config's fields; `mtp_layers`: multi-token-prediction / nextn layers present,
    from the config key or inferred from the tensor names when the config lacks it."""

    tensor_names: set[str] = field(default_factory=set)
    tied_embeddings: bool = False
    rope: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None
    special_tokens: dict[str, int | None] = field(default_factory=dict)
    vocab_size: int | None = None
    generation: dict[str, Any] = field(default_factory=dict)
    mtp_layers: int = 0
