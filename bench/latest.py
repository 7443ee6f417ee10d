"""`bench/results/latest.json`: the issue-20 figures, computed from one call's results.json.

run_gpu.py calls `write()` after every row of the `issue20` plan, so the file the call brings
back always holds what that call measured (a figure whose rows did not run is null, with the
reason under "missing"). `python -m bench.latest results.json --out latest.json` recomputes it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# goal-2 pairs: (recipe, pipeline row, oneshot row with the pipeline's engine settings)
PAIRS = [("gptq-int4", "gptq pipeline 128x2048", "gptq oneshot same-settings 128x2048"),
         ("awq-int4", "awq pipeline", "awq oneshot same-settings"),
         ("w8a8-int8", "w8a8 pipeline", "w8a8 oneshot same-settings"),
         ("fp8-dynamic", "fp8 pipeline", "fp8 oneshot same-settings")]
PIPE, SAME, KNOBS, DEFAULTS = ("gptq pipeline 128x2048", "gptq oneshot same-settings 128x2048",
                               "gptq oneshot knobs-only 128x2048",
                               "gptq oneshot library-defaults 128x2048")
# plain oneshot with the pipeline's settings including SDPA in the traced layers (the
# pipeline's GPU default since 2026-12-02): the like-for-like goal-2 partner of PIPE
SDPA_SAME = "gptq oneshot same-settings+sdpa 128x2048"
# a second fp8 pair, alternated with the first in the same call
FP8_B = ("fp8 pipeline b", "fp8 oneshot same-settings b")
# goal 3's other side: the same pipeline row when the memory check sees a 24 GiB card
MEMORY = "gptq pipeline 128x2048 24GiB card"
# bench/gpu_session.py's quant_run rows under the labels of bench/run_gpu.py's issue20 plan
SESSION_LABELS = {"8b-gptq-pipeline-128": PIPE, "8b-gptq-oneshot-same-128": SAME,
                  "8b-gptq-pipeline-24gib": MEMORY, "8b-fp8-pipeline": "fp8 pipeline",
                  "8b-fp8-oneshot": "fp8 oneshot same-settings",
                  "8b-gptq-pipeline-32": "gptq pipeline 32x2048",
                  "8b-gptq-oneshot-same-32": "gptq oneshot same-settings 32x2048",
                  "8b-gptq-oneshot-sdpa-128": SDPA_SAME, "8b-fp8-pipeline-b": FP8_B[0],
                  "8b-fp8-oneshot-b": FP8_B[1]}


def _r(x: float | None, n: int = 2) -> float | None:
    return None if x is None else round(x, n)


def _ratio(a: float | None, b: float | None, n: int = 3) -> float | None:
    return None if a is None or not b else round(a / b, n)


def build(results: dict[str, Any]) -> dict[str, Any]:
    env = results.get("env", {})
    by = {r["label"]: r for r in results.get("runs", []) if "wall_s" in r}
    missing = {r["label"]: r.get("error", "") for r in results.get("runs", [])
               if "wall_s" not in r}

    def get(label: str, key: str) -> Any:
        return by.get(label, {}).get(key)

    pipe = by.get(PIPE, {})
    floor = (pipe.get("floor") or by.get(SAME, {}).get("floor") or {}).get("floor_s")
    loss_p, loss_d = get(PIPE, "gptq_loss_sum"), get(DEFAULTS, "gptq_loss_sum")
    gptq = {
        "pipeline_quantize_stage_s": _r((pipe.get("stage_s") or {}).get("quantize")),
        "pipeline_wall_s": get(PIPE, "wall_s"),
        "oneshot_library_defaults_s": get(DEFAULTS, "wall_s"),
        "oneshot_same_settings_s": get(SAME, "wall_s"),
        "oneshot_knobs_only_s": get(KNOBS, "wall_s"),
        "floor_s": _r(floor),
        "gpu_peak_gib_pipeline": get(PIPE, "gpu_peak_alloc_gib"),
        "gpu_peak_gib_oneshot_defaults": get(DEFAULTS, "gpu_peak_alloc_gib"),
        "gpu_peak_gib_oneshot_same_settings": get(SAME, "gpu_peak_alloc_gib"),
        "gptq_loss_ratio": _ratio(loss_p, loss_d, 5),
        "gptq_loss_ratio_vs_same_settings": _ratio(loss_p, get(SAME, "gptq_loss_sum"), 5),
        "gptq_loss_ratio_vs_knobs_only": _ratio(loss_p, get(KNOBS, "gptq_loss_sum"), 5),
        "oneshot_same_settings_sdpa_s": get(SDPA_SAME, "wall_s"),
        "gpu_peak_gib_oneshot_same_settings_sdpa": get(SDPA_SAME, "gpu_peak_alloc_gib"),
        "gptq_loss_ratio_vs_same_settings_sdpa": _ratio(loss_p, get(SDPA_SAME,
                                                                    "gptq_loss_sum"), 5),
        "phases_pipeline_s": pipe.get("groups_s"),
        "phases_oneshot_defaults_s": by.get(DEFAULTS, {}).get("groups_s"),
        "phases_oneshot_knobs_only_s": by.get(KNOBS, {}).get("groups_s"),
    }
    pairs = [(n, p, SDPA_SAME if n == "gptq-int4" and SDPA_SAME in by else o)
             for n, p, o in PAIRS]
    rows_s: dict[str, list[float | None]] = {
        name: [get(p, "wall_s"), get(o, "wall_s")] for name, p, o in pairs}
    overhead = {name: _ratio(get(p, "wall_s"), get(o, "wall_s")) for name, p, o in pairs}
    if all(lb in by for lb in FP8_B):  # both fp8 pairs: the ratio of the sums
        rows_s["fp8-dynamic"] += [get(FP8_B[0], "wall_s"), get(FP8_B[1], "wall_s")]
        w = rows_s["fp8-dynamic"]
        overhead["fp8-dynamic"] = _ratio(sum(x or 0 for x in w[0::2]),
                                         sum(x or 0 for x in w[1::2]))
    if SDPA_SAME in by:
        overhead["gptq-int4 vs oneshot without SDPA"] = _ratio(get(PIPE, "wall_s"),
                                                               get(SAME, "wall_s"))
    overhead["gptq-int4 32x2048"] = _ratio(get("gptq pipeline 32x2048", "wall_s"),
                                           get("gptq oneshot same-settings 32x2048", "wall_s"))
    ev = results.get("eval_vs_lmeval") or {}
    cpu = results.get("cpu_awq_vs_gptq") or {}
    return {
        "gpu": env.get("gpu"), "date": env.get("date"),
        "versions": {k: env.get(k) for k in ("python", "torch", "transformers", "accelerate",
                                               "llmcompressor", "compressed-tensors",
                                               "safetensors", "quantize_source")},
        "plan": results.get("plan"),
        "gptq_int4_8b_128x2048": gptq,
        "overhead": overhead,
        "overhead_rows_s": rows_s,
        "overhead_partner": {name: o for name, _, o in pairs},
        "per_change_32x2048": {
            "knobs_only_s": get("gptq oneshot knobs-only 32x2048", "wall_s"),
            "same_settings_s": get("gptq oneshot same-settings 32x2048", "wall_s"),
            "phases_knobs_only_s": by.get("gptq oneshot knobs-only 32x2048", {}).get("groups_s"),
            "phases_same_settings_s": by.get("gptq oneshot same-settings 32x2048",
                                             {}).get("groups_s"),
            "loss_ratio": _ratio(get("gptq oneshot same-settings 32x2048", "gptq_loss_sum"),
                                 get("gptq oneshot knobs-only 32x2048", "gptq_loss_sum"), 5)},
        "memory_placement_128x2048": {
            "gpu_free_gib_seen": get(MEMORY, "gpu_free_gib_cap"),
            "placement": get(MEMORY, "gpu_placement"), "wall_s": get(MEMORY, "wall_s"),
            "gpu_peak_gib": get(MEMORY, "gpu_peak_alloc_gib"),
            "rss_peak_gib": get(MEMORY, "rss_peak_gib"),
            "gptq_loss_ratio_vs_resident": _ratio(get(MEMORY, "gptq_loss_sum"), loss_p, 5),
            "phases_s": by.get(MEMORY, {}).get("groups_s")},
        "batch1_128x2048": {"wall_s": get("gptq oneshot same-settings bs1 128x2048", "wall_s"),
                            "gpu_peak_gib": get("gptq oneshot same-settings bs1 128x2048",
                                                "gpu_peak_alloc_gib")},
        "row_calls": {r["label"]: r.get("call", "this call") for r in results.get("runs", [])
                      if "wall_s" in r},
        "eval_vs_lmeval": ev.get("lm_eval_over_quantize"),
        "eval_vs_lmeval_detail": {k: ev.get(k) for k in ("tokens", "seq_len", "batch",
                                                         "floor_s", "rows")} if ev else None,
        "cpu_awq_vs_gptq": {"awq_quantize_stage_s": cpu.get("awq_quantize_stage_s"),
                            "gptq_quantize_stage_s": cpu.get("gptq_quantize_stage_s"),
                            "ratio": _ratio(cpu.get("awq_quantize_stage_s"),
                                            cpu.get("gptq_quantize_stage_s"), 2),
                            **{k: cpu[k] for k in ("awq_variant", "gptq_variant",
                                                   "awq_quantize_cpu_s", "gptq_quantize_cpu_s",
                                                   "awq_wiki_ppl", "gptq_wiki_ppl",
                                                   "per_layer_vs_gptq_int4") if k in cpu},
                            "note": cpu.get("note", "not measured in this call (CPU goal 5)")},
        "missing": missing,
    }


def merge_session(results: dict[str, Any], rows: list[dict[str, Any]], setup: dict[str, Any],
                  when: str, source: str = "") -> dict[str, Any]:
    """Put a later gpu_session call's rows over an earlier results.json: rows with the same
    label are replaced (the new row keeps the old one's compute floor, a property of the
    card and the model, noting where it came from); `row_calls` then says which call
    measured each row, and `env` is the newer call's."""
    runs = {r["label"]: r for r in results.get("runs", [])}
    results = dict(results)
    for row in rows:
        if "compared" in row and not row.get("error"):  # bench/eval_vs_lmeval.py's row
            results["eval_vs_lmeval"] = {**row, "call": when}
            continue
        label = SESSION_LABELS.get(row.get("label", ""))
        if label is None or "wall_s" not in row or row.get("error"):
            continue
        old = runs.get(label, {})
        new = {**row, "label": label, "session_label": row["label"], "call": when}
        if "floor" in old and "floor" not in new:
            new["floor"] = {**old["floor"], "from_call": old.get("call", "earlier call")}
        runs[label] = new
    for r in runs.values():
        r.setdefault("call", results.get("env", {}).get("date", "earlier call"))
    env = {**results.get("env", {}), "date": when, "quantize_source": source,
           "gpu": setup.get("gpu") or
           results.get("env", {}).get("gpu"),
           **{k: setup[m] for k, m in (("torch", "torch"), ("transformers", "transformers"),
                                       ("llmcompressor", "llmcompressor"),
                                       ("compressed-tensors", "compressed_tensors"))
              if m in setup}}
    return {**results, "env": env, "earlier_env": results.get("env"),
            "runs": list(runs.values())}


def write(results: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(build(results), indent=1) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("results", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--session-rows", type=Path, default=None,
                   help="bench/gpu_session.py's rows.json to lay over RESULTS")
    p.add_argument("--session-setup", type=Path, default=None, help="its setup.json")
    p.add_argument("--when", default="", help="the session call's date (UTC)")
    p.add_argument("--source", default="", help="the commit the session call ran")
    p.add_argument("--cpu-awq", type=Path, default=None,
                   help="bench/awq_cpu.py's cpu_awq_vs_gptq block (JSON) for goal 5")
    p.add_argument("--merged-out", type=Path, default=None,
                   help="also write the merged results.json here")
    a = p.parse_args()
    results = json.loads(a.results.read_text())
    if a.cpu_awq:
        results["cpu_awq_vs_gptq"] = json.loads(a.cpu_awq.read_text())
    if a.session_rows:
        setup = json.loads(a.session_setup.read_text()) if a.session_setup else {}
        results = merge_session(results, json.loads(a.session_rows.read_text()), setup,
                                a.when, a.source)
        if a.merged_out:
            a.merged_out.write_text(json.dumps(results, indent=1) + "\n")
    write(results, a.out)


if __name__ == "__main__":
    main()
