"""What loading a compressed-tensors MoE export on the linearized model (one Linear per expert
projection, quantize.model.moe.load_linearized) and our own decode of it
(quantize.model.decode) need: the stored names in the model's own terms, and compressed-tensors'
dynamic per-token activation quantization made per token on every input shape (an expert's
[tokens, hidden] rows, DeepSeek MLA's [batch, 1, seq, rank] latent).

Checkpoint names are not always the model's: transformers 5 renames some keys on load and back
on save (its checkpoint conversion mapping; Mixtral's `block_sparse_moe.` is `mlp.` in memory,
transformers/conversion_mapping.py "mixtral"), and compressed-tensors writes the ignore list in
checkpoint names (compressed_tensors/quantization/quant_config.py `_map_to_checkpoint_names`).
An export of Mixtral therefore stores `model.layers.0.block_sparse_moe.experts.0.gate_proj.*`,
which is what vLLM reads (vllm/model_executor/models/mixtral.py: the module is
`block_sparse_moe`, and `hf_to_vllm_mapper` maps `.gate_proj.`/`.up_proj.`/`.down_proj.` to
its `w1`/`w3`/`w2`), while the linearized model in memory names it `model.layers.0.mlp...`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantize.model.config import ModelConfig

if TYPE_CHECKING:
    import torch

# Mixtral's native per-expert names (its source checkpoints): transformers merges w1 and w3
# into gate_up_proj, gate first, and w2 into down_proj (conversion_mapping.py "mixtral")
_EXPERT_ALIASES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_ALIASED = re.compile(r"\.experts\.(\d+)\.(w1|w2|w3)\.")


def model_namer(model: Any) -> Callable[[str], str]:
    """A checkpoint key -> the name `model` (a transformers model, fused or linearized) gives
    it: transformers' own renamings for the architecture, applied as its loader applies them
    (transformers/core_model_loading.py `rename_source_key`), then Mixtral's native expert
    names. The mapping's WeightConverters are left out: they fuse per-expert tensors into 3-D
    ones, which the linearized model keeps per expert."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    renamings = [t for t in get_model_conversion_mapping(model, add_legacy=False)
                 if isinstance(t, WeightRenaming)]

    def name(key: str) -> str:
        key = rename_source_key(key, renamings, [])[0] if renamings else key
        return _ALIASED.sub(lambda m: f".experts.{m[1]}.{_EXPERT_ALIASES[m[2]]}.", key)

    return name


def stored_tensors(ckpt: Path, name: Callable[[str], str]) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors shards, by the model's names."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            out.update({name(k): fh.get_tensor(k) for k in fh.keys()})  # noqa: SIM118
    return out


def in_model_terms(config: ModelConfig, name: Callable[[str], str]) -> ModelConfig:
    """The config with its quantization ignore list in the model's names (compressed-tensors
    wrote it in checkpoint names), so that it matches the modules it names."""
    qc = config.quantization_config
    if not qc or not qc.get("ignore"):
        return config
    return config.updated(quantization_config={**qc,
                                               "ignore": [name(n) for n in qc["ignore"]]})


def per_token_inputs(model: Any) -> int:
    """Make compressed-tensors' dynamic per-token activation quantization per token whatever
    the input's shape. Its TOKEN strategy keeps dims 0 and 1 and reduces the rest
    (compressed_tensors/quantization/utils/helpers.py `compute_dynamic_scales_and_zp`): per
    token on a [batch, seq, hidden] input, but one scale for all the [tokens, hidden] rows an
    expert gets (nothing left to reduce: `torch.aminmax` over the tensor), and one per
    sequence on DeepSeek MLA's [batch, 1, seq, rank] latent (kv_b_proj). vLLM quantizes each
    token row on its own (fused_moe/utils.py `_fp8_quantize`, use_per_token_if_dynamic), and
    so does our decode. Such a module's input is given the [1, tokens, hidden] shape;
    compressed-tensors still computes the scales. Returns the number of modules wrapped."""
    from compressed_tensors.quantization import QuantizationStrategy

    n = 0
    for mod in model.modules():
        scheme = getattr(mod, "quantization_scheme", None)
        acts = getattr(scheme, "input_activations", None)
        if acts is None or not acts.dynamic or acts.strategy != QuantizationStrategy.TOKEN:
            continue
        mod.forward = _token_rows(mod.forward)
        n += 1
    return n


def _token_rows(forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def run(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if x.ndim == 3:
            return forward(x, *args, **kwargs)
        y = forward(x.reshape(1, -1, x.shape[-1]), *args, **kwargs)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    return run
