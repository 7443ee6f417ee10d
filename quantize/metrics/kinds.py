"""THE scorer of each metric kind (the kinds themselves: quantize/recipe/metric_kinds.py): how
the hf engine scores it on a loaded model, which of the vLLM engine's two paths scores it
(prompt log-probabilities over token windows, or lm-eval's choices), and how a baseline and a
candidate score become the eval row's paired values. The eval stage and the vLLM engine look
kinds up here; adding a kind is one entry in each table."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from quantize.recipe.metric_kinds import (
    AnswerFlipsSpec,
    KLDivergenceSpec,
    MultipleChoiceSpec,
    TextMetric,
    paired_se,
)
from quantize.recipe.recipe import EvalSuite, MetricSpec
from quantize.run.results import Score, Scores, Settings


@dataclass
class ScoreJob:
    """What a kind's hf scorer gets: the loaded model, its tokenizer, the metric and, when
    the candidate is scored, the baseline's score of the same metric."""

    model: Any
    tokenizer: Any
    spec: MetricSpec
    batch_size: int
    workdir: Path
    baseline: Score | None = None  # None: this is the baseline


@dataclass
class Paired:
    """A metric's row values: the baseline's and the candidate's value, the per-item lists
    the gate's paired noise is computed from, and what the row says about its settings."""

    baseline: float
    candidate: float
    base_items: list[float] | None
    cand_items: list[float] | None
    n: int
    settings: Settings
    candidate_stderr: float | None = None


def _perplexity(job: ScoreJob) -> Score:
    from quantize.metrics import perplexity

    assert isinstance(job.spec, TextMetric)
    return perplexity(job.model, job.tokenizer, job.spec, job.batch_size)


def _choice(job: ScoreJob) -> Score:
    from quantize.metrics import multiple_choice

    assert isinstance(job.spec, MultipleChoiceSpec)
    return multiple_choice(job.model, job.tokenizer, job.spec, job.batch_size, job.workdir)


def _kld(job: ScoreJob) -> Score:
    from quantize.metrics import divergence

    assert isinstance(job.spec, KLDivergenceSpec)
    if job.baseline is None:
        return divergence.reference(job.model, job.tokenizer, job.spec)
    return divergence.divergence(job.model, job.tokenizer, job.spec, job.baseline)


def _scores(spec: MetricSpec, base: Scores, cand: Scores, items: Callable[[Score], Any]
            ) -> Paired:
    b, c = base.metrics[spec.name], cand.metrics[spec.name]
    return Paired(b.value, c.value, items(b), items(c), c.n, c.settings, c.stderr)


def _text_pair(spec: MetricSpec, suite: EvalSuite, base: Scores, cand: Scores) -> Paired:
    return _scores(spec, base, cand, lambda s: s.per_window_nll)


def _choice_pair(spec: MetricSpec, suite: EvalSuite, base: Scores, cand: Scores) -> Paired:
    return _scores(spec, base, cand, lambda s: s.per_example)


def _from_zero(value: float, items: list[float], n: int, settings: Settings) -> Paired:
    """A divergence's row: the baseline is 0 on every item by definition."""
    zeros = [0.0] * len(items)
    return Paired(0.0, value, zeros, items, n, settings, paired_se(zeros, items))


def _kld_pair(spec: MetricSpec, suite: EvalSuite, base: Scores, cand: Scores) -> Paired:
    c = cand.metrics[spec.name]
    return _from_zero(c.value, c.per_window or [], c.n, c.settings)


def _flips_pair(spec: MetricSpec, suite: EvalSuite, base: Scores, cand: Scores) -> Paired:
    from quantize.metrics.divergence import flips

    assert isinstance(spec, AnswerFlipsSpec)
    rate, per_item, settings = flips(suite.flips_of(spec), base.metrics, cand.metrics)
    return _from_zero(rate, per_item, len(per_item), settings)


@dataclass(frozen=True)
class Scorer:
    hf: Callable[[ScoreJob], Score] | None  # None: derived from other metrics (per_model)
    # the vLLM engine's path: its windows or lm-eval's choices, "derived" from other
    # metrics' items, None where the vLLM engine cannot score it (no_vllm says why)
    vllm: Literal["windows", "choices", "derived"] | None
    pair: Callable[[MetricSpec, EvalSuite, Scores, Scores], Paired]
    no_vllm: str = ""  # why the vLLM engine cannot score it


SCORERS: dict[str, Scorer] = {
    "perplexity": Scorer(_perplexity, "windows", _text_pair),
    "long_perplexity": Scorer(_perplexity, "windows", _text_pair),
    "multiple_choice": Scorer(_choice, "choices", _choice_pair),
    "kl_divergence": Scorer(
        _kld, None, _kld_pair,
        no_vllm="vLLM returns each position's own top log-probabilities, not the candidate's "
        "at the baseline's tokens"),
    "answer_flips": Scorer(None, "derived", _flips_pair),
}


def vllm_problem(suite: EvalSuite) -> tuple[str, str] | None:
    """Why the vLLM engine cannot score this suite and the fix, as an error's problem and
    hint (None: it can)."""
    for m in suite.metrics:
        s = SCORERS[m.kind]
        if s.vllm is None:
            return (f"metric {m.name} (kind {m.kind}) is scored by the hf engine only: "
                    f"{s.no_vllm}", "use --engine hf or a suite without it")
    return None
