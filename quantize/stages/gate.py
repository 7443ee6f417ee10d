"""gate: turn eval results into a release verdict.

recovery = baseline/candidate for lower-is-better scores (perplexity) and
candidate/baseline for higher-is-better ones (accuracy); exp(-KL) for KL divergence and
1 - flip rate for answer flips (each kind's rule: quantize/recipe/metric_kinds.py); a metric
passes when recovery >= threshold.

Noise: baseline and candidate are scored on the same windows/examples, so the gate uses the
standard error of the *paired* per-item difference. A shortfall smaller than 1.96 SE is not
waved through: a blocking metric still fails, and its row says the shortfall is within noise
and that more examples would settle it; a pass within 1.96 SE of the threshold is marked too.
Nothing flips silently in either direction.
"""

from __future__ import annotations

import math
from pathlib import Path

from quantize.recipe.consumers import CONSUMERS, MAX_KL, row_name
from quantize.recipe.metric_kinds import METRIC_KINDS, MetricBase, MetricKind
from quantize.recipe.recipe import MetricSpec
from quantize.run.files import atomic_write_json, atomic_write_text
from quantize.run.results import EvalMetrics, GateResult, GateSummary, MetricRow
from quantize.textfmt import md_table

NAME = "gate"
Z = 1.96


def _kind(row: MetricRow) -> MetricKind:
    """The row's kind rule; a structural row (expert_coverage) is judged as a score of its
    direction."""
    known = METRIC_KINDS.get(row.kind or "")
    if known is not None:
        return known
    return MetricKind(row.kind or "?", "lower_is_better" if row.direction ==
                      "lower_is_better" else "higher_is_better", MetricBase)


def recovery(row: MetricRow) -> float:
    return _kind(row).recover(row.baseline, row.candidate)


def margin(row: MetricRow) -> tuple[float, float | None]:
    """(how far the candidate is above the threshold, the noise on that) in the metric's
    natural paired unit: log-perplexity for perplexity, accuracy points for accuracy, nats
    for KL divergence, items for answer flips (quantize/recipe/metric_kinds.py)."""
    return _kind(row).margin_of(row.baseline, row.candidate, row.threshold), row.diff_se


def judge(row: MetricRow) -> MetricRow:
    """Add recovery, verdict and a noise note to one metric row."""
    row = MetricRow.model_validate(row).model_copy()  # a row read as JSON, too
    row.recovery = recovery(row)
    m, se = margin(row)
    passed = row.recovery >= row.threshold
    note = ""
    if se is not None and se > 0 and abs(m) < Z * se:
        note = ("shortfall within noise (±{:.3g}); raise the example count to decide"
                if not passed else "pass within noise (±{:.3g})").format(Z * se)
    row.verdict = "pass" if passed else ("fail" if row.on_fail == "block" else "warn")
    row.note = note
    return row


def decide(metrics: list[MetricRow]) -> GateResult:
    rows = [judge(m) for m in metrics]
    failures = [r.name for r in rows if r.verdict == "fail"]
    warnings = [r.name for r in rows if r.verdict == "warn"]
    verdict = "fail" if failures else "pass"
    return GateResult(verdict=verdict, releasable=not failures, failures=failures,
                      warnings=warnings, rows=rows)


def markdown(result: GateResult) -> str:
    lines = [f"# Gate: {result.verdict.upper()}", "", *md_table(
        ("metric", "direction", "baseline", "candidate", "recovery", "threshold", "verdict",
         "note"),
        [(r.name, r.direction.replace("_", " "), f"{r.baseline:.4g}", f"{r.candidate:.4g}",
          f"{r.recovery:.2%}", f"{r.threshold:.2%}", r.verdict, r.note) for r in result.rows],
        right=(2, 3, 4, 5))]
    if result.failures:
        lines += ["", f"Blocking failures: {', '.join(result.failures)}. Not releasable.", "",
                  *(f"- {line}" for line in failure_lines(result))]
    return "\n".join(lines) + "\n"


def run(eval_result: EvalMetrics, out: Path) -> GateSummary:
    result = decide(eval_result.metrics)
    atomic_write_json(out / "gate.json", result.to_json())
    atomic_write_text(out / "gate.md", markdown(result))
    return result.summary()


def read_failures(gate_dir: Path) -> list[str]:
    """gate.json's blocking failures, one line each ([] when there is no gate.json)."""
    import json

    path = gate_dir / "gate.json"
    if not path.is_file():
        return []
    return failure_lines(GateResult.model_validate(json.loads(path.read_text())))


def read_eval(eval_dir: Path) -> EvalMetrics:
    """The eval stage's result (eval.json), as the gate reads it: its metric rows."""
    import json

    return EvalMetrics.model_validate(json.loads((eval_dir / "eval.json").read_text()))


def with_rules(ev: EvalMetrics, rules: dict[str, MetricSpec],
               consumers: tuple[str, ...] = ()) -> EvalMetrics:
    """The eval result with today's thresholds and on_fail rules (they may have changed since
    eval ran: the gate re-judges without re-measuring). A consumer the export is advertised
    for blocks when it loads the export wrong; one it is not advertised for only warns. An
    advertised consumer measured on this machine (not vLLM, which `quantize verify` checks)
    but missing from eval.json (an eval made before consumers were checked) fails: nothing
    vouches for it."""
    ev = EvalMetrics.model_validate(ev)  # an eval.json read as JSON, too
    for row in ev.metrics:
        if row.kind == "consumer_agreement":
            row.on_fail = "block" if row.name.split(":", 1)[1] in consumers else "warn"
            continue
        if row.name not in rules:  # a structural row with its own rule (expert_coverage)
            continue
        row.threshold = rules[row.name].threshold
        row.on_fail = rules[row.name].on_fail
    have = {r.name for r in ev.metrics}
    for c in consumers:
        if CONSUMERS[c].measured_by == "eval" and row_name(c) not in have:
            ev.metrics.append(MetricRow(
                name=row_name(c), kind="consumer_agreement", baseline=1.0, candidate=0.0,
                threshold=math.exp(-MAX_KL), settings={"load_error": (
                    "not measured: eval.json has no row for this consumer (re-run "
                    "`quantize eval --rerun eval`)")}))
    return ev


def failure_lines(result: GateResult) -> list[str]:
    """One line per blocking failure: a consumer's says what it computes and why."""
    from quantize.metrics.consumers import problem

    return [problem(r) if r.kind == "consumer_agreement" else
            f"{r.name}: recovery {r.recovery:.2%} below the threshold {r.threshold:.0%}"
            for r in result.rows if r.verdict == "fail"]
