"""Hadamard rotations before GPTQ on the default model (issue 35's first candidate), measured
where the pipeline cannot yet: llm-compressor's QuIPModifier (input-side rotations `v`, fused
into the weights, their inverse applied online to each Linear's input) followed by the
default's GPTQ (W4A16_ASYM, group 64, imatrix scales, actorder static), and the wiki eval
slice's perplexity of the model in memory, online rotations active, against the same
script's 16-bit model and its GPTQ-without-rotation control.

The model in memory, not an export: the hf engine's loader does not apply a checkpoint's
`transform_config` (compressed-tensors only serialises it), so an exported rotated checkpoint
cannot be scored by the pipeline; the in-memory model carries the online hooks. Each variant
gets the pipeline's calibration samples (a run folder's calibrate/calibration.safetensors).

    python -m bench.quip_probe --model <converted default model> \
        --calibration <run>/calibrate/calibration.safetensors --out rows.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

VARIANTS: dict[str, dict[str, Any] | None] = {
    "gptq (no rotation)": None,
    "quip v, hadamard blocks of 64 (one per quantization group)": {
        "transform_type": "hadamard", "transform_block_size": 64},
    "quip v, random hadamard over the whole input": {"transform_type": "random-hadamard"},
}


def ppl(model: Any, tokenizer: Any, text_name: str = "wiki-eval") -> tuple[float, int]:
    """Perplexity on the first 16,384 tokens of a shipped eval text in 1,024-token windows:
    the default suite's wiki_ppl (and the same on the novel), the NLL loop of `quantize eval`."""
    import torch

    from quantize.metrics import windows
    from quantize.model.nll import window_nll
    from quantize.recipe.texts import BUILTIN_EVAL_TEXT

    text = Path(BUILTIN_EVAL_TEXT[text_name]).read_text()
    ids = torch.tensor(tokenizer(text)["input_ids"][:16384])
    wins = windows(len(ids), 1024, 1024)
    with torch.inference_mode():
        nll = window_nll(model, ids, wins, 8)
    n = sum(w[2] for w in wins)
    return math.exp(sum(nll) / n), n


def run(model_path: Path, calibration: Path, name: str, quip: dict[str, Any] | None) -> dict:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantize.backends.llmcompressor import build_modifiers
    from quantize.recipe.recipe import load_recipe

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    t0 = time.perf_counter()
    if name != "bf16":
        cal = load_file(str(calibration))
        samples = [row[:n].tolist() for row, n in zip(cal["input_ids"], cal["lengths"],
                                                       strict=True)]
        ds = Dataset.from_dict({"input_ids": samples,
                                "attention_mask": [[1] * len(s) for s in samples]})
        mods = build_modifiers(load_recipe("gptq-int4-asym"), 64, model)
        if quip is not None:
            from llmcompressor.modifiers.transform import QuIPModifier

            mods = [QuIPModifier(rotations=["v"], ignore="lm_head", **quip), *mods]
        oneshot(model=model, processor=tok, recipe=mods, dataset=ds,
                num_calibration_samples=len(samples), max_seq_length=max(map(len, samples)),
                shuffle_calibration_samples=False)
    quantize_s = time.perf_counter() - t0
    wiki, n = ppl(model, tok)
    novel, _ = ppl(model, tok, "novel")
    return {"variant": name, "quip": quip, "wiki_ppl": wiki, "novel_ppl": novel, "tokens": n,
            "quantize_s": round(quantize_s, 1),
            "tied_embeddings": model.get_input_embeddings().weight.data_ptr()
            == model.get_output_embeddings().weight.data_ptr()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--calibration", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default="", help="comma-separated variant numbers (0-based)")
    args = ap.parse_args()
    keep = {int(i) for i in args.only.split(",") if i}
    rows = [run(args.model, args.calibration, "bf16", None)]
    for i, (name, quip) in enumerate(VARIANTS.items()):
        if keep and i not in keep:
            continue
        rows.append(run(args.model, args.calibration, name, quip))
        rows[-1]["recovery"] = rows[0]["wiki_ppl"] / rows[-1]["wiki_ppl"]
        rows[-1]["novel_recovery"] = rows[0]["novel_ppl"] / rows[-1]["novel_ppl"]
        print(json.dumps(rows[-1]), flush=True)
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
