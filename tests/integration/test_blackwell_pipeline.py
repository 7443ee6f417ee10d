"""The Blackwell recipes end to end on tiny random Llamas (real llm-compressor, real
compressed-tensors), and the exact decode fallback on each export: our decode of the stored
FP4/FP8 codes and scales against compressed-tensors' decompression, bit for bit, and the
logits of both models over real text."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures import export_runs
from fixtures.export_runs import export_config, export_run

from quantize.model.config import ModelConfig
from quantize.recipe.recipe import load_recipe
from quantize.stages.verify import DecodeTolerance, verify_decode

small_calibration = export_runs.small_calibration  # the module fixture, shared


@pytest.fixture(scope="module")
def block_model(default_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama whose every Linear is a whole number of 128x128 blocks, including
    the fused q/k/v shards (head_dim 128): what vLLM needs for block FP8."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-block")
    tok = AutoTokenizer.from_pretrained(default_tokenizer)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=128, max_position_embeddings=1024, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, dtype=torch.float16)
    LlamaForCausalLM(cfg).to(torch.float16).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.parametrize("recipe", ["nvfp4", "nvfp4a16", "mxfp4", "mxfp4a16", "fp8-block"])
def test_recipe_exports_and_decodes_bit_for_bit(recipe: str, tiny_model: Path,
                                                block_model: Path, small_calibration: Path,
                                                tmp_path: Path) -> None:
    model = block_model if recipe == "fp8-block" else tiny_model
    export = export_run(recipe, model, small_calibration, tmp_path / "run") / "export"
    config, qc = export_config(export)
    fmt = {"NVFP4": "nvfp4-pack-quantized", "NVFP4A16": "nvfp4-pack-quantized",
           "MXFP4": "mxfp4-pack-quantized", "MXFP4A16": "mxfp4-pack-quantized",
           "FP8_BLOCK": "float-quantized"}[load_recipe(recipe).scheme]
    assert qc["format"] == fmt and qc["ignore"] == ["lm_head"]
    result = verify_decode(export, ModelConfig.model_validate(config), DecodeTolerance())
    m = result.metrics
    assert result.verdict == "pass", result.error
    assert m.layers_decoded == 14  # 7 Linear layers x 2 decoder layers
    assert m.worst_weight_rel_diff == 0.0  # bit for bit with compressed-tensors
    # our activation emulation (FP4 groups of 16/32, FP8 groups of 128) matches theirs too
    assert m.max_abs_dlogprob == 0.0
    assert m.source_cosine_min is not None and m.source_cosine_min >= 0.9
