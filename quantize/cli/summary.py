"""Human-readable summaries printed at the end of a run."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click
from rich.table import Table

from quantize.pipeline.stages import names
from quantize.progress import console
from quantize.run.results import ExportSummary, GateResult
from quantize.textfmt import human_bytes

if TYPE_CHECKING:
    from quantize.pipeline import Pipeline


def print_gate(result: GateResult) -> None:
    """The gate table; notes go under it, numbered, so that a narrow terminal (or a CI log,
    80 columns) still shows every metric's name and numbers on one line."""
    result = GateResult.model_validate(result)  # gate.json as read, too
    color = "green" if result.verdict == "pass" else "red"
    table = Table(title=f"gate: [{color}]{result.verdict.upper()}[/{color}]")
    for col in ("metric", "baseline", "candidate", "recovery", "threshold", "verdict"):
        table.add_column(col, no_wrap=True)
    notes: list[str] = []
    for r in result.rows:
        v = r.verdict
        vc = {"pass": "green", "fail": "red", "warn": "yellow"}[v]
        mark = ""
        if r.note:
            notes.append(f"({len(notes) + 1}) {r.name}: {r.note}")
            mark = f" ({len(notes)})"
        table.add_row(r.name, f"{r.baseline:.4g}", f"{r.candidate:.4g}",
                      f"{r.recovery:.2%}", f"≥ {r.threshold:.0%}",
                      f"[{vc}]{v}[/{vc}]{mark}")
    console.print(table)
    for note in notes:
        console.print(note)


def print_summary(pipe: Pipeline) -> None:
    stages = pipe.manifest.stages
    table = Table(title=f"run {pipe.run_dir}", show_lines=False)
    for col in ("stage", "status", "seconds", "result"):
        table.add_column(col)
    for name in names():  # pipeline order, not the order the manifest recorded them in
        entry = stages.get(name)
        if entry is None or name not in pipe.keys:
            continue
        s = entry.summary  # the one line each stage's result is known by
        result = s.get("verdict") or s.get("fingerprint", "")[:16] or s.get("format") or ""
        table.add_row(name, entry.status, f"{entry.duration_s:.1f}", str(result))
    console.print(table)
    gate_md = pipe.run_dir / "gate" / "gate.json"
    if "gate" in pipe.keys and gate_md.is_file():
        print_gate(GateResult.model_validate_json(gate_md.read_text()))
    export = pipe.manifest.stage("export")
    if export is not None and "export" in pipe.keys:
        before = sum(p.stat().st_size for p in pipe.model.path.glob("*.safetensors"))
        after = export.result(ExportSummary).weights_bytes
        console.print(f"weights on disk: {human_bytes(before)} → {human_bytes(after)} "
                      f"({before / after:.2f}× smaller)")
        click.echo(str(pipe.run_dir / "export"))
