"""The GPU vLLM session's rows as one table per question (issue 31), and the JSON of record.

    python -m bench.vllm_report bench/results/2026-12-04-vllm-gpu-rows.json \
        --states bench/results/2026-12-04-vllm-gpu-states.json \
        --json-out bench/results/2026-12-04-vllm-gpu.json      # markdown on stdout

One JSON row per model x recipe: recipe, model, loaded (or vLLM's / pre-flight's refusal),
kernel, KV-cache tokens, answers, perplexity agreement, output tokens/s. The markdown has:
the default model's exports (real weights), the 8B and MoE architectures' formats (random
weights), and the 8B serving table as ratios to bf16 measured in the same session. KV-cache
tokens on an 80 GB card (H100) and a 24 GB card (RTX 4090) at `vllm serve`'s defaults there
are `quantize plan`'s (profile 0.26, within 0.2 % of every configuration measured on the H200,
bench/plan_check.py), not measured.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

GIB = 1 << 30
CARDS = ("h100", "rtx4090")  # an 80 GB and a 24 GB card (quantize/data/gpus.yaml)


def short_kernels(kernels: dict[str, int] | None) -> str:
    if not kernels:
        return "-"
    names: dict[str, int] = {}
    for key, n in kernels.items():
        if "kv_cache_dtype" in key:
            continue
        name = key.split("/")[-1]
        names[name] = names.get(name, 0) + n
    return ", ".join(f"{k} x{n}" for k, n in sorted(names.items(), key=lambda kv: -kv[1]))


def label_recipe(label: str, prefix: str) -> str:
    return label.removeprefix(prefix)


def rows_of_record(rows: dict[str, Any], states: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for name, r in sorted(rows.items()):
        kind = r.get("row")
        if kind == "check":
            out.append({"model": "SmolLM2-135M-Instruct (real weights)",
                        "recipe": label_recipe(name, "check-default-"),
                        "loaded": r["loaded"], "error": r.get("error"),
                        "kernel": short_kernels(r.get("kernels")),
                        "kv_tokens": (r.get("engine") or {}).get("kv_tokens"),
                        "answers": (f"{r['answers_right']}/{r['answers_total']}"
                                    if r.get("answers_total") else None),
                        "ppl_vllm": r.get("ppl_vllm"), "ppl_transformers": r.get("ppl_hf"),
                        "ppl_agreement_pct": r.get("ppl_diff_pct"),
                        "out_tok_s": None})
        elif kind == "load":
            arch = "Qwen3-30B-A3B architecture, 12 layers" if "-moe-" in name else \
                "Llama-3.1-8B architecture"
            out.append({"model": f"{arch} (random weights)",
                        "recipe": label_recipe(label_recipe(name, "load-8b-"), "load-moe-"),
                        "loaded": r["loaded"], "error": r.get("error"),
                        "kernel": short_kernels(r.get("kernels")),
                        "generated_tokens": r.get("generated"),
                        "kv_tokens": (r.get("engine") or {}).get("kv_tokens")})
        elif kind == "serve" and name.startswith("serve-"):
            runs = {x["requests"]: x["out_tok_s"] for x in r.get("runs") or []}
            out.append({"model": "Llama-3.1-8B architecture (random weights)",
                        "recipe": label_recipe(name, "serve-8b-"), "loaded": r["started"],
                        "kernel": "; ".join(r.get("kernel_lines") or []) or "bf16",
                        "kv_tokens": r.get("kv_tokens_logged"),
                        "max_concurrency_8k": r.get("max_concurrency_logged"),
                        "out_tok_s": {"64": runs.get(64), "1": runs.get(1)},
                        "load_s": r.get("load_s"),
                        "memory_gib": {k: round(v / GIB, 4) for k, v in
                                       ((r.get("engine") or {}).get("memory") or {}).items()}})
    for name, st in sorted(states.items()):  # exports refused before vLLM saw them
        if name.startswith("export-") and not st.get("ok"):
            model = "SmolLM2-135M-Instruct (real weights)" if "-default-" in name else \
                "Llama-3.1-8B architecture (random weights)"
            recipe = name.removeprefix("export-default-").removeprefix("export-8b-")
            out.append({"model": model, "recipe": recipe, "loaded": None,
                        "not_run": st.get("error") or st.get("skipped")})
    return out


def _kv_at(export: str, card: str) -> int:
    """`quantize plan`'s KV tokens for the export on `card` at vllm serve's defaults."""
    from bench.plan_check import MODELS, RECIPES
    from quantize.planner.gpus import find
    from quantize.planner.memory import predict
    from quantize.recipe.recipe import load_recipe

    name = RECIPES.get(export.removesuffix("-marlin"))
    kv_fp8 = export == "fp8-kv"
    return predict(MODELS["8b"], find(card), context=8192, kv_fp8=kv_fp8,
                   recipe=load_recipe(name) if name else None).kv_tokens


def serving_table(rows: dict[str, Any]) -> str:
    serve = {k.removeprefix("serve-8b-"): r for k, r in rows.items()
             if k.startswith("serve-8b-") and r.get("started")}
    base = serve.get("bf16")
    if base is None:
        return ""

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}x" if a and b else "-"

    b_runs = {x["requests"]: x["out_tok_s"] for x in base["runs"]}
    b_mem = {k: v / GIB for k, v in base["engine"]["memory"].items()}
    b80, b24 = (_kv_at("bf16", c) for c in CARDS)
    lines = ["| export | kernel | weights GiB | KV tokens (0.9 of H200) | 80 GB card (plan) | "
             "24 GB card (plan) | max concurrency at 8k | out tok/s, 1 request | 64 requests | "
             "load s |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in serve.items():
        runs = {x["requests"]: x["out_tok_s"] for x in r.get("runs") or []}
        mem = {k: v / GIB for k, v in r["engine"]["memory"].items()}
        kernel = ", ".join(ln.split()[1] for ln in r.get("kernel_lines") or []
                           if ln.startswith(("Using", "Selected"))) or "bf16 (cuBLAS)"
        k80, k24 = (_kv_at(name, c) for c in CARDS)
        kv, conc = r["kv_tokens_logged"], r["max_concurrency_logged"]
        cells = [name, kernel,
                 f"{mem['weights']:.2f} ({ratio(mem['weights'], b_mem['weights'])})",
                 f"{kv:,} ({ratio(kv, base['kv_tokens_logged'])})",
                 f"{k80:,} ({ratio(k80, b80)})", f"{k24:,} ({ratio(k24, b24)})",
                 f"{conc:.1f} ({ratio(conc, base['max_concurrency_logged'])})",
                 f"{runs.get(1, 0):,.1f} ({ratio(runs.get(1), b_runs.get(1))})",
                 f"{runs.get(64, 0):,.0f} ({ratio(runs.get(64), b_runs.get(64))})",
                 f"{r['load_s']:.0f} ({ratio(r['load_s'], base['load_s'])})"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def default_table(record: list[dict[str, Any]]) -> str:
    lines = ["| recipe | loaded in vLLM (GPU) | kernel | answers (of 30) | perplexity vLLM | "
             "transformers | difference |", "|---|---|---|---:|---:|---:|---:|"]
    for r in record:
        if not r["model"].startswith("SmolLM2"):
            continue
        if r.get("not_run"):
            lines.append(f"| {r['recipe']} | refused before calibration: "
                         f"{str(r['not_run']).removeprefix('error: ')[:110]}... | | | | | |")
            continue
        if not r["loaded"]:
            lines.append(f"| {r['recipe']} | **refused by vLLM**: {str(r['error'])[:100]}... "
                         "| | | | | |")
            continue
        lines.append(f"| {r['recipe']} | yes | {r['kernel']} | {r['answers']} | "
                     f"{r['ppl_vllm']:.3f} | {r['ppl_transformers']:.3f} | "
                     f"{r['ppl_agreement_pct']:+.2f} % |")
    return "\n".join(lines)


def formats_table(record: list[dict[str, Any]]) -> str:
    lines = ["| architecture | recipe | loaded | kernel |", "|---|---|---|---|"]
    for r in record:
        if r["model"].startswith("SmolLM2") or "max_concurrency_8k" in r:
            continue
        arch = r["model"].split(" (")[0]
        if r.get("not_run"):
            lines.append(f"| {arch} | {r['recipe']} | not run: "
                         f"{str(r['not_run']).removeprefix('error: ')[:70]}... | |")
        elif not r["loaded"]:
            lines.append(f"| {arch} | {r['recipe']} | **refused by vLLM** | "
                         f"{str(r['error'])[:90]}... |")
        else:
            gen = r.get("generated_tokens")
            lines.append(f"| {arch} | {r['recipe']} | yes, generated {sum(gen or [])} tokens "
                         f"| {r['kernel']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", type=Path)
    ap.add_argument("--states", type=Path, required=True)
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    rows = json.loads(a.rows.read_text())
    record = rows_of_record(rows, json.loads(a.states.read_text()))
    if a.json_out:
        a.json_out.write_text(json.dumps({"vllm": "0.26.0", "gpu": "NVIDIA H200",
                                          "torch": "2.11.0+cu130", "rows": record},
                                         indent=1) + "\n")
    print("## The default model\n\n" + default_table(record))
    print("\n## The 8B and MoE architectures\n\n" + formats_table(record))
    print("\n## Serving (Llama-3.1-8B architecture)\n\n" + serving_table(rows))


if __name__ == "__main__":
    main()
