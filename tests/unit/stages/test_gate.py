from __future__ import annotations

import math

import pytest

from quantize.recipe.metric_kinds import paired_se
from quantize.stages.gate import decide, judge, markdown, recovery


def row(name: str, b: float, c: float, t: float, direction: str = "higher_is_better",
        on_fail: str = "block", diff_se: float | None = None) -> dict:  # type: ignore[type-arg]
    return {"name": name, "baseline": b, "candidate": c, "threshold": t,
            "direction": direction, "on_fail": on_fail, "diff_se": diff_se}


def _recovery(b: float, c: float, direction: str, kind: str | None = None) -> float:
    from quantize.run.results import MetricRow

    return recovery(MetricRow.model_validate({**row("m", b, c, 0.9, direction), "kind": kind}))


def test_recovery_directions() -> None:
    assert _recovery(20.0, 25.0, "lower_is_better") == pytest.approx(0.8)
    assert _recovery(0.5, 0.45, "higher_is_better") == pytest.approx(0.9)
    assert _recovery(0.0, 0.1, "higher_is_better") == 1.0
    assert _recovery(10.0, 0.0, "lower_is_better") == 0.0
    assert _recovery(20.0, 25.0, "lower_is_better", "perplexity") == pytest.approx(0.8)
    assert _recovery(0.0, 0.1, "lower_is_better", "kl_divergence") == pytest.approx(
        math.exp(-0.1))
    assert _recovery(0.0, 0.1, "lower_is_better", "answer_flips") == pytest.approx(0.9)


def test_pass_fail_warn_and_all_failures_listed() -> None:
    result = decide([
        row("ppl", 20.0, 21.0, 0.9, "lower_is_better"),  # 95.2% >= 90%
        row("acc_a", 0.5, 0.3, 0.9),  # 60% < 90%: blocking failure
        row("acc_b", 0.5, 0.2, 0.9, on_fail="warn"),  # fails, but only warns
        row("acc_c", 0.4, 0.1, 0.8),  # second blocking failure
    ])
    assert result.verdict == "fail" and result.releasable is False
    assert result.failures == ["acc_a", "acc_c"]
    assert result.warnings == ["acc_b"]
    assert [r.verdict for r in result.rows] == ["pass", "fail", "warn", "fail"]
    md = markdown(result)
    assert "# Gate: FAIL" in md and "acc_a, acc_c" in md


def test_all_pass() -> None:
    result = decide([row("acc", 0.5, 0.5, 0.95), row("ppl", 10, 10.2, 0.95, "lower_is_better")])
    assert result.verdict == "pass" and result.releasable and not result.failures


def test_noise_never_flips_a_verdict_silently() -> None:
    # 1 point short of the threshold, with 3 points of paired noise: still fails, and says so
    r = judge(row("acc", 0.50, 0.44, 0.9, diff_se=0.03))
    assert r.verdict == "fail" and "within noise" in r.note
    # 1 point above with the same noise: passes, marked as within noise
    r = judge(row("acc", 0.50, 0.46, 0.9, diff_se=0.03))
    assert r.verdict == "pass" and "pass within noise" in r.note
    # far below: a plain failure
    r = judge(row("acc", 0.50, 0.20, 0.9, diff_se=0.03))
    assert r.verdict == "fail" and r.note == ""


def test_perplexity_noise_is_in_log_units() -> None:
    # needs log(c) <= log(b) - log(t): margin = log(10) - log(0.9) - log(11.2) = -0.0077
    r = judge(row("ppl", 10.0, 11.2, 0.9, "lower_is_better", diff_se=0.01))
    assert r.verdict == "fail" and "within noise" in r.note
    assert r.recovery == pytest.approx(10 / 11.2)


def test_paired_se() -> None:
    assert paired_se([1, 1, 1], [1, 1, 1]) == 0.0
    assert paired_se([1.0], [0.0]) is None
    se = paired_se([1, 0, 1, 0], [1, 1, 0, 0])
    assert se == pytest.approx(math.sqrt((2 / 3) / 4))


def test_the_printed_gate_keeps_names_whole_and_puts_notes_under_it() -> None:
    from quantize.cli.summary import print_gate
    from quantize.progress import console

    rows = [{"name": "general_knowledge", "baseline": 0.4571, "candidate": 0.4,
             "recovery": 0.875, "threshold": 0.9, "verdict": "fail",
             "note": "shortfall within noise (±0.0548); raise the example count to decide"},
            {"name": "wiki_ppl", "baseline": 17.94, "candidate": 18.22, "recovery": 0.9846,
             "threshold": 0.97, "verdict": "pass", "note": ""}]
    with console.capture() as cap:
        print_gate({"verdict": "fail", "rows": rows})
    text = cap.get()
    assert "general_knowledge" in text and "fail (1)" in text
    assert "(1) general_knowledge: shortfall within noise (±0.0548); raise the example count " \
           "to decide" in text
    assert "(2)" not in text
