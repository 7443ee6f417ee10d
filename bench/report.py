"""Markdown tables from the results the GPU calls brought back.

  python -m bench.report results1.json results2.json ... [--save bench/results-X.yaml]
  python -m bench.report bench/results-h200-2026-11-29.yaml

Floors are recomputed here from the measured rates (the first file that has them), so a
plan run with --no-rates on the same machine gets them too.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

from bench import flops
from bench.make_model import LLAMA31_8B

PIPELINE_PHASES = ("q_model_hash", "q_hash_outputs", "q_export", "q_manifest", "q_preflight")


def load(paths: list[Path]) -> dict[str, Any]:
    merged: dict[str, Any] = {"env": {}, "rates": {}, "model": {}, "runs": [], "eval": None}
    for p in paths:
        data = yaml.safe_load(p.read_text()) if p.suffix in (".yaml", ".yml") else \
            json.loads(p.read_text())
        runs = data.get("runs", [])
        merged["env"] = merged["env"] or data.get("env", {})
        merged["rates"] = merged["rates"] or data.get("rates", {})
        merged["model"] = merged["model"] or data.get("model", {})
        merged["runs"] += runs
        merged["eval"] = merged["eval"] or data.get("eval")
        merged["quality_cpu"] = merged.get("quality_cpu") or data.get("quality_cpu")
    return merged


def compact(data: dict[str, Any]) -> dict[str, Any]:
    """Drop the per-module loss lists and call counts: the YAML keeps what the tables use."""
    runs = [{k: v for k, v in r.items() if k not in ("gptq_losses", "calls", "unpatched")}
            for r in data["runs"]]
    return {**data, "runs": runs}


def floor_of(r: dict[str, Any], rates: dict[str, float]) -> flops.Floor | None:
    if not rates or "wall_s" not in r or not r.get("tokens") or r["recipe"] == "fp8-dynamic":
        return None
    n_grid = 20
    return flops.floor(r["recipe"], flops.Dims.from_config(LLAMA31_8B), r["tokens"],
                       r["seq_len"], rates, tf32=r.get("tf32", False), n_grid=n_grid)


def _g(r: dict[str, Any], key: str) -> str:
    v = r.get("groups_s", {}).get(key)
    return "" if v is None else f"{v:.1f}"


def phase_table(data: dict[str, Any]) -> str:
    rates = data["rates"].get("tflops", {})
    head = ["row", "calib tokens", "wall s", "load", "forward", "hessian/stats",
            "solve/search", "act. offload", "compress+save", "pipeline-only", "other",
            "floor s", "×floor", "calib. ×floor"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in data["runs"]:
        if "wall_s" not in r:
            out.append(f"| {r['label']} | | {r.get('error')} |" + " |" * (len(head) - 3))
            continue
        fl = floor_of(r, rates)
        calib = sum(r.get("groups_s", {}).get(k, 0.0)
                    for k in ("forward", "hessian/stats", "act_cache", "trace"))
        if r["recipe"] == "awq-int4":
            calib += r.get("groups_s", {}).get("solve/search", 0.0)
        cells = [r["label"], str(r.get("tokens") if r["recipe"] != "fp8-dynamic" else "–"),
                 f"{r['wall_s']:.1f}", _g(r, "load"), _g(r, "forward"), _g(r, "hessian/stats"),
                 _g(r, "solve/search"), _g(r, "act_cache"), _g(r, "compress+save"),
                 _g(r, "pipeline") if r["mode"] == "pipeline" else "–", _g(r, "other"),
                 f"{fl.seconds_tensor:.1f}" if fl else "–",
                 f"{r['wall_s'] / fl.seconds_tensor:.1f}" if fl else "–",
                 f"{calib / fl.seconds_tensor:.1f}" if fl and calib else "–"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def overhead_table(data: dict[str, Any]) -> str:
    by = {r["label"]: r for r in data["runs"] if "wall_s" in r}
    pairs = [("gptq-int4", "gptq pipeline", "gptq oneshot"),
             ("gptq-int4 + TF32", "gptq pipeline tf32", "gptq oneshot tf32"),
             ("w8a8-int8", "w8a8 pipeline", "w8a8 oneshot"),
             ("awq-int4", "awq pipeline", "awq oneshot"),
             ("fp8-dynamic", "fp8 pipeline", "fp8 oneshot")]
    head = ["recipe", "calib tokens", "pipeline s", "oneshot s", "ratio", "model sha256 s",
            "output sha256 s", "fsync + other s", "same tokens & GPTQ losses"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, pl, os_ in pairs:
        if pl not in by or os_ not in by:
            continue
        p, o = by[pl], by[os_]
        ph = p.get("phases_s", {})
        same = p.get("calib_fingerprint") == o.get("calib_fingerprint") or \
            o.get("calib_fingerprint") is None
        if p.get("gptq_loss_sum") is not None:
            same = same and p.get("gptq_loss_sum") == o.get("gptq_loss_sum")
        fsync = ph.get("other", 0.0) + ph.get("q_export", 0.0) + ph.get("q_manifest", 0.0)
        out.append(f"| {name} | {p.get('tokens') if name != 'fp8-dynamic' else '–'} | "
                   f"{p['wall_s']:.1f} | {o['wall_s']:.1f} | {p['wall_s'] / o['wall_s']:.2f} | "
                   f"{ph.get('q_model_hash', 0):.1f} | {ph.get('q_hash_outputs', 0):.1f} | "
                   f"{fsync:.1f} | {'yes' if same else 'NO'} |")
    return "\n".join(out)


def memory_table(data: dict[str, Any]) -> str:
    head = ["row", "loaded on", "activations on", "batch", "GPU peak allocated GiB",
            "GPU peak reserved GiB", "host RSS peak GiB", "wall s"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in data["runs"]:
        if "wall_s" not in r or r["recipe"] != "gptq-int4" or r["mode"] != "oneshot":
            continue
        out.append(f"| {r['label']} | {r['load_device']} | {r['offload_device']} | "
                   f"{r['batch_size']} | {r['gpu_peak_alloc_gib']} | "
                   f"{r['gpu_peak_reserved_gib']} | {r['rss_peak_gib']} | {r['wall_s']:.1f} |")
    return "\n".join(out)


def eval_table(data: dict[str, Any]) -> str:
    ev = data.get("eval") or {}
    head = ["loss computed by", "batch", "window", "tokens", "s", "tokens/s", "floor s",
            "×floor", "GPU peak GiB"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in ev.get("rows", []):
        if "seconds" not in r:
            continue
        out.append(f"| {r['method']} | {r['batch']} | {r['seq_len']} | {r['tokens']} | "
                   f"{r['seconds']} | {r['tokens_per_s']} | {r.get('floor_s')} | "
                   f"{r.get('x_floor')} | {r['gpu_peak_gib']} |")
    return "\n".join(out)


def quality_table(data: dict[str, Any]) -> str:
    q = data.get("quality_cpu") or {}
    head = ["setting", "batch", "samples", "wiki-eval ppl", "GPTQ loss sum"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in q.get("rows", []):
        out.append(f"| {r['setting']} | {r.get('batch_size', '–')} | {r.get('samples', '–')} | "
                   f"{r['ppl']} | {r.get('gptq_loss_sum', '–')} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--save", type=Path, help="write the merged, compact results as YAML")
    a = p.parse_args()
    data = load(a.files)
    if a.save:
        a.save.write_text("# Raw results of bench/run_gpu.py (merged by bench/report.py)\n"
                          + yaml.safe_dump(compact(data), sort_keys=False, width=100))
    print("## Pipeline vs plain oneshot\n\n" + overhead_table(data))
    print("\n## Phases (seconds) and the compute floor\n\n" + phase_table(data))
    print("\n## Memory (gptq-int4, plain oneshot)\n\n" + memory_table(data))
    print("\n## Perplexity-evaluation throughput\n\n" + eval_table(data))
    if data.get("quality_cpu"):
        print("\n## Quality on the real default model (CPU)\n\n" + quality_table(data))


if __name__ == "__main__":
    main()
