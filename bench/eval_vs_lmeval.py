"""Perplexity throughput: our perplexity loop (quantize/model/nll.py) against lm-eval's own HF
path (`HFLM.loglikelihood_rolling`) on the same model object, text, dtype, windows and batch,
in one process, and both against the forward-pass floor (forward FLOPs over the matmul rate
measured in the same run). Issue 20, goal 4.

  python -m bench.eval_vs_lmeval [--model DIR] [--tokens 8192] [--seq-len 1024] [--batch 8]
      [--device cpu|cuda] [--dtype auto|float32|bfloat16|float16] [--reps 2]
      [--rows lm_eval,quantize_lmeval_windows,quantize_eval,before[,quantize_compiled]]
      [--json-out r.json]

Rows (each run once to warm up, untimed, then --reps times in rotating order; best kept):
- lm_eval: lm-eval's rolling log-likelihood of the text. Its windows: the text's tokens
  (lm-eval's own tok_encode) with its prefix token (BOS, else EOS) in front, windows of
  seq_len input tokens, each predicting seq_len tokens with one token of overlap: every token
  of the text is scored. log_softmax over full [batch, seq, vocab] logits in the model dtype.
- quantize_lmeval_windows (the headline, like for like): our loop on exactly lm-eval's
  windows (built by lm-eval's own get_rolling_token_windows/make_disjoint_window from its
  tok_encode and prefix token), the same batch: same model work, same scored tokens, so the
  perplexities must agree to rounding (`ppl_rel_diff`; lm-eval rounds log-probabilities to the
  model dtype, we upcast logits to fp32 first).
- quantize_eval: `quantize eval`'s perplexity metric as the pipeline runs it (its disjoint
  windows do not score each window's first token and have no prefix token, so its
  perplexity is a slightly different number; same batch, one token less per row fed).
- before: the loop `quantize eval` used before issue 20's change (full logits, mask on the
  last batch, a host sync per window), on quantize_eval's windows: the before/after.
- quantize_compiled (opt-in, GPU): quantize_lmeval_windows with each decoder layer through
  torch.compile (`window_nll(compile_layers=True)`); its warm-up (`first_s`) holds the
  compilation. Not what `quantize eval` runs: measured to decide whether it should.

Each row's time is the wall time of the whole call (tokenisation included, as lm-eval's
includes its own), the device synchronised at both ends. The model is loaded once with SDPA
attention and shared by every row.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path
from typing import Any

from bench.flops import Dims, forward_flops

ROWS = ("lm_eval", "quantize_lmeval_windows", "quantize_eval", "before", "quantize_compiled")
DEFAULT_ROWS = ROWS[:4]


def matmul_tflops(device: str, dtype: Any, n: int = 2048, reps: int = 5) -> float:
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def lmeval_windows(lm: Any, text: str) -> tuple[list[int], list[tuple[int, int, int]]]:
    """lm-eval's rolling windows of `text` (its own code) as one id list and our
    (begin, end, n_scored) windows over it: each window holds context + continuation, the
    model reads all but the last token and the continuation is scored."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    ids: list[int] = []
    wins = []
    for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
            token_list=lm.tok_encode(text), prefix_token=lm.prefix_token_id,
            max_seq_len=lm.max_length, context_len=1)):
        seq = (ctx + cont)[-(lm.max_length + 1):]  # lm-eval's truncation (a no-op here)
        wins.append((len(ids), len(ids) + len(seq), len(cont)))
        ids += seq
    return ids, wins


def before_nll(model: Any, all_ids: Any, wins: list[tuple[int, int, int]],
               batch_size: int) -> list[float]:
    """The pre-issue-20 loop of quantize/metrics.py, verbatim: the 'before' row."""
    import torch

    device = next(model.parameters()).device
    nll_sums = []
    with torch.inference_mode():
        for i in range(0, len(wins), batch_size):
            batch = wins[i: i + batch_size]
            longest = max(e - b for b, e, _ in batch)
            inp = torch.zeros((len(batch), longest), dtype=torch.long)
            mask = torch.zeros_like(inp)
            for j, (b, e, _) in enumerate(batch):
                inp[j, : e - b] = all_ids[b:e]
                mask[j, : e - b] = 1
            same = all(e - b == longest for b, e, _ in batch)
            kw = {} if same else {"attention_mask": mask.to(device)}
            logits = model(input_ids=inp.to(device), **kw).logits
            for j, (b, e, scored) in enumerate(batch):
                n = e - b
                nll = torch.nn.functional.cross_entropy(
                    logits[j, n - 1 - scored: n - 1].float(),
                    inp[j, n - scored: n].to(device), reduction="sum")
                nll_sums.append(float(nll))
    return nll_sums


class Paths:
    """One callable per row; each returns (ppl, scored tokens, windows)."""

    def __init__(self, model: Any, tok: Any, text: str, text_path: Path, a: Any) -> None:
        from lm_eval.models.huggingface import HFLM

        self.model, self.tok, self.text, self.a = model, tok, text, a
        self.lm = HFLM(pretrained=model, tokenizer=tok, batch_size=a.batch,
                       max_length=a.seq_len, device=a.device)
        from quantize.recipe.recipe import parse_metric

        self.spec = parse_metric(dict(name="ppl", kind="perplexity", direction="lower_is_better",
                                      threshold=0.5, path=str(text_path), max_tokens=a.tokens,
                                      seq_len=a.seq_len))
        _, wins = lmeval_windows(self.lm, text)  # lm-eval's scored tokens and windows
        self.lm_counts = (sum(s for _, _, s in wins), len(wins))

    def lm_eval(self) -> tuple[float, int, int]:
        from lm_eval.api.instance import Instance

        req = Instance(request_type="loglikelihood_rolling", doc={}, arguments=(self.text,),
                       idx=0)
        (ll,) = self.lm.loglikelihood_rolling([req], disable_tqdm=True)
        return math.exp(-ll / self.lm_counts[0]), *self.lm_counts

    def quantize_lmeval_windows(self, compile_layers: bool = False) -> tuple[float, int, int]:
        import torch

        from quantize.model.nll import window_nll

        ids, wins = lmeval_windows(self.lm, self.text)
        sums = window_nll(self.model, torch.tensor(ids, dtype=torch.long), wins, self.a.batch,
                          compile_layers=compile_layers)
        n = sum(s for _, _, s in wins)
        return math.exp(sum(sums) / n), n, len(wins)

    def quantize_compiled(self) -> tuple[float, int, int]:
        return self.quantize_lmeval_windows(compile_layers=True)

    def quantize_eval(self) -> tuple[float, int, int]:
        from quantize.metrics import perplexity

        r = perplexity(self.model, self.tok, self.spec, self.a.batch)
        return r.value, r.n, len(r.window_tokens or [])

    def before(self) -> tuple[float, int, int]:
        import torch

        from quantize.metrics import token_windows

        ids, wins = token_windows(self.tok, self.spec)
        sums = before_nll(self.model, torch.tensor(ids, dtype=torch.long), wins, self.a.batch)
        n = sum(s for _, _, s in wins)
        return math.exp(sum(sums) / n), n, len(wins)


def timed(fn: Any, device: str) -> tuple[float, tuple[float, int, int], float | None]:
    """(seconds, fn's result, device memory peak above the model's GiB on cuda)."""
    import torch

    sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device == "cuda" else None
    return seconds, out, peak


def versions() -> dict[str, str]:
    from importlib.metadata import version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "lm_eval"):
        try:
            out[pkg] = version(pkg)
        except ImportError:  # a missing package is reported, not fatal
            out[pkg] = "?"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: the default model)")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="auto",
                   help="auto (float32 on cpu, bfloat16 on cuda), float32, bfloat16, float16")
    p.add_argument("--reps", type=int, default=2, help="timed repetitions per row (best kept)")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                   help=f"comma-separated subset of {ROWS}")
    p.add_argument("--json-out", default=None)
    a = p.parse_args()
    rows = [r for r in a.rows.split(",") if r]
    if bad := [r for r in rows if r not in ROWS]:
        p.error(f"unknown rows {bad}; known: {', '.join(ROWS)}")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantize.metrics import BUILTIN_EVAL_TEXT
    from quantize.model.source import resolve_model

    path = Path(a.model) if a.model else resolve_model(None).path
    name = {"auto": "float32" if a.device == "cpu" else "bfloat16"}.get(a.dtype, a.dtype)
    dtype = getattr(torch, name)
    tok = AutoTokenizer.from_pretrained(path)
    # straight to the GPU (no 16 GB host copy first); SDPA attention for every row
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="sdpa",
        device_map=a.device if a.device == "cuda" else None).eval()
    # the same text for every row: the first `tokens` tokens of the shipped eval text
    full = BUILTIN_EVAL_TEXT["wiki-eval"].read_text(encoding="utf-8")
    ids = tok(full, add_special_tokens=False)["input_ids"][: a.tokens]
    text = tok.decode(ids)
    text_path = Path(f"/tmp/eval_vs_lmeval-{a.tokens}.txt")
    text_path.write_text(text, encoding="utf-8")
    paths = Paths(model, tok, text, text_path, a)

    rate = matmul_tflops(a.device, dtype, n=8192 if a.device == "cuda" else 2048)
    d = Dims.from_config(json.loads((path / "config.json").read_text()))
    floor_s = forward_flops(d, a.tokens, a.seq_len) / (rate * 1e12)
    res: dict[str, dict[str, Any]] = {}
    for r in rows:  # warm-up: first-call costs (cuBLAS/SDPA set-up, allocator growth)
        s, (ppl, n, w), peak = timed(getattr(paths, r), a.device)
        res[r] = {"ppl": ppl, "scored_tokens": n, "windows": w, "first_s": round(s, 3),
                  "times_s": [], "peak_gib_above_model": peak and round(peak, 2)}
    for rep in range(a.reps):  # rotating order: no row always runs first or after another
        for r in rows[rep % len(rows):] + rows[: rep % len(rows)]:
            s, _, _ = timed(getattr(paths, r), a.device)
            res[r]["times_s"].append(round(s, 3))
    for v in res.values():
        v["seconds"] = min(v["times_s"]) if v["times_s"] else v["first_s"]
        v["tokens_per_s"] = round(a.tokens / v["seconds"], 1)
        v["x_floor"] = round(v["seconds"] / floor_s, 2)
    lm, ours = res.get("lm_eval"), res.get("quantize_lmeval_windows")
    ratio = round(lm["seconds"] / ours["seconds"], 3) if lm and ours else None
    rel = abs(ours["ppl"] - lm["ppl"]) / lm["ppl"] if lm and ours else None
    result = {
        "model": str(path), "device": a.device, "dtype": name,
        "gpu": torch.cuda.get_device_name() if a.device == "cuda" else None,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "versions": versions(), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "tokens": a.tokens, "seq_len": a.seq_len, "batch": a.batch, "reps": a.reps,
        "threads": torch.get_num_threads(), "matmul_tflops": round(rate, 3),
        "floor_s": round(floor_s, 3),
        "compared": "lm_eval vs quantize_lmeval_windows: the same windows (lm-eval's rolling "
                    "windows, prefix token first, every text token scored once), batch, "
                    "model object and dtype; best of the timed repetitions after one warm-up",
        "ours_s": ours["seconds"] if ours else None,
        "lmeval_s": lm["seconds"] if lm else None,
        "ratio": ratio, "lm_eval_over_quantize": ratio,  # issue 20: results/latest.json
        "ppl_ours": ours["ppl"] if ours else None, "ppl_lmeval": lm["ppl"] if lm else None,
        "ppl_rel_diff": rel,
        # the ratio no loop running the same forward can beat: lm-eval's time over the floor
        "lmeval_over_floor": round(lm["seconds"] / floor_s, 3) if lm else None,
        "compiled_ratio": round(lm["seconds"] / res["quantize_compiled"]["seconds"], 3)
        if lm and "quantize_compiled" in res else None,
        "compiled_ppl_rel_diff": abs(res["quantize_compiled"]["ppl"] - lm["ppl"]) / lm["ppl"]
        if lm and "quantize_compiled" in res else None,
        "scored_tokens": {r: v["scored_tokens"] for r, v in res.items()},
        "windows": {r: v["windows"] for r, v in res.items()},
        "lm_eval_over_before": round(lm["seconds"] / res["before"]["seconds"], 3)
        if lm and "before" in res else None,
        "lm_eval_over_quantize_eval": round(lm["seconds"] / res["quantize_eval"]["seconds"], 3)
        if lm and "quantize_eval" in res else None,
        "rows": res,
    }
    print("| path | windows | scored tokens | ppl | first s | best s | tokens/s | ×floor "
          "| peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r, v in res.items():
        print(f"| {r} | {v['windows']} | {v['scored_tokens']} | {v['ppl']:.4f} | "
              f"{v['first_s']} | {v['seconds']} | {v['tokens_per_s']} | {v['x_floor']} | "
              f"{v['peak_gib_above_model']} |")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
