"""THE metric-kind table: one model per kind (its own fields and rules; a suite's metrics are
their discriminated union on `kind`) and how the gate reads its numbers. Adding a kind is one
entry here (its model, its recovery) plus its scorer in quantize/metrics/kinds.py; nothing
else names kinds.

Two families:

- **scores** (perplexity, long_perplexity, multiple_choice): each model gets a value; the
  recovery is a ratio to the baseline (baseline/candidate when lower is better,
  candidate/baseline when higher is better).
- **divergences** (kl_divergence, answer_flips): how far the candidate's outputs moved from
  the baseline's, measured on the pair; the baseline's value is 0 and the recovery is a
  function of the candidate's value alone:
  - kl_divergence: exp(-KL). The candidate's perplexity on text drawn from the baseline
    itself is exp(H + KL) where the baseline's is exp(H), so exp(-KL) is exactly the
    perplexity recovery on the baseline's own text (0.90 = KL 0.105 nats per token).
  - answer_flips: 1 - flip rate, the share of multiple-choice answers the candidate keeps.

The gate's margin (how far above the threshold, in the unit its paired noise is in):
log-perplexity for perplexity, accuracy points for accuracy, nats for KL, items for flips.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

from quantize.recipe.strict import Name, Strict

Direction = Literal["lower_is_better", "higher_is_better"]


# --- one model per kind ------------------------------------------------------------------
class MetricBase(Strict):
    """What every metric of a suite has; its kind's model adds the rest."""

    name: Name
    kind: str
    direction: Direction
    threshold: float = Field(gt=0.0, le=2.0, description="minimum recovery (1.0 = no loss)")
    on_fail: Literal["block", "warn"] = "block"

    @model_validator(mode="after")
    def _direction(self) -> MetricBase:
        want = METRIC_KINDS[self.kind].direction
        if self.direction != want:
            raise ValueError(f"a {self.kind} metric is {want}; set direction accordingly")
        return self


class TextMetric(MetricBase):
    """A metric over token windows of a text: shipped, a file, or a Hub dataset."""

    builtin: Literal["wiki-eval", "novel"] | None = None
    path: str | None = None
    hub: str | None = None
    subset: str | None = None
    split: str = "test"
    text_field: str = "text"
    max_tokens: int = Field(default=16_384, ge=64)
    seq_len: int = Field(default=512, ge=16)
    allow_external_path: bool = Field(
        default=False, description="allow an absolute `path` or one that leaves the suite's "
        "folder")

    @model_validator(mode="after")
    def _one_source(self) -> TextMetric:
        if sum(x is not None for x in (self.builtin, self.path, self.hub)) != 1:
            raise ValueError(f"a {self.kind} metric needs exactly one of builtin, path, hub")
        return self


class PerplexitySpec(TextMetric):
    """Token perplexity over (strided) windows of a text."""

    kind: Literal["perplexity"] = "perplexity"
    stride: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _stride(self) -> PerplexitySpec:
        if self.stride is not None and self.stride > self.seq_len:
            raise ValueError(f"stride {self.stride} exceeds seq_len {self.seq_len}; use a "
                             "stride <= seq_len")
        return self


class LongPerplexitySpec(TextMetric):
    """Disjoint seq_len windows, scoring only positions >= score_from (long context)."""

    kind: Literal["long_perplexity"] = "long_perplexity"
    score_from: int | None = Field(
        default=None, ge=1, description="first scored position in each window (default "
        "seq_len // 2): only tokens with at least this much context count")

    @model_validator(mode="after")
    def _score_from(self) -> LongPerplexitySpec:
        if self.score_from is not None and self.score_from >= self.seq_len:
            raise ValueError(f"score_from {self.score_from} must be below seq_len "
                             f"{self.seq_len}")
        return self


# The baseline's reference distribution is kept in the baseline cache: top_k log-probs per
# scored position. This bound keeps that entry under ~20 MB of JSON.
KLD_MAX_STORED = 1 << 20


class KLDivergenceSpec(TextMetric):
    """Mean KL divergence of the candidate's next-token distribution from the baseline's,
    over the baseline's top_k tokens and the rest (quantize/metrics/divergence.py)."""

    kind: Literal["kl_divergence"] = "kl_divergence"
    top_k: int = Field(default=32, ge=1, le=1024, description="the baseline's most likely "
                       "tokens kept per position (the rest is one bucket)")

    @model_validator(mode="after")
    def _stored(self) -> KLDivergenceSpec:
        if self.max_tokens * self.top_k > KLD_MAX_STORED:
            raise ValueError(f"max_tokens {self.max_tokens} x top_k {self.top_k} keeps more "
                             f"than {KLD_MAX_STORED:,} log-probabilities of the baseline; "
                             "lower one of them")
        return self


class MultipleChoiceSpec(MetricBase):
    """Accuracy on an lm-eval multiple-choice task."""

    kind: Literal["multiple_choice"] = "multiple_choice"
    task: str = Field(description="an lm-eval task name (online), or `bigbench:<task>` for a "
                      "shipped task")
    limit: int | None = Field(default=None, ge=1)
    num_fewshot: int = Field(default=0, ge=0, le=25)


class AnswerFlipsSpec(MetricBase):
    """The share of multiple-choice items whose chosen answer changed."""

    kind: Literal["answer_flips"] = "answer_flips"
    of: list[Name] | None = Field(
        default=None, description="the suite's multiple_choice metrics it compares item by "
        "item (default: all of them)")


# --- the table ------------------------------------------------------------------------------
def _ratio_recovery(direction: Direction) -> Callable[[float, float], float]:
    def lower(b: float, c: float) -> float:
        return b / c if c > 0 else 0.0

    def higher(b: float, c: float) -> float:
        if b <= 0:
            return 1.0 if c >= b else 0.0
        return c / b

    return lower if direction == "lower_is_better" else higher


def _ratio_margin(direction: Direction) -> Callable[[float, float, float], float]:
    def lower(b: float, c: float, t: float) -> float:  # pass iff log c <= log b - log t
        return (math.log(b) - math.log(t)) - math.log(c)

    def higher(b: float, c: float, t: float) -> float:
        return c - t * b

    return lower if direction == "lower_is_better" else higher


@dataclass(frozen=True)
class MetricKind:
    """One kind of eval metric."""

    name: str
    direction: Direction  # the direction a metric of this kind must declare
    spec: type[MetricBase]  # its model (fields and rules)
    recovery: Callable[[float, float], float] | None = None  # (baseline, candidate)
    margin: Callable[[float, float, float], float] | None = None  # (b, c, threshold)
    per_model: bool = True  # False: computed from other metrics' paired items, no scoring
    unit: str = ""  # what the card and reports call its value (default: the kind's name)
    percent: bool = False  # its value reads as a share (accuracy, flips)

    def recover(self, baseline: float, candidate: float) -> float:
        f = self.recovery or _ratio_recovery(self.direction)
        return f(baseline, candidate)

    def margin_of(self, baseline: float, candidate: float, threshold: float) -> float:
        f = self.margin or _ratio_margin(self.direction)
        return f(baseline, candidate, threshold)


METRIC_KINDS: dict[str, MetricKind] = {k.name: k for k in (
    MetricKind("perplexity", "lower_is_better", PerplexitySpec, unit="perplexity"),
    MetricKind("long_perplexity", "lower_is_better", LongPerplexitySpec, unit="perplexity"),
    MetricKind("multiple_choice", "higher_is_better", MultipleChoiceSpec, unit="accuracy",
               percent=True),
    MetricKind("kl_divergence", "lower_is_better", KLDivergenceSpec,
               recovery=lambda b, c: math.exp(-(c - b)),
               margin=lambda b, c, t: -math.log(t) - (c - b), unit="KL divergence, nats"),
    MetricKind("answer_flips", "lower_is_better", AnswerFlipsSpec,
               recovery=lambda b, c: 1.0 - (c - b), margin=lambda b, c, t: (1.0 - (c - b)) - t,
               per_model=False, unit="answer flips", percent=True),
)}


def paired_se(base: list[float], cand: list[float]) -> float | None:
    """Standard error of the mean of the paired differences (None when not computable)."""
    if len(base) != len(cand) or len(base) < 2:
        return None
    d = [c - b for b, c in zip(base, cand, strict=True)]
    mean = sum(d) / len(d)
    var = sum((x - mean) ** 2 for x in d) / (len(d) - 1)
    return math.sqrt(var / len(d))


def paired_names(kinds: dict[str, str]) -> list[str]:
    """The multiple-choice metrics of a suite ({name: kind}), in order: what answer_flips
    pools when its `of` is not given."""
    return [n for n, k in kinds.items() if k == "multiple_choice"]
