"""The `expert_coverage` row of an MoE export: a structural check the gate reads like a metric
row (it is not an eval-suite kind: nothing is scored on text)."""

from __future__ import annotations

import time
from pathlib import Path

from quantize.run.results import (
    CoverageDetails,
    CoverageLayer,
    CoverageSummary,
    MetricRow,
)


def expert_coverage(export: Path) -> MetricRow | None:
    """The `expert_coverage` row of an MoE export (None for a dense one): 1.0 when every
    expert's exported scales are finite and every expert saw calibration data, else 0.0;
    blocking (an expert with NaN/Inf scales or never calibrated is a broken release). The
    gate judges it like any row (recovery = candidate/baseline >= threshold 1.0). All-zero
    scales and experts the router never picked are reported, not blocking: with
    llm-compressor's all-expert calibration every expert saw every token regardless."""
    from quantize.model.moe import check_expert_scales, read_coverage

    t0 = time.perf_counter()
    cov = read_coverage(export)
    scales = check_expert_scales(export)
    if cov is None and scales.experts == 0:
        return None
    problems = [f"{n}: NaN/Inf scales" for n in scales.nonfinite]
    if cov is not None:
        problems += [f"{e}: never calibrated (no routed token)" for e in cov.never_calibrated]
    value = 0.0 if problems else 1.0
    details = CoverageDetails(
        experts_checked=scales.experts, scale_tensors=scales.tensors,
        nonfinite_scales=scales.nonfinite, all_zero_scales=scales.all_zero,
        coverage=CoverageSummary.model_validate(cov.summary()) if cov is not None else None,
        layers=[CoverageLayer.model_validate(lay.model_dump(exclude={"counts"}))
                for lay in cov.layers] if cov else [],
        problems=problems)
    return MetricRow(name="expert_coverage", kind="expert_coverage",
                     direction="higher_is_better", baseline=1.0, candidate=value,
                     baseline_stderr=None, candidate_stderr=None, diff_se=None,
                     recovery=value, threshold=1.0, on_fail="block",
                     n=scales.experts, seconds=round(time.perf_counter() - t0, 2),
                     settings={}, details=details)
