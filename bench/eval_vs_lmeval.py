"""Perplexity throughput: `quantize eval`'s perplexity against lm-eval's own HF path
(`HFLM.loglikelihood_rolling`) on the same text, model, dtype, window and batch, in one
process, and both against the forward-pass floor (forward FLOPs over the fp32/bf16 matmul
rate measured in the same run).

  python -m bench.eval_vs_lmeval [--model DIR] [--tokens 8192] [--seq-len 1024] [--batch 8]
      [--device cpu] [--json-out r.json]

Both score the text in windows of seq_len tokens. They are not the same number: ours scores
disjoint windows whose first token has no context and is skipped; lm-eval prepends the
end-of-text token to the first window and gives each later window one token of overlap, so it
scores every token. Token counts and perplexities are printed for both so the difference is
visible; the timing compares the same amount of model work (the same windows and batch).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from bench.flops import Dims, forward_flops


def matmul_tflops(device: str, dtype: Any, n: int = 2048, reps: int = 5) -> float:
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12


def ours(model: Any, tok: Any, text_path: Path, tokens: int, seq_len: int,
         batch: int) -> dict[str, Any]:
    from quantize.metrics import perplexity
    from quantize.spec.recipe import MetricSpec

    spec = MetricSpec(name="ppl", kind="perplexity", direction="lower_is_better",
                      threshold=0.5, path=str(text_path), max_tokens=tokens, seq_len=seq_len)
    r = perplexity(model, tok, spec, batch)
    return {"ppl": r.value, "scored_tokens": r.n, "seconds": r.seconds}


def lm_eval_rolling(model: Any, tok: Any, text: str, seq_len: int, batch: int,
                    device: str) -> dict[str, Any]:
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=batch, max_length=seq_len,
              device=device)
    req = Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=0)
    t0 = time.perf_counter()
    (ll,) = lm.loglikelihood_rolling([req], disable_tqdm=True)
    seconds = time.perf_counter() - t0
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    return {"ppl": math.exp(-ll / n), "scored_tokens": n, "seconds": round(seconds, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None, help="model folder (default: the default model)")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json-out", default=None)
    a = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantize.model.source import resolve_model

    path = Path(a.model) if a.model else resolve_model(None).path
    dtype = torch.float32 if a.device == "cpu" else torch.bfloat16
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(a.device).eval()
    # the same text for both: exactly the first `tokens` tokens of the shipped eval text
    from quantize.metrics import BUILTIN_EVAL_TEXT

    full = BUILTIN_EVAL_TEXT["wiki-eval"].read_text(encoding="utf-8")
    ids = tok(full, add_special_tokens=False)["input_ids"][: a.tokens]
    text = tok.decode(ids)
    text_path = Path("/tmp/eval_vs_lmeval.txt")
    text_path.write_text(text, encoding="utf-8")

    rate = matmul_tflops(a.device, dtype, n=8192 if a.device == "cuda" else 2048)
    d = Dims.from_config(json.loads((path / "config.json").read_text()))
    floor_s = forward_flops(d, a.tokens, a.seq_len) / (rate * 1e12)
    rows = {}
    # lm-eval first, ours second, then lm-eval again: the repeat shows warm-up effects
    rows["lm_eval"] = lm_eval_rolling(model, tok, text, a.seq_len, a.batch, a.device)
    rows["quantize"] = ours(model, tok, text_path, a.tokens, a.seq_len, a.batch)
    rows["lm_eval_again"] = lm_eval_rolling(model, tok, text, a.seq_len, a.batch, a.device)
    for r in rows.values():
        r["tokens_per_s"] = round(a.tokens / r["seconds"], 1)
        r["x_floor"] = round(r["seconds"] / floor_s, 2)
    best_lm = min(rows["lm_eval"]["seconds"], rows["lm_eval_again"]["seconds"])
    result = {"model": str(path), "device": a.device, "dtype": str(dtype).split(".")[-1],
              "tokens": a.tokens, "seq_len": a.seq_len, "batch": a.batch,
              "threads": torch.get_num_threads(), "matmul_tflops": round(rate, 3),
              "floor_s": round(floor_s, 3), "rows": rows,
              "lm_eval_over_quantize": round(best_lm / rows["quantize"]["seconds"], 2)}
    print("| path | scored tokens | ppl | s | tokens/s | ×floor |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['scored_tokens']} | {r['ppl']:.3f} | {r['seconds']} | "
              f"{r['tokens_per_s']} | {r['x_floor']} |")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
