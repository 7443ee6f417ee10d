"""`quantize plan` against a running vLLM, term by term (issue 32).

Reads the serve rows of a GPU vLLM session (bench/vllm_gpu.py: each row is one vLLM start,
with the KV-cache tokens and concurrency vLLM logged and the memory profile it sized the cache
from) and predicts each configuration with the planner (quantize.planner.memory.predict: same
GPU, gpu_memory_utilization, max_model_len, max_num_batched_tokens and max_num_seqs as the
engine ran with, the recipe's format, the KV dtype). The Llama-3.1-8B rows compare with the
built-in config of meta-llama/Llama-3.1-8B-Instruct, the architecture the random-weight model
was built from (bench/make_model.py).

    python -m bench.plan_check bench/results/2026-12-04-vllm-gpu-rows.json \
        --profile 0.26 [--json-out bench/results/2026-12-04-plan-vs-vllm.json] [--markdown]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

GIB = 1 << 30
# the architecture each random-weight model was made from (bench/make_model.py presets)
MODELS = {"8b": "meta-llama/Llama-3.1-8B-Instruct", "moe": "Qwen/Qwen3-30B-A3B"}
# the recipe behind each export the rows name (bench/vllm_gpu.py labels)
RECIPES = {"bf16": None, "gptq-int4-asym": "gptq-int4-asym", "int4": "gptq-int4-asym",
           "gptq-int4-asym-g128": "bench/variants/gptq-int4-asym-g128.yaml",
           "gptq-int4-g128": "bench/variants/gptq-int4-g128.yaml",
           "fp8-dynamic": "fp8-dynamic", "fp8": "fp8-dynamic", "fp8-kv": "fp8-kv",
           "fp8kv": "fp8-kv", "w8a8-int8": "w8a8-int8", "nvfp4a16": "nvfp4a16",
           "gptq-int4": "gptq-int4"}


def recipe_of(row: dict[str, Any]) -> str | None:
    """The export a row's model folder holds: <WORK>/x/8b-<recipe>/export, or the source."""
    model = Path(row["model"])
    if model.name != "export":
        return None
    name = model.parent.name.split("-", 1)[1]
    return RECIPES[name]


def predict(row: dict[str, Any], profile: str, gpu: str = "h200") -> dict[str, Any]:
    from quantize.planner.gpus import find as find_gpu
    from quantize.planner.memory import predict as plan
    from quantize.recipe.recipe import load_recipe

    eng = row["engine"]
    arch = "moe" if "moe" in row["label"] else "8b"
    recipe_name = recipe_of(row)
    recipe = load_recipe(recipe_name) if recipe_name else None
    kv_fp8 = eng["kv_cache_dtype"].startswith("fp8")
    m = plan(MODELS[arch], find_gpu(gpu), util=eng["gpu_memory_utilization"],
             context=eng["max_model_len"], batched=eng["max_num_batched_tokens"],
             seqs=eng["max_num_seqs"], kv_fp8=kv_fp8, recipe=recipe, profile=profile,
             cpu_offload_gib=float(eng.get("cpu_offload_gb") or 0),
             eager=row["args"].get("enforce_eager", False))
    return {"kv_tokens": m.kv_tokens, "max_concurrency": m.max_concurrency,
            "weights_gib": m.weights / GIB, "activation_gib": m.activation / GIB,
            "nontorch_gib": m.nontorch / GIB, "available_gib": m.available / GIB,
            "recipe": recipe_name or "none (bf16)"}


def compare(rows: dict[str, dict[str, Any]], profile: str, gpu: str = "h200"
            ) -> list[dict[str, Any]]:
    out = []
    for label, row in sorted(rows.items()):
        if row.get("row") != "serve" or not row.get("started") or not row.get("engine"):
            continue
        mem = row["engine"].get("memory") or {}
        seen_kv = row.get("kv_tokens_logged") or row["engine"]["kv_tokens"]
        seen_conc = row.get("max_concurrency_logged") or row["engine"]["max_concurrency"]
        try:
            p = predict(row, profile, gpu)
        except KeyError:  # an export no recipe makes (w4afp8): nothing to plan
            continue
        out.append({
            "label": label, "recipe": p["recipe"], "args": row["args"],
            "vllm_kv_tokens": seen_kv, "plan_kv_tokens": p["kv_tokens"],
            "kv_error_pct": round(100 * (p["kv_tokens"] / seen_kv - 1), 3),
            "vllm_max_concurrency": seen_conc,
            "plan_max_concurrency": round(p["max_concurrency"], 2),
            "concurrency_error_pct": round(100 * (p["max_concurrency"] / seen_conc - 1), 3),
            "terms_gib": {k: {"vllm": round(mem[v] / GIB, 4) if v in mem else None,
                              "plan": round(p[f"{k}_gib"], 4)}
                          for k, v in (("weights", "weights"), ("activation", "activation_peak"),
                                       ("nontorch", "non_torch"),
                                       ("available", "available_kv"))},
        })
    return out


def markdown(cmp: list[dict[str, Any]]) -> str:
    lines = ["| configuration | recipe | vLLM KV tokens | plan | error | vLLM max concurrency | "
             "plan | error |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for c in cmp:
        lines.append(f"| {c['label']} | {c['recipe']} | {c['vllm_kv_tokens']:,} | "
                     f"{c['plan_kv_tokens']:,} | {c['kv_error_pct']:+.2f} % | "
                     f"{c['vllm_max_concurrency']:.2f} | {c['plan_max_concurrency']:.2f} | "
                     f"{c['concurrency_error_pct']:+.2f} % |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", type=Path)
    ap.add_argument("--profile", default="0.26")
    ap.add_argument("--gpu", default="h200", help="the GPU the rows ran on (planner name)")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    cmp = compare(json.loads(a.rows.read_text()), a.profile, a.gpu)
    if a.json_out:
        a.json_out.write_text(json.dumps(cmp, indent=1) + "\n")
    print(markdown(cmp) if a.markdown else json.dumps(cmp, indent=1))


if __name__ == "__main__":
    main()
