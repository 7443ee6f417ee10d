"""`quantize compare`: one table and one plot across runs, to pick the recipe to ship."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from quantize.errors import ExportError, QuantizeError
from quantize.run.files import atomic_write_text
from quantize.run.manifest import RunFolder
from quantize.run.results import (
    EvalMetrics,
    ExportSummary,
    GateSummary,
    MetricRow,
    QuantizeSummary,
)
from quantize.textfmt import md_table

if TYPE_CHECKING:
    from quantize.report.answers import AnswerSheet


@dataclass
class CompareRow:
    """One run in the comparison."""

    run: str
    recipe: str
    weights_bytes: int
    baseline_bytes: int
    quantize_s: float
    engine: str
    peak_rss_gib: float | None
    eval_s: float
    ppl: float | None
    ppl_baseline: float | None
    ppl_recovery: float | None
    acc_recovery: float | None
    metrics: dict[str, MetricRow]
    verdict: str
    export_key: str
    model_path: str
    model_fingerprint: str | None
    answers: AnswerSheet | None = None  # --questions: the export's answers through vLLM
    baseline_answers: AnswerSheet | None = None  # and the 16-bit model's (first row only)


def _load(run_dir: Path) -> CompareRow:
    folder = RunFolder(run_dir)
    ev = EvalMetrics(metrics=[])
    try:
        manifest = folder.read() if folder.is_run() else None
        ev = EvalMetrics.model_validate(json.loads((run_dir / "eval" / "eval.json").read_text()))
    except (OSError, json.JSONDecodeError, ExportError, ValidationError):
        manifest = None
    quantize, export, evaluated = (manifest.stage(s) if manifest else None
                                   for s in ("quantize", "export", "eval"))
    if (manifest is None or manifest.model is None or manifest.recipe is None
            or quantize is None or export is None or evaluated is None):
        raise QuantizeError(path=run_dir, problem="needs manifest.json and eval/eval.json",
                            hint=f"run `quantize eval {run_dir}` first") from None
    gate_path = run_dir / "gate" / "gate.json"
    verdict = GateSummary.model_validate_json(gate_path.read_text()).verdict \
        if gate_path.is_file() else "not gated"
    metrics = {m.name: m for m in ev.metrics}
    acc = [m.recovery for m in ev.metrics if m.kind == "multiple_choice"]
    ppl = [m for m in ev.metrics if m.kind == "perplexity"]
    base_bytes = sum(p.stat().st_size for p in Path(manifest.model.path).glob("*.safetensors"))
    engine = QuantizeSummary.model_validate(quantize.summary)
    return CompareRow(
        run=run_dir.name, recipe=manifest.recipe.name,
        weights_bytes=ExportSummary.model_validate(export.summary).weights_bytes,
        baseline_bytes=base_bytes,
        quantize_s=quantize.duration_s,
        engine=engine.engine if engine.engine is not None else "?",
        peak_rss_gib=engine.peak_rss_gib,
        eval_s=evaluated.duration_s,
        ppl=ppl[0].candidate if ppl else None,
        ppl_baseline=ppl[0].baseline if ppl else None,
        ppl_recovery=ppl[0].recovery if ppl else None,
        acc_recovery=sum(acc) / len(acc) if acc else None,
        metrics=metrics, verdict=verdict,
        export_key=export.key, model_path=manifest.model.path,
        model_fingerprint=manifest.model.fingerprint)


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def markdown(rows: list[CompareRow]) -> str:
    names = sorted({n for r in rows for n in r.metrics})
    head = ["run", "recipe", "engine", "size MiB", "vs base", *[f"{n}" for n in names],
            "ppl recovery", "mean acc recovery", "quantize s", "peak RSS GiB", "gate"]
    asked = any(r.answers is not None for r in rows)
    if asked:
        head.insert(-1, "answers (vLLM)")
    table: list[list[str]] = []
    for r in rows:
        cells = [r.run, r.recipe, r.engine, f"{r.weights_bytes / 2**20:.1f}",
                 f"{r.baseline_bytes / r.weights_bytes:.2f}×"]
        for n in names:
            m = r.metrics.get(n)
            cells.append("—" if m is None else f"{m.candidate:.4g} ({m.recovery:.1%})")
        cells += [_fmt(r.ppl_recovery, ".1%"), _fmt(r.acc_recovery, ".1%"),
                  f"{r.quantize_s:.0f}", _fmt(r.peak_rss_gib, ".2f"), r.verdict]
        if asked:
            answered = r.answers
            cells.insert(-1, "—" if answered is None else f"{answered.right}/{answered.total}")
        table.append(cells)
    lines = md_table(head, table)
    base = rows[0]
    note = (f"\nBaseline: {base.baseline_bytes / 2**20:.1f} MiB"
            + (f", perplexity {base.ppl_baseline:.4g}" if base.ppl_baseline else "")
            + ". Recovery: perplexity baseline/candidate, accuracy candidate/baseline. "
            "Peak RSS: the run's process up to the end of its quantize stage.\n")
    if asked and base.baseline_answers is not None:
        sheet = base.baseline_answers
        note += ("Answers: simple factual questions (eval/questions/factual.yaml) asked "
                 f"through vLLM, greedy; the 16-bit model answers {sheet.right}/{sheet.total} "
                 "right.\n")
    return "\n".join(lines) + "\n" + note


def plot(rows: list[CompareRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    base = rows[0]
    ax.scatter([base.baseline_bytes / 2**20], [1.0], marker="*", s=200, c="black",
               label="baseline (16-bit)")
    for r in rows:
        y = r.ppl_recovery if r.ppl_recovery is not None else r.acc_recovery
        color = "tab:green" if r.verdict == "pass" else "tab:red"
        ax.scatter([r.weights_bytes / 2**20], [float("nan") if y is None else y], s=80,
                   c=color)
        label = r.recipe + (f"\nppl {r.ppl:.3g}" if r.ppl else "")
        if r.acc_recovery is not None:
            label += f", acc {r.acc_recovery:.0%}"
        ax.annotate(label, (r.weights_bytes / 2**20, y), textcoords="offset points",
                    xytext=(6, 4), fontsize=8)
    ax.set_xlabel("weights on disk (MiB)")
    ax.set_ylabel("perplexity recovery (baseline / candidate)")
    ax.set_title("size vs quality (green: gate passed, red: failed)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ask_all(rows: list[CompareRow], run_dirs: list[Path], out: Path) -> None:
    """The real-client check of every export and of the 16-bit model(s) they came from,
    cached in OUT/answers/ by export key (and model fingerprint for the 16-bit model)."""
    from quantize.report.answers import AnswerSheet, ask
    from quantize.vllm.host import detect

    host = detect()
    cache = out / "answers"
    cache.mkdir(parents=True, exist_ok=True)

    def cached(name: str, checkpoint: Path) -> AnswerSheet:
        path = cache / f"{name}.json"
        if path.is_file():
            return AnswerSheet.from_json(path.read_text())
        sheet = ask(checkpoint, cache / "logs" / name, host)
        atomic_write_text(path, sheet.to_json())
        return sheet

    for row, d in zip(rows, run_dirs, strict=True):
        row.answers = cached(f"export-{row.export_key[:16]}", d / "export")
    base = rows[0]
    base.baseline_answers = cached(f"model-{(base.model_fingerprint or '')[:16]}",
                                   Path(base.model_path))


def compare(run_dirs: list[Path], out: Path, questions: bool = False) -> list[CompareRow]:
    if not run_dirs:
        raise QuantizeError(problem="no run folder given", hint="give at least one run folder")
    rows = [_load(d) for d in run_dirs]
    out.mkdir(parents=True, exist_ok=True)
    if questions:
        _ask_all(rows, run_dirs, out)
    atomic_write_text(out / "compare.md", markdown(rows))
    plot(rows, out / "compare.png")
    return rows
