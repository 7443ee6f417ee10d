"""What `quantize fit` prints and keeps: the assignment summary, predicted and measured
recovery, the planner's verdict, the `vllm serve` line, fit/fit.json in the run folder, and
the Pareto plot (size vs measured perplexity recovery) of fit runs against shipped recipes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantize.fit.assign import Assignment, Problem
from quantize.fit.budget import check_fit
from quantize.planner.memory import GIB
from quantize.run.files import atomic_write_json

FIT_FILE = "fit.json"  # in <run>/fit/


def assignment_lines(p: Problem, a: Assignment) -> list[str]:
    total = sum(n for n, _ in a.counts.values())
    parts = [f"{n}/{total} layers at {b} bits ({s / 1e6:,.1f} MB)"
             for b, (n, s) in a.counts.items()]
    pred = (f"predicted perplexity recovery {a.predicted_recovery:.1%} (exp(-sum KL) of the "
            "measured per-layer sensitivities)" if a.predicted_recovery is not None else
            "predicted recovery: none (no weights: a prior ranking, not a measurement)")
    return [f"assignment: {'; '.join(parts)}",
            f"weights: {a.size / 1e6:,.1f} MB ({a.size / GIB:.2f} GiB) of a "
            f"{p.budget.total / 1e6:,.1f} MB budget; embeddings, norms and lm_head "
            f"{p.units.fixed / 1e6:,.1f} MB at the model dtype", pred]


def planner_lines(p: Problem, a: Assignment, export: str) -> tuple[bool | None, list[str]]:
    """Whether it fits (planner) and the `vllm serve` line; (None, []) without --gpu."""
    s = p.budget.serving
    if s is None:
        return None, []
    ok, mem = check_fit(p.shape, s, a.size, p.units.replicated)
    verdict = (f"fits: yes - {mem.max_sequences} sequences of {s.context:,} tokens fit "
               f"(asked {s.concurrency}), weights {mem.weights / GIB:.2f} GiB per GPU"
               if ok else f"fits: no - room for {mem.max_sequences} of {s.concurrency} "
               "sequences")
    serve = (f"vllm serve {export} --tensor-parallel-size {s.gpus} --max-model-len {s.context} "
             f"--max-num-seqs {s.concurrency} --max-num-batched-tokens {s.batched} "
             f"--gpu-memory-utilization {s.util}" + (" --kv-cache-dtype fp8" if s.kv_fp8
                                                      else ""))
    return ok, [verdict, serve]


def unit_table(p: Problem, a: Assignment, costs: dict[str, dict[int, float]],
               limit: int = 12) -> list[str]:
    """The units kept above the lowest precision, most sensitive first."""
    low = p.units.units[0].choices[0].bits if p.units.units else 4
    kept = sorted((u for u in p.units.units if a.bits[u.name] != low),
                  key=lambda u: -costs[u.name][low])
    out = [f"  {u.name}: {a.bits[u.name]} bits (cost at {low} bits {costs[u.name][low]:.3g})"
           for u in kept[:limit]]
    if len(kept) > limit:
        out.append(f"  ... and {len(kept) - limit} more (fit/fit.json lists all)")
    return out


def record(folder: Path, p: Problem, a: Assignment, extra: dict[str, Any]) -> Path:
    path = folder / FIT_FILE
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {
        "model": p.source.spec, "base_recipe": p.base.name,
        "budget_bytes": p.budget.total, "budget_per_gpu": p.budget.per_gpu,
        "size_bytes": a.size, "predicted_recovery": a.predicted_recovery,
        "measured": a.measured, "counts": {str(b): list(v) for b, v in a.counts.items()},
        "bits": a.bits, **extra})
    return path


@dataclass(frozen=True)
class Point:
    label: str
    size: int
    recovery: float
    fit: bool


def ppl_recovery(run: Path) -> float | None:
    """The perplexity row's recovery from a run's gate/gate.json."""
    try:
        rows = json.loads((run / "gate" / "gate.json").read_text()).get("rows", [])
    except (OSError, json.JSONDecodeError):
        return None
    return next((float(r["recovery"]) for r in rows if r.get("kind") == "perplexity"), None)


def export_size(run: Path) -> int | None:
    files = list((run / "export").glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) if files else None


def collect(roots: list[Path]) -> list[Point]:
    """Every run folder under `roots` (one level, and one more for sweep folders) with an
    export and a gate result: fit runs (fit/fit.json) and shipped-recipe runs."""
    points, seen = [], set()
    for root in roots:
        for run in sorted([*root.glob("*/manifest.json"), *root.glob("*/*/manifest.json")]):
            folder = run.parent.resolve()
            if folder in seen:
                continue
            seen.add(folder)
            rec, size = ppl_recovery(folder), export_size(folder)
            if rec is None or size is None:
                continue
            is_fit = (folder / "fit" / FIT_FILE).is_file()
            points.append(Point(folder.name, size, rec, is_fit))
    return points


def pareto_plot(points: list[Point], out: Path, title: str) -> Path | None:
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for fit, marker, color, name in ((False, "o", "tab:blue", "shipped recipes"),
                                     (True, "*", "tab:red", "quantize fit")):
        pts = [p for p in points if p.fit == fit]
        if pts:
            ax.scatter([p.size / 1e6 for p in pts], [p.recovery for p in pts], marker=marker,
                       s=90 if fit else 40, color=color, label=name)
            for p in pts:
                ax.annotate(p.label, (p.size / 1e6, p.recovery), fontsize=6,
                            xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("export size (MB)")
    ax.set_ylabel("perplexity recovery (gate)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
