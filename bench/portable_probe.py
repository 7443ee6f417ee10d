"""Portable 4-bit candidates for the default recipe (issue #46), on the default model in
memory, every layer at 4 bits, no online transform: GPTQ W4A16_ASYM with imatrix scales at
group 64 and 32, with and without R2 (a Hadamard on each attention head's value/output pair,
fused into v_proj and o_proj: exact, portable), and the same on a copy of the model whose
residual, MLP and head channels are permuted (an exact copy whose weights no longer line up
with the source GGUF's Q4_1 groups of 32: does group 32 gain only from that grid?).
Perplexity on the first 16,384 tokens of both shipped texts (bench/quip_probe.ppl).

    python -m bench.portable_probe bf16,g64,g32,r2+g64,perm-bf16,perm+g32 \
        --calibration runs/<run>/calibrate/calibration.safetensors > rows.jsonl
"""
import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from bench.quip_probe import ppl

# variant -> (group size, 0: not quantized; rotation)
VARIANTS: dict[str, tuple[int, str | None]] = {
    "bf16": (0, None), "r2-noquant": (0, "r2"), "g64": (64, None), "r2+g64": (64, "r2"),
    "g32": (32, None), "r2+g32": (32, "r2"), "perm-bf16": (0, None), "perm+g64": (64, None),
    "perm+g32": (32, None), "perm+r2+g32": (32, "r2")}


def r2(model: Any) -> None:
    """R2: v_proj's output and o_proj's input rotated by one Hadamard per head (exact)."""
    from compressed_tensors.transform.utils.hadamard import deterministic_hadamard_matrix

    cfg = model.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    h = deterministic_hadamard_matrix(hd, dtype=torch.float64) / math.sqrt(hd)
    for layer in model.model.layers:
        at = layer.self_attn
        wv = at.v_proj.weight.data.double()
        wv = torch.einsum("ij,hjk->hik", h, wv.view(wv.shape[0] // hd, hd, -1))
        at.v_proj.weight.data.copy_(wv.reshape(at.v_proj.weight.shape))
        wo = at.o_proj.weight.data.double()
        wo = torch.einsum("ohj,kj->ohk", wo.view(wo.shape[0], wo.shape[1] // hd, hd), h)
        at.o_proj.weight.data.copy_(wo.reshape(at.o_proj.weight.shape))


def permute(model: Any, seed: int = 0) -> None:
    """An exact copy whose weights no longer line up with the source's Q4_1 groups of 32 along
    the input dimension: residual, MLP and (within each head) value channels permuted."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    p = torch.randperm(cfg.hidden_size, generator=g)
    emb = model.model.embed_tokens.weight.data
    emb.copy_(emb[:, p])
    model.model.norm.weight.data.copy_(model.model.norm.weight.data[p])
    for layer in model.model.layers:
        for n in (layer.input_layernorm, layer.post_attention_layernorm):
            n.weight.data.copy_(n.weight.data[p])
        at, mlp = layer.self_attn, layer.mlp
        for lin in (at.q_proj, at.k_proj, at.v_proj, mlp.gate_proj, mlp.up_proj):
            lin.weight.data.copy_(lin.weight.data[:, p])
        for lin in (at.o_proj, mlp.down_proj):
            lin.weight.data.copy_(lin.weight.data[p, :])
        p2 = torch.randperm(mlp.gate_proj.weight.shape[0], generator=g)
        for lin in (mlp.gate_proj, mlp.up_proj):
            lin.weight.data.copy_(lin.weight.data[p2, :])
        mlp.down_proj.weight.data.copy_(mlp.down_proj.weight.data[:, p2])
        p3 = torch.randperm(hd, generator=g)
        wv, wo = at.v_proj.weight.data, at.o_proj.weight.data
        wv.copy_(wv.view(wv.shape[0] // hd, hd, -1)[:, p3, :].reshape(wv.shape))
        wo.copy_(wo.view(wo.shape[0], wo.shape[1] // hd, hd)[:, :, p3].reshape(wo.shape))


def run(model_path: Path, calibration: Path, name: str) -> dict[str, Any]:
    from datasets import Dataset
    from llmcompressor import oneshot
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantize.backends.llmcompressor import build_modifiers
    from quantize.recipe.recipe import load_recipe

    group, rot = VARIANTS[name]
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    t0 = time.perf_counter()
    if name.startswith("perm"):
        permute(model)
    if rot == "r2":
        r2(model)
    if group:
        cal = load_file(str(calibration))
        samples = [row[:n].tolist()
                   for row, n in zip(cal["input_ids"], cal["lengths"], strict=True)]
        ds = Dataset.from_dict({"input_ids": samples,
                                "attention_mask": [[1] * len(s) for s in samples]})
        oneshot(model=model, processor=tok, dataset=ds,
                recipe=build_modifiers(load_recipe("gptq-int4-asym"), group, model),
                num_calibration_samples=len(samples), max_seq_length=max(map(len, samples)),
                shuffle_calibration_samples=False)
    quantize_s = time.perf_counter() - t0
    wiki, _ = ppl(model, tok)
    novel, _ = ppl(model, tok, "novel")
    return {"variant": name, "wiki": wiki, "novel": novel, "quantize_s": round(quantize_s, 1)}


def main() -> None:
    from quantize.model.source import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--calibration", type=Path, required=True)
    a = ap.parse_args()
    model = resolve_model(None).path
    for k in a.variants.split(","):
        print(json.dumps(run(model, a.calibration, k)), flush=True)


if __name__ == "__main__":
    main()
