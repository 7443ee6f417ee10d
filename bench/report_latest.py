"""The issue-20 section of bench/RESULTS.md, generated from bench/results/latest.json.

  python -m bench.report_latest bench/results/latest.json --results-md bench/RESULTS.md

Replaces the text between the `<!-- latest:begin -->` and `<!-- latest:end -->` markers
(inserted after the title the first time); the older sections below stay as they were.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

BEGIN, END = "<!-- latest:begin -->", "<!-- latest:end -->"
PHASES = ("load", "data", "forward", "hessian/stats", "act_cache", "solve/search",
          "compress+save", "pipeline", "other")


def _f(v: Any, fmt: str = "{:.1f}") -> str:
    return "–" if v is None else fmt.format(v)


def _ok(v: float | None, goal: float, lower: bool = True) -> str:
    if v is None:
        return "not measured"
    return "met" if (v <= goal if lower else v >= goal) else "not met"


def phase_rows(rows: list[tuple[str, dict[str, float] | None, float | None]]) -> list[str]:
    out = ["| row | wall s | " + " | ".join(PHASES) + " |", "|---" * (len(PHASES) + 2) + "|"]
    for name, ph, wall in rows:
        if ph:
            out.append(f"| {name} | {_f(wall)} | "
                       + " | ".join(_f(ph.get(k)) for k in PHASES) + " |")
    return out


def section(d: dict[str, Any]) -> str:
    g = d["gptq_int4_8b_128x2048"]
    ov = d["overhead"]
    rows_s = d.get("overhead_rows_s", {})
    pc = d.get("per_change_32x2048") or {}
    cpu = d.get("cpu_awq_vs_gptq") or {}
    mem = d.get("memory_placement_128x2048") or {}
    peak_ratio = (g["gpu_peak_gib_pipeline"] / g["gpu_peak_gib_oneshot_defaults"]
                  if g.get("gpu_peak_gib_pipeline") and g.get("gpu_peak_gib_oneshot_defaults")
                  else None)
    lines = [
        BEGIN,
        "## Issue 20 (generated from `bench/results/latest.json` by `bench/report_latest.py`)",
        "",
        f"Card: {d.get('gpu')}; bench date {d.get('date')}; versions: "
        + ", ".join(f"{k} {v}" for k, v in d.get("versions", {}).items()
                    if k != "quantize_source" and v)
        + f". Code: `{(d.get('versions', {}).get('quantize_source') or '').split()[0][:7]}`. "
        "Model: random-weight Llama-3.1-8B architecture (bench/make_model.py). "
        "Rows from several calls of the lent H200 (they do not fit one 10-minute call): "
        "`row_calls` in the JSON says which call measured each row; pairs compared in a "
        "goal were measured in the same call; `bench/latest.py --session-rows` laid the "
        "latest call's rows over the earlier ones.",
        "",
        "| goal | measured | target | |",
        "|---|---|---|---|",
        f"| 1. quantize stage, 8B, 128 × 2048 tokens, GPTQ W4A16 | pipeline wall "
        f"{_f(g.get('pipeline_wall_s'))} s (quantize stage {_f(g.get('pipeline_quantize_stage_s'))}"
        f" s); floor {_f(g.get('floor_s'))} s; plain oneshot, library defaults "
        f"{_f(g.get('oneshot_library_defaults_s'))} s | ≤ 60 s | "
        f"{_ok(g.get('pipeline_wall_s'), 60)} |",
        f"| 1. GPTQ loss, sum of 224 modules, pipeline / library defaults | "
        f"{_f(g.get('gptq_loss_ratio'), '{:.5f}')} | within 1 % | "
        + ("met" if g.get("gptq_loss_ratio") and abs(g["gptq_loss_ratio"] - 1) <= 0.01
           else "not measured") + " |",
    ]
    partner = d.get("overhead_partner") or {}
    for name in ("gptq-int4", "awq-int4", "w8a8-int8", "fp8-dynamic"):
        w = rows_s.get(name) or [None, None]
        p = " + ".join(_f(x) for x in w[0::2])
        o = " + ".join(_f(x) for x in w[1::2])
        how = (" with SDPA, like the pipeline" if "sdpa" in partner.get(name, "") else "")
        pairs = f", {len(w) // 2} pairs alternated" if len(w) > 2 else ""
        lines.append(f"| 2. overhead {name} (pipeline / oneshot, same settings{how}{pairs})"
                     f" | {_f(ov.get(name), '{:.3f}')} ({p} s / {o} s) | ≤ 1.05 | "
                     f"{_ok(ov.get(name), 1.05)} |")
    if ov.get("gptq-int4 32x2048") is not None:
        lines.append(f"| 2. overhead gptq-int4 at 32 × 2048, second call | "
                     f"{_f(ov['gptq-int4 32x2048'], '{:.3f}')} | ≤ 1.05 | "
                     f"{_ok(ov['gptq-int4 32x2048'], 1.05)} |")
    lines += [
        f"| 3. GPU peak, pipeline / plain oneshot (library defaults) | "
        f"{_f(g.get('gpu_peak_gib_pipeline'))} / {_f(g.get('gpu_peak_gib_oneshot_defaults'))} "
        f"GiB = {_f(peak_ratio, '{:.2f}')}× | ≤ 1.2× | {_ok(peak_ratio, 1.2)} |",
        f"| 3. the automatic trade-off: the memory check seeing a "
        f"{_f(mem.get('gpu_free_gib_seen'), '{:.0f}')} GiB card picks "
        f"`{mem.get('placement')}` | {_f(mem.get('wall_s'))} s, GPU peak "
        f"{_f(mem.get('gpu_peak_gib'))} GiB, GPTQ loss ratio to resident "
        f"{_f(mem.get('gptq_loss_ratio_vs_resident'), '{:.5f}')} | both measured | "
        + ("measured" if mem.get("wall_s") else "not measured") + " |",
        f"| 4. perplexity eval, lm-eval HF path s / ours s (best lm-eval run) | "
        f"{_f(d.get('eval_vs_lmeval'), '{:.2f}')}× | ≥ 2× | "
        f"{_ok(d.get('eval_vs_lmeval'), 2.0, lower=False)} |",
        f"| 5. CPU {cpu.get('awq_variant') or 'awq-int4'} / "
        f"{cpu.get('gptq_variant') or 'gptq-int4'} quantize stage (wiki_ppl "
        f"{_f(cpu.get('awq_wiki_ppl'), '{:.2f}')} / {_f(cpu.get('gptq_wiki_ppl'), '{:.2f}')})"
        f" | {_f(cpu.get('ratio'), '{:.2f}')} ({_f(cpu.get('awq_quantize_stage_s'))} s / "
        f"{_f(cpu.get('gptq_quantize_stage_s'))} s) | ≤ 3× | {_ok(cpu.get('ratio'), 3.0)} |",
    ]
    mq = d.get("make_quantize_cpu_s") or {}
    if mq:
        before = mq.get("before_stage_s") or {}
        lines.append(
            f"| issue 33, 4. `make quantize` on 2 CPU cores, model converted, eval and gate "
            f"included ({mq.get('date')}) | {_f(mq.get('warm_wall_s'))} s with the baseline's "
            f"scores cached, {_f(mq.get('cold_wall_s'))} s measuring them (quantize "
            f"{_f((mq.get('cold_stage_s') or {}).get('quantize'))} s, eval "
            f"{_f((mq.get('cold_stage_s') or {}).get('eval'))} s; before: quantize "
            f"{_f(before.get('quantize'), '{:.0f}')} s, eval {_f(before.get('eval'), '{:.0f}')}"
            f" s) | ≤ {_f(mq.get('target_s'), '{:.0f}')} s | "
            + ("met cached, not met cold" if (mq.get("warm_wall_s") or 1e9) <= mq["target_s"]
               < (mq.get("cold_wall_s") or 0) else _ok(mq.get("cold_wall_s"), mq["target_s"]))
            + " |")
    lines += [
        "",
        "Phases (s; `bench/profiler.py`, self time, GPU synchronised at each boundary):",
        "",
    ]
    lines += phase_rows([
        ("gptq pipeline 128×2048", g.get("phases_pipeline_s"), g.get("pipeline_wall_s")),
        (f"gptq pipeline 128×2048, `{mem.get('placement')}` (24 GiB card)",
         mem.get("phases_s"), mem.get("wall_s")),
        ("gptq oneshot library defaults 128×2048", g.get("phases_oneshot_defaults_s"),
         g.get("oneshot_library_defaults_s")),
        ("gptq oneshot knobs only 32×2048 (TF32, GPU activations, batch 8)",
         pc.get("phases_knobs_only_s"), pc.get("knobs_only_s")),
        ("gptq oneshot + bf16 Hessian + no mask 32×2048", pc.get("phases_same_settings_s"),
         pc.get("same_settings_s")),
    ])
    lines += ["", f"GPTQ loss ratio, + bf16 Hessian + no mask vs knobs only (32 × 2048): "
              f"{_f(pc.get('loss_ratio'), '{:.5f}')}.", "", END]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("latest", type=Path)
    p.add_argument("--results-md", type=Path, required=True)
    a = p.parse_args()
    text = section(json.loads(a.latest.read_text()))
    md = a.results_md.read_text()
    if BEGIN in md and END in md:
        head, rest = md.split(BEGIN, 1)
        md = head + text + rest.split(END, 1)[1]
    else:
        title, _, body = md.partition("\n")
        md = f"{title}\n\n{text}\n{body}"
    a.results_md.write_text(md)


if __name__ == "__main__":
    main()
