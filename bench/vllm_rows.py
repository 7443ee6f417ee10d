"""The rows of the GPU vLLM session (bench/vllm_gpu.py runs each as its own process), each
one vLLM process through the product's worker (quantize/vllm/worker.py, found as
`quantize verify` finds it) and one JSON row:

- `check`: an export of the default model (real weights): vLLM loads it once and answers the
  30 factual questions (eval/questions/factual.yaml, the model's chat template, greedy, as
  `quantize compare --questions`) and scores the default suite's perplexity windows
  (eval/default.yaml wiki_ppl: the same token windows as the hf engine); transformers then
  scores the same windows on the GPU. Row: loaded, kernels, answers right, both
  perplexities and their difference in %.
- `load`: any export (random-weight 8B / MoE architectures): vLLM loads it and generates 16
  tokens from 4 prompts. Row: loaded (or vLLM's error line), kernels, the log's kernel lines.
- `serve`: one vLLM configuration as `vllm serve` would start it (CUDA graphs unless
  --eager): KV-cache tokens and the concurrency vLLM logs, the memory profile it sized the
  cache from, output tokens/s at 64 and at 1 concurrent requests (512 prompt tokens, 256
  output tokens), load time, kernels. With --expect-fail the row records vLLM's refusal.

Checks run with a fixed KV cache and a memory share sized to the model (the worker's
`kv_cache_gib`: no memory profiling, so several can share the GPU); `serve` rows run alone.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
KV_LINES = {"kv_tokens_logged": re.compile(r"GPU KV cache size: ([\d,]+) tokens"),
            "max_concurrency_logged": re.compile(
                r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x"),
            "available_kv_gib_logged": re.compile(r"Available KV cache memory: ([\d.]+) GiB"),
            "weights_gib_logged": re.compile(r"Model loading took ([\d.]+) GiB")}
KERNEL_LINE = re.compile(r"(Using \S+ (?:for|kernel|backend)[^\n]{0,120}|"
                         r"Selected \S+ [^\n]{0,120}|[^\n]{0,60}Marlin[^\n]{0,80})")


def read_log(path: str | None) -> dict[str, Any]:
    """What vLLM's own log says: KV-cache size and concurrency lines, the kernel lines."""
    out: dict[str, Any] = {}
    if not path or not Path(path).is_file():
        return out
    text = Path(path).read_text(errors="replace")
    for key, rx in KV_LINES.items():
        m = rx.findall(text)
        if not m:
            continue
        last = m[-1]
        if key == "max_concurrency_logged":
            out[key] = float(last[1])
            out["max_model_len_logged"] = int(last[0].replace(",", ""))
        elif key == "kv_tokens_logged":
            out[key] = int(last.replace(",", ""))
        else:
            out[key] = float(last)
    kernels = []
    for line in KERNEL_LINE.findall(text):
        line = re.sub(r"^.*?\] ", "", line.strip())
        if line not in kernels and "warn" not in line.lower()[:10]:
            kernels.append(line)
    out["kernel_lines"] = kernels[:12]
    return out


def _worker(request: dict[str, Any], work: Path, name: str, timeout: float,
            env: dict[str, str] | None = None) -> dict[str, Any]:
    from quantize.vllm import host as vhost

    python = vhost.find_vllm_python()
    if python is None:
        return {"ok": False, "error": "no vLLM environment"}
    res = vhost.run_worker(python, request, work, name, timeout, env=env)
    res.update(read_log(res.get("log")))
    return res


def _kernels(layers: Any) -> dict[str, int]:
    if not isinstance(layers, dict):
        return {}
    out = {}
    for table in ("linear", "attention"):
        for key, row in (layers.get(table) or {}).items():
            if isinstance(row, dict):
                out[key] = row.get("count", 0)
    return out


def check(model: Path, label: str, work: Path, suite: Path, device: str = "cuda"
          ) -> dict[str, Any]:
    """The default model's export: answers and perplexity in vLLM, perplexity in
    transformers on the same windows."""
    from transformers import AutoTokenizer

    from quantize import metrics
    from quantize.recipe.recipe import load_suite
    from quantize.report import answers as qa

    spec = next(m for m in load_suite(str(suite)).metrics if m.kind == "perplexity")
    tok = AutoTokenizer.from_pretrained(model)
    ids, wins = metrics.token_windows(tok, spec)
    questions = qa.load_questions()
    prompts, _ = qa.prompt_ids(model, questions)
    req = {"op": "batch", "model": str(model), "max_model_len": spec.seq_len + 16,
           "enforce_eager": True, "kv_cache_gib": 2,
           "steps": [{"op": "generate", "prompts": prompts, "max_tokens": qa.MAX_TOKENS,
                      "logprobs": 1},
                     {"op": "score", "groups": [{"name": spec.name,
                                                 "sequences": [ids[b:e] for b, e, _ in wins],
                                                 "score_from": [e - b - s for b, e, s in wins]}
                                                ]}]}
    t0 = time.perf_counter()
    res = _worker(req, work, label, 900)
    row: dict[str, Any] = {"row": "check", "label": label, "model": str(model),
                           "loaded": bool(res.get("ok")), "vllm_wall_s": res.get("wall_s")}
    if not res.get("ok"):
        row["error"] = res.get("error")
        row["kernel_lines"] = res.get("kernel_lines")
        return row
    gen, sc = res["steps"]
    eos = tok.eos_token_id
    right, texts = 0, []
    for q, out in zip(questions.questions, gen["outputs"], strict=True):
        out_ids = out["token_ids"]
        if eos in out_ids:
            out_ids = out_ids[:out_ids.index(eos)]
        text = tok.decode(out_ids, skip_special_tokens=True).strip()
        ok = qa.is_right(text, q.a)
        right += ok
        texts.append({"q": q.q, "a": text[:80], "right": ok})
    nll = [-sum(o["logprobs"]) for o in sc["groups"][0]["outputs"]]
    ppl_vllm = metrics.perplexity_result(spec, wins, nll, sc["groups"][0]["seconds"]).value
    row.update(vllm=gen["vllm_version"], quantization=gen["quantization"], dtype=gen["dtype"],
               kernels=_kernels(gen["layers"]), kernel_lines=res.get("kernel_lines"),
               engine=gen.get("engine"), answers_right=right, answers_total=len(texts),
               answers=texts, ppl_vllm=round(ppl_vllm, 4), vllm_load_s=res.get("load_s"))
    t1 = time.perf_counter()
    row["ppl_hf"] = round(_hf_ppl(model, spec, device), 4)
    row["ppl_diff_pct"] = round(100 * (row["ppl_vllm"] / row["ppl_hf"] - 1), 3)
    row["hf_s"] = round(time.perf_counter() - t1, 1)
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    return row


def _hf_ppl(model: Path, spec: Any, device: str) -> float:
    """transformers (GPU, the checkpoint's 16-bit dtype, decompressed by compressed-tensors)
    on the same windows: the eval stage's hf engine."""
    import torch

    from quantize import metrics
    from quantize.stages.eval import load_model

    m, tok = load_model(model, device)
    try:
        return float(metrics.perplexity(m, tok, spec, 8).value)
    finally:
        del m
        if device == "cuda":
            torch.cuda.empty_cache()


def load(model: Path, label: str, work: Path, env: dict[str, str]) -> dict[str, Any]:
    """Load and generate (random-weight architectures): the kernels vLLM chose."""
    rng = list(range(1000, 1064))
    req = {"op": "generate", "model": str(model), "max_model_len": 1024,
           "enforce_eager": True, "kv_cache_gib": 4, "max_tokens": 16, "logprobs": 1,
           "prompts": [rng[i:i + 32] for i in range(0, 32, 8)]}
    res = _worker(req, work, label, 900, env)
    row: dict[str, Any] = {"row": "load", "label": label, "model": str(model),
                           "loaded": bool(res.get("ok")), "vllm_wall_s": res.get("wall_s"),
                           "kernel_lines": res.get("kernel_lines")}
    if res.get("ok"):
        row.update(vllm=res["vllm_version"], quantization=res["quantization"],
                   dtype=res["dtype"], kernels=_kernels(res["layers"]),
                   generated=[len(o["token_ids"]) for o in res["outputs"]],
                   load_s=res["load_s"], engine=res.get("engine"))
    else:
        row["error"] = res.get("error")
    return row


def serve(model: Path, label: str, work: Path, env: dict[str, str], args: dict[str, Any],
          runs: list[dict[str, int]], expect_fail: bool) -> dict[str, Any]:
    """One `vllm serve`-like start and its speed (the worker's throughput op)."""
    engine_args = {k: v for k, v in args.items()
                   if k not in ("max_model_len", "enforce_eager", "kv_cache_dtype")}
    req = {"op": "throughput", "model": str(model),
           "max_model_len": int(args.get("max_model_len", 8192)),
           "enforce_eager": bool(args.get("enforce_eager", False)),
           "kv_cache_dtype": args.get("kv_cache_dtype", "auto"),
           "engine_args": engine_args, "runs": [] if expect_fail else runs}
    res = _worker(req, work, label, 900, env)
    row: dict[str, Any] = {"row": "serve", "label": label, "model": str(model), "args": args,
                           "env": env, "started": bool(res.get("ok")),
                           "expect_fail": expect_fail, "vllm_wall_s": res.get("wall_s")}
    for key in ("kv_tokens_logged", "max_concurrency_logged", "max_model_len_logged",
                "available_kv_gib_logged", "weights_gib_logged", "kernel_lines"):
        if key in res:
            row[key] = res[key]
    if res.get("ok"):
        row.update(vllm=res["vllm_version"], load_s=res["load_s"], runs=res["runs"],
                   engine=res.get("engine"))
    else:
        row["error"] = res.get("error")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=("check", "load", "serve"))
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--json-out", type=Path, required=True)
    ap.add_argument("--suite", type=Path, default=ROOT / "eval" / "default.yaml")
    ap.add_argument("--args", default="{}", help="serve: engine arguments as JSON")
    ap.add_argument("--env", default="{}", help="environment for the vLLM process, JSON")
    ap.add_argument("--runs", default=json.dumps([
        {"requests": 64, "prompt_tokens": 512, "output_tokens": 256, "vocab": 49000},
        {"requests": 1, "prompt_tokens": 512, "output_tokens": 256, "vocab": 49000}]))
    ap.add_argument("--expect-fail", action="store_true")
    ap.add_argument("--device", default="cuda", help="check: where transformers scores")
    a = ap.parse_args()
    env = json.loads(a.env)
    if a.kind == "check":
        row = check(a.model, a.label, a.work, a.suite, a.device)
    elif a.kind == "load":
        row = load(a.model, a.label, a.work, env)
    else:
        row = serve(a.model, a.label, a.work, env, json.loads(a.args), json.loads(a.runs),
                    a.expect_fail)
    a.json_out.write_text(json.dumps(row, indent=1))
    print(json.dumps({k: v for k, v in row.items() if k not in ("answers",)})[:3000])


if __name__ == "__main__":
    main()
