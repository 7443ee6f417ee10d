"""quantize.model.moe_load: checkpoint names in the model's terms (transformers 5.17 renames
Mixtral's `block_sparse_moe.` to `mlp.` on load), and compressed-tensors' dynamic per-token
activation quantization made per token on an expert's 2-D input."""

from __future__ import annotations

from typing import Any

import pytest
from fixtures.moe import CONFIGS

from quantize.model import moe_load
from quantize.model.config import ModelConfig


class _Tok:
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 2

    def __len__(self) -> int:
        return 512


def _meta_model(arch: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(CONFIGS[arch](_Tok()))


@pytest.mark.parametrize(("arch", "stored", "in_model"), [
    # an export (llm-compressor's per-expert Linears, saved back in checkpoint names)
    ("mixtral", "model.layers.0.block_sparse_moe.experts.3.gate_proj.weight_packed",
     "model.layers.0.mlp.experts.3.gate_proj.weight_packed"),
    ("mixtral", "model.layers.1.block_sparse_moe.gate.weight", "model.layers.1.mlp.gate.weight"),
    # Mixtral's own source checkpoints: w1 / w3 / w2 (gate, up, down)
    ("mixtral", "model.layers.0.block_sparse_moe.experts.7.w1.weight",
     "model.layers.0.mlp.experts.7.gate_proj.weight"),
    ("mixtral", "model.layers.0.block_sparse_moe.experts.7.w3.weight",
     "model.layers.0.mlp.experts.7.up_proj.weight"),
    ("mixtral", "model.layers.0.block_sparse_moe.experts.7.w2.weight",
     "model.layers.0.mlp.experts.7.down_proj.weight"),
    ("mixtral", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"),
    # architectures whose checkpoint names are the model's: unchanged (the expert-fusing
    # converters are not applied)
    ("qwen3_moe", "model.layers.0.mlp.experts.0.gate_proj.weight",
     "model.layers.0.mlp.experts.0.gate_proj.weight"),
    ("gpt_oss", "model.layers.0.mlp.experts.gate_up_proj",
     "model.layers.0.mlp.experts.gate_up_proj"),
])
def test_model_namer_gives_the_models_names(arch: str, stored: str, in_model: str) -> None:
    assert moe_load.model_namer(_meta_model(arch))(stored) == in_model


def test_the_ignore_list_is_read_in_the_models_names() -> None:
    cfg = CONFIGS["mixtral"](_Tok()).to_dict()
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "ignore": [
        "lm_head", "model.layers.0.block_sparse_moe.gate"], "config_groups": {}}
    out = moe_load.in_model_terms(ModelConfig.model_validate(cfg),
                                  moe_load.model_namer(_meta_model("mixtral")))
    assert out.quantization_config is not None
    assert out.quantization_config["ignore"] == ["lm_head", "model.layers.0.mlp.gate"]


def test_per_token_activation_quantization_is_per_token_on_2d_inputs() -> None:
    """compressed-tensors' TOKEN strategy reduces nothing on a [tokens, hidden] input (one scale
    for all rows); wrapped, each row gets its own scale, as on a [batch, seq, hidden] input."""
    import torch
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationScheme,
        QuantizationStatus,
    )
    from compressed_tensors.quantization.lifecycle.initialize import (
        initialize_module_for_quantization,
    )

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 8, bias=False)
    scheme = QuantizationScheme(targets=["Linear"], input_activations=QuantizationArgs(
        num_bits=8, type="int", strategy="token", dynamic=True, symmetric=True))
    initialize_module_for_quantization(lin, scheme)
    lin.quantization_status = QuantizationStatus.FROZEN
    x = torch.randn(5, 64)
    x[0] *= 50  # one loud token: under one shared scale the others lose their precision
    with torch.no_grad():
        batched = lin(x.unsqueeze(0)).squeeze(0)  # [1, tokens, hidden]: per token
        shared = lin(x)
        assert not torch.equal(shared, batched)
        assert moe_load.per_token_inputs(lin) == 1
        assert torch.equal(lin(x), batched)
        assert torch.equal(lin(x.unsqueeze(0)).squeeze(0), batched)  # 3-D inputs as before
        # DeepSeek MLA's kv_b_proj input [batch, 1, seq, rank]: per token, not per sequence
        assert torch.equal(lin(x.reshape(1, 1, 5, 64)).reshape(5, 8), batched)
