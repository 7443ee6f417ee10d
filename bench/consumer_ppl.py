"""Held-out perplexity of exports as their users load them, beside the 16-bit model:

- `transformers`: plain `AutoModelForCausalLM.from_pretrained(export)` (fp32), scored by the
  eval's own NLL loop (quantize/model/nll.py) on the windows `quantize eval` uses;
- `lm-eval-hf`: lm-eval's `HFLM(pretrained=export)`, scored by lm-eval itself
  (`loglikelihood_rolling` over each text, its own windows);
- `reference`: the project's dequantized load (online transforms attached), as the eval
  scores it.

Texts: the eval slice (the first 16,384 tokens of `wiki-eval`) and the novel (the first
16,384 tokens of `novel`, never used for any choice). Recovery = bf16 ppl / export ppl, with
bf16 loaded and scored the same way in each column.

    python -m bench.consumer_ppl --base MODEL_DIR EXPORT... --out rows.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from pathlib import Path
from typing import Any

TOKENS = 16384
SEQ = 1024


def _text_ids(tok: Any, name: str) -> list[int]:
    from quantize.recipe.texts import BUILTIN_EVAL_TEXT

    text = BUILTIN_EVAL_TEXT[name].read_text(encoding="utf-8")
    return list(tok(text, add_special_tokens=False)["input_ids"][:TOKENS])


def _ours(model: Any, ids: list[int]) -> float:
    """Disjoint windows of SEQ tokens through the model's own forward (as a user's loop would
    call it: the eval's window_nll splits the LM head off, which a compressed-tensors model
    loaded without decompression does not support)."""
    import torch

    t = torch.tensor(ids)
    total, n = 0.0, 0
    with torch.inference_mode():
        for begin in range(0, len(ids) - 1, SEQ):
            w = t[begin:begin + SEQ].unsqueeze(0)
            if w.shape[1] < 2:
                break
            lp = torch.log_softmax(model(w, use_cache=False).logits[0, :-1].float(), dim=-1)
            total -= float(lp.gather(1, w[0, 1:].unsqueeze(1)).sum())
            n += w.shape[1] - 1
    return math.exp(total / n)


def _lm_eval(path: Path, tok: Any, ids: list[int]) -> float:
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=str(path), device="cpu", dtype="float32", batch_size=8,
              max_length=SEQ)
    text = tok.decode(ids)
    req = Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=0)
    (ll,) = lm.loglikelihood_rolling([req], disable_tqdm=True)
    n = len(lm.tok_encode(text))
    del lm
    gc.collect()
    return math.exp(-ll / n)


def measure(path: Path, quantized: bool) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantize.model.decode import load_dequantized

    tok = AutoTokenizer.from_pretrained(path)
    row: dict[str, Any] = {"model": str(path)}
    for text in ("wiki-eval", "novel"):
        ids = _text_ids(tok, text)
        t0 = time.perf_counter()
        plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        row[f"{text}:transformers"] = _ours(plain, ids)
        del plain
        if quantized:
            ref = load_dequantized(path, dtype=torch.float32).eval()
            row[f"{text}:reference"] = _ours(ref, ids)
            del ref
        gc.collect()
        row[f"{text}:lm-eval-hf"] = _lm_eval(path, tok, ids)
        row[f"{text}:seconds"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, required=True, help="the 16-bit model folder")
    ap.add_argument("exports", type=Path, nargs="+")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--base-row", type=Path, default=None,
                    help="a JSON file holding an earlier measurement of --base (its row)")
    args = ap.parse_args()
    base = (json.loads(args.base_row.read_text()) if args.base_row
            else measure(args.base, quantized=False))
    rows = [base]
    for e in args.exports:
        r = measure(e, quantized=True)
        for k in list(r):
            text, _, how = k.partition(":")
            if how in ("transformers", "lm-eval-hf", "reference"):
                col = "transformers" if how == "reference" else how
                r[f"{k}:recovery"] = round(base[f"{text}:{col}"] / r[k], 4)
        rows.append(r)
        args.out.write_text(json.dumps(rows, indent=1))
    for r in rows[1:]:
        print(r["model"], {k: v for k, v in r.items() if k.endswith("recovery")})


if __name__ == "__main__":
    main()
