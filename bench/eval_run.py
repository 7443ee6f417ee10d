"""Perplexity-evaluation throughput of a transformers model on the GPU, against the forward
floor (2·params·tokens + causal attention, at the measured bf16 matrix rate).

Two ways to get the loss, each at several batch sizes and window lengths:
  hf_labels  model(input_ids, labels=input_ids): transformers upcasts the full
             [batch, seq, vocab] logits to fp32 for the loss (4 bytes × 128256 per token)
  chunked    model.model(...) for the hidden states, then lm_head + cross-entropy over
             chunks of 4096 positions, so the fp32 logits never exist all at once

  python -m bench.eval_run --model DIR --json-out r.json [--bf16-tflops 790]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from bench.flops import Dims, forward_flops


def nll_hf_labels(model: Any, ids: Any) -> tuple[float, int]:
    out = model(input_ids=ids, labels=ids)
    n = ids.shape[0] * (ids.shape[1] - 1)
    return float(out.loss) * n, n


def nll_chunked(model: Any, ids: Any, chunk: int = 4096) -> tuple[float, int]:
    import torch
    import torch.nn.functional as F

    hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
    hidden = hidden.reshape(-1, hidden.shape[-1])
    target = ids[:, 1:].reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    for i in range(0, target.numel(), chunk):
        logits = model.lm_head(hidden[i:i + chunk]).float()
        total += F.cross_entropy(logits, target[i:i + chunk], reduction="sum")
    return float(total), target.numel()


METHODS = {"hf_labels": nll_hf_labels, "chunked": nll_chunked}


def measure(model: Any, method: str, batch: int, seq: int, tokens: int, vocab_in_use: int,
            reps: int = 3) -> dict[str, Any]:
    import torch

    cuda = model.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n_windows = max(batch, tokens // seq)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, vocab_in_use, (n_windows, seq), generator=gen).to(model.device)
    fn = METHODS[method]
    times = []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    nll = 0.0
    with torch.inference_mode():
        fn(model, data[:batch])  # warm-up (kernel selection)
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            nll, count = 0.0, 0
            for i in range(0, n_windows, batch):
                s, c = fn(model, data[i:i + batch])
                nll, count = nll + s, count + c
            sync()
            times.append(time.perf_counter() - t0)
    t = sorted(times)[len(times) // 2]
    return {"method": method, "batch": batch, "seq_len": seq, "tokens": n_windows * seq,
            "seconds": round(t, 3), "tokens_per_s": round(n_windows * seq / t),
            "ppl": round(math.exp(nll / count), 2) if nll / count < 50 else "overflow",
            "gpu_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--json-out", type=Path, required=True)
    p.add_argument("--bf16-tflops", type=float, default=0.0,
                   help="measured bf16 matrix rate, for the floor (0: no floor)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--vocab-in-use", type=int, default=49152,
                   help="token ids are drawn below this (the borrowed tokenizer's size)")
    p.add_argument("--configs", default="hf_labels:1:1024,hf_labels:8:1024,chunked:1:1024,"
                   "chunked:8:1024,chunked:16:1024,chunked:8:2048")
    a = p.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16,
                                                 device_map=a.device).eval()
    load_s = time.perf_counter() - t0
    dims = Dims.from_config(json.loads((a.model / "config.json").read_text()))
    rows = []
    for cfg in a.configs.split(","):
        method, batch, seq = cfg.split(":")
        try:
            row = measure(model, method, int(batch), int(seq), a.tokens, a.vocab_in_use)
        except torch.OutOfMemoryError:
            row = {"method": method, "batch": int(batch), "seq_len": int(seq), "error": "OOM"}
            torch.cuda.empty_cache()
        if a.bf16_tflops and "seconds" in row:
            fl = forward_flops(dims, row["tokens"], row["seq_len"])
            row["floor_s"] = round(fl / (a.bf16_tflops * 1e12), 3)
            row["x_floor"] = round(row["seconds"] / row["floor_s"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    a.json_out.write_text(json.dumps({"load_s": round(load_s, 1), "rows": rows,
                                      "weights": "random; ppl values are meaningless"}))


if __name__ == "__main__":
    main()
