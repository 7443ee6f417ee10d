"""The measurements and verdicts the eval and gate stages write, typed: one metric's score
(quantize.metrics), a model's scores on a suite (the baseline cache), a metric row of
eval.json and gate.json, and the gate's result.

Each model is the JSON its file holds: `to_json()` writes exactly the keys that were set
(a key absent from a file stays absent, a null stays null) and unknown keys are kept, so a
file written before a field existed reads and rewrites unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_serializer

from quantize.recipe.recipe import CalibrationSpec

# what a metric measured with (seq_len, stride, task, limit, ...): scalars by metric kind
Settings = dict[str, int | float | str | None]
Scalar = int | float | str | bool | None


class Record(BaseModel):
    """A JSON record: exactly the keys it was built or read with."""

    model_config = ConfigDict(extra="allow")

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(exclude_unset=True)


# --- the summaries the stages hand the manifest -------------------------------------------
class CalibrationSummary(Record):
    """calibration.json, and the manifest's record of calibrate."""

    fingerprint: str
    num_samples: int
    seq_len: int
    tokens: int
    spec: CalibrationSpec

    @field_serializer("spec")
    def _whole_spec(self, spec: CalibrationSpec) -> dict[str, str | int | bool | None]:
        return spec.model_dump(mode="json")  # every field, defaults included


class MixedSummary(Record):
    """What a recipe's mixed_precision chose (quantize.fit.mixed): the units (fused shards
    together) raised to 8 bits, by measured sensitivity or by the data-free prior."""

    measured: bool
    budget_bytes: int
    uniform_bytes: int  # every layer at the recipe's scheme
    weights_bytes: int  # as planned (the export's own size is the export stage's)
    units: int
    units_high: list[str]
    predicted_recovery: float | None = None
    seconds: float


class QuantizeSummary(Record):
    """The engine's summary (quantize.backends: its keys differ by engine), the peak memory
    of the run and, for mixed_precision, what it chose."""

    engine: str | None = None
    peak_rss_gib: float | None = None
    mixed: MixedSummary | None = None


class ExportSummary(Record):
    weights_bytes: int
    quant_method: str
    format: str | None


# --- one metric on one model (quantize.metrics) -------------------------------------------
class Reference(Record):
    """kl_divergence on the baseline: its top_k log-probabilities at each scored position
    (token ids and values, most likely first), what the candidate is compared against."""

    ids: list[list[int]]
    logprobs: list[list[float]]


class Score(Record):
    """One metric's result on one model. Perplexity kinds set mean_nll, per_window_nll,
    window_tokens and tokens_per_s; multiple choice sets stderr, per_example and
    per_example_choice (the answer chosen); kl_divergence sets per_window (each window's
    mean KL) and, on the baseline, its reference."""

    value: float
    n: int
    seconds: float
    settings: Settings = Field(default_factory=dict)
    stderr: float | None = None
    mean_nll: float | None = None
    per_window_nll: list[float] | None = None
    window_tokens: list[int] | None = None
    per_example: list[float] | None = None
    per_example_choice: list[int] | None = None
    per_window: list[float] | None = None
    reference: Reference | None = None
    tokens_per_s: float | None = None

    def summary(self) -> Score:
        """The result without its per-item lists (eval.json keeps these; the baseline cache
        keeps the lists, for the paired noise)."""
        return Score.model_validate(self.model_dump(
            exclude_unset=True, exclude={"per_window_nll", "per_example", "per_example_choice",
                                         "per_window", "reference"}))


class VllmLoad(Record):
    """How the vLLM worker loaded a model it scored (eval.json `engine.vllm`)."""

    vllm_version: str | None = None
    quantization: str | None = None
    dtype: str | None = None
    kv_cache_dtype: str | None = None
    load_s: float | None = None
    engine_args: dict[str, Scalar] | None = None
    kernels: dict[str, int] | None = None  # "Method/Scheme/Kernel" -> layers (vllm_io)


VLLM_KEY = "_vllm"  # the scores file's entry for the vLLM load (not a metric)


@dataclass
class Scores:
    """Every metric of a suite on one model, and, scored by vLLM, how it loaded. On disk
    (the baseline cache): {metric: score, ..., "_vllm": load}."""

    metrics: dict[str, Score] = field(default_factory=dict)
    vllm: VllmLoad | None = None

    def to_json(self) -> dict[str, Any]:
        out = {name: s.to_json() for name, s in self.metrics.items()}
        return out if self.vllm is None else {**out, VLLM_KEY: self.vllm.to_json()}

    @classmethod
    def read(cls, path: Path) -> Scores:
        """A scores file (a baseline cache entry)."""
        data = json.loads(path.read_text())
        load = data.get(VLLM_KEY)
        return cls({k: Score.model_validate(v) for k, v in data.items() if k != VLLM_KEY},
                   VllmLoad.model_validate(load) if load is not None else None)


# --- MoE expert coverage (quantize.metrics.coverage) -------------------------------
class CoverageLayer(Record):
    layer: str
    experts: int
    top_k: int
    tokens: int
    min: int
    median: float
    max: int
    unrouted: list[int] = Field(default_factory=list)


class CoverageSummary(Record):
    layers: int
    experts: int
    min: int
    median: float
    max: int
    unrouted: int
    never_calibrated: int
    all_experts_calibrated: bool
    calibrated: bool


class CoverageDetails(Record):
    experts_checked: int
    scale_tensors: int
    nonfinite_scales: list[str]
    all_zero_scales: list[str]
    coverage: CoverageSummary | None
    layers: list[CoverageLayer]
    problems: list[str]


# --- eval.json and gate.json rows ---------------------------------------------------------
class MetricRow(Record):
    """One metric, baseline against candidate: eval.json's `metrics` row; the gate adds its
    verdict and note. The expert_coverage row also carries its seconds and details."""

    name: str
    kind: str | None = None
    direction: str = "higher_is_better"
    baseline: float
    candidate: float
    baseline_stderr: float | None = None
    candidate_stderr: float | None = None
    diff_se: float | None = None
    recovery: float = 0.0
    threshold: float
    on_fail: str = "block"
    n: int | None = None
    seconds: float | None = None
    settings: Settings = Field(default_factory=dict)
    details: CoverageDetails | None = None
    verdict: str = "?"
    note: str = ""


class EvalMetrics(Record):
    """eval.json as the gate reads it: its metric rows (the rest is kept as read)."""

    metrics: list[MetricRow]


class GateSummary(Record):
    """The manifest's record of the gate."""

    verdict: str
    failures: list[str] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)


class GateResult(GateSummary):
    """gate.json: the verdict and every row judged."""

    releasable: bool = False
    rows: list[MetricRow] = Field(default_factory=list)

    def summary(self) -> GateSummary:
        return GateSummary(verdict=self.verdict, failures=self.failures,
                           warnings=self.warnings)


# --- eval.json ----------------------------------------------------------------------------
class Throughput(Record):
    engine: str
    baseline_tokens_per_s: float | None = None
    candidate_tokens_per_s: float | None = None


class VllmLoads(Record):
    baseline: VllmLoad | None = None
    candidate: VllmLoad | None = None


class EngineInfo(Record):
    """The engine that scored an eval (quantize.stages.eval.engine.EngineChoice) as eval.json
    records it."""

    name: str
    requested: str | None = None
    reason: str | None = None
    tp: int = 1
    kv_cache_dtype: str = "auto"
    vllm_version: str | None = None
    device: str | None = None
    serve_dtype: str | None = None
    vllm: VllmLoads | None = None


class BaselineRef(Record):
    path: str
    fingerprint: str | None = None
    cached: bool = False
    results: dict[str, Score] = Field(default_factory=dict)


class CandidateRef(Record):
    path: str
    results: dict[str, Score] = Field(default_factory=dict)


class Timing(Record):
    baseline_s: float
    candidate_s: float


class EvalResult(EvalMetrics):
    """eval.json."""

    suite: str
    suite_sha256: str | None = None
    device: str
    engine: EngineInfo | None = None
    throughput: dict[str, Throughput] = Field(default_factory=dict)
    baseline: BaselineRef
    candidate: CandidateRef
    timing: Timing


class MetricBrief(Record):
    baseline: float
    candidate: float
    recovery: float


class EngineBrief(Record):
    name: str
    requested: str
    reason: str
    tp: int
    kv_cache_dtype: str
    # scored through vLLM: its version, where it ran, and the kernels it ran the candidate on
    # (quality that changes with the kernel is then traceable to it)
    vllm_version: str | None = None
    device: str | None = None
    kernels: dict[str, int] | None = None


class CoverageBrief(Record):
    coverage: CoverageSummary | None
    problems: list[str]
    experts_checked: int
    all_zero_scales: list[str]


class EvalSummary(Record):
    """The manifest's record of eval (an MoE export adds its expert coverage)."""

    metrics: dict[str, MetricBrief]
    expert_coverage: CoverageBrief | None = None
    engine: EngineBrief


def expert_coverage_lines(row: MetricRow) -> list[str]:
    """The eval report's and the card's words for the row."""
    d = MetricRow.model_validate(row).details  # a row read from an older eval.json, too
    if d is None:
        return []
    cov = d.coverage
    lines = [f"Expert coverage: {d.experts_checked} experts' scales checked, "
             f"{len(d.nonfinite_scales)} with NaN/Inf, {len(d.all_zero_scales)} "
             "all zero."]
    if cov:
        how = "every expert calibrated on every token" if cov.all_experts_calibrated \
            else "experts calibrated on their routed tokens only" if cov.calibrated \
            else "data-free recipe"
        lines.append(f"Routed tokens per expert over {cov.layers} MoE layers: min "
                     f"{cov.min}, median {cov.median:g}, max {cov.max}; "
                     f"{cov.unrouted} expert(s) got none ({how}).")
    lines += [f"- {p}" for p in d.problems]
    return lines
