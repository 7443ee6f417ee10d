"""THE metric-kind table: what each `kind` of an eval-suite metric takes and how the gate
reads its numbers. Adding a kind is one entry here (its fields, its rules, its recovery)
plus its scorer in quantize/metrics/kinds.py; nothing else names kinds.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from quantize.spec.yamlio import one_of

Direction = Literal["lower_is_better", "higher_is_better"]

# Fields every metric takes; the rest belong to the kinds that list them.
COMMON_FIELDS = frozenset({"name", "kind", "direction", "threshold", "on_fail"})
TEXT_FIELDS = frozenset({"builtin", "path", "hub", "subset", "split", "text_field",
                         "max_tokens", "seq_len", "allow_external_path"})
CHOICE_FIELDS = frozenset({"task", "limit", "num_fewshot"})


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
    fields: frozenset[str]  # the MetricSpec fields it takes beyond COMMON_FIELDS
    doc: str
    check: Callable[[Any], str | None] = lambda spec: None  # its own rules: problem or None
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


def _text_rules(spec: Any) -> str | None:
    if sum(x is not None for x in (spec.builtin, spec.path, spec.hub)) != 1:
        return f"a {spec.kind} metric needs exactly one of builtin, path, hub"
    return None


def _perplexity(spec: Any) -> str | None:
    if spec.stride is not None and spec.stride > spec.seq_len:
        return f"stride {spec.stride} exceeds seq_len {spec.seq_len}; use a stride <= seq_len"
    return _text_rules(spec)


def _long(spec: Any) -> str | None:
    if spec.score_from is not None and spec.score_from >= spec.seq_len:
        return f"score_from {spec.score_from} must be below seq_len {spec.seq_len}"
    return _text_rules(spec)


def _choice(spec: Any) -> str | None:
    return None if spec.task is not None else "a multiple_choice metric needs `task`"


# The baseline's reference distribution is kept in the baseline cache: top_k log-probs per
# scored position. This bound keeps that entry under ~20 MB of JSON.
KLD_MAX_STORED = 1 << 20


def _kld(spec: Any) -> str | None:
    if spec.max_tokens * spec.top_k > KLD_MAX_STORED:
        return (f"max_tokens {spec.max_tokens} x top_k {spec.top_k} keeps more than "
                f"{KLD_MAX_STORED:,} log-probabilities of the baseline; lower one of them")
    return _text_rules(spec)


METRIC_KINDS: dict[str, MetricKind] = {k.name: k for k in (
    MetricKind("perplexity", "lower_is_better", TEXT_FIELDS | {"stride"},
               "token perplexity over (strided) windows of a text", _perplexity,
               unit="perplexity"),
    MetricKind("long_perplexity", "lower_is_better", TEXT_FIELDS | {"score_from"},
               "perplexity of each disjoint window's tokens past score_from (long context)",
               _long, unit="perplexity"),
    MetricKind("multiple_choice", "higher_is_better", CHOICE_FIELDS,
               "accuracy on an lm-eval multiple-choice task", _choice, unit="accuracy",
               percent=True),
    MetricKind("kl_divergence", "lower_is_better", TEXT_FIELDS | {"top_k"},
               "mean KL divergence of the candidate's next-token distribution from the "
               "baseline's, over the baseline's top_k tokens and the rest; recovery exp(-KL)",
               _kld, recovery=lambda b, c: math.exp(-(c - b)),
               margin=lambda b, c, t: -math.log(t) - (c - b), unit="KL divergence, nats"),
    MetricKind("answer_flips", "lower_is_better", frozenset({"of"}),
               "share of multiple-choice items whose chosen answer changes; recovery "
               "1 - flips", recovery=lambda b, c: 1.0 - (c - b),
               margin=lambda b, c, t: (1.0 - (c - b)) - t, per_model=False,
               unit="answer flips", percent=True),
)}


# the names a metric's `kind:` takes: the table's keys, looked up at validation
MetricKindName = one_of(METRIC_KINDS)


def kind_problem(spec: Any, fields_set: set[str]) -> str | None:
    """What is wrong with a metric's fields for its kind (None: nothing)."""
    kind = METRIC_KINDS[spec.kind]
    if spec.direction != kind.direction:
        return (f"a {spec.kind} metric is {kind.direction}; set direction accordingly")
    foreign = sorted(fields_set - COMMON_FIELDS - kind.fields)
    if foreign:
        owners = sorted(k.name for k in METRIC_KINDS.values() if foreign[0] in k.fields)
        return (f"{foreign[0]} applies to kind {' or '.join(owners) or 'none'} only; "
                "remove it")
    return kind.check(spec)


def paired_names(kinds: Mapping[str, str]) -> list[str]:
    """The multiple-choice metrics of a suite ({name: kind}), in order: what answer_flips
    pools when its `of` is not given."""
    return [n for n, k in kinds.items() if k == "multiple_choice"]
