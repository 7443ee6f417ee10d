"""Metric kinds: one entry in THE kind table (quantize/spec/metric_kinds.py) plus its scorer
(quantize/metrics/kinds.py); the suite, the eval rows and the gate take a new one with
nothing else edited."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from quantize.errors import EvalError
from quantize.metrics import kinds
from quantize.run.results import MetricRow, Score, Scores
from quantize.spec import metric_kinds
from quantize.spec.recipe import EvalSuite, MetricSpec
from quantize.stages import gate
from quantize.stages.eval import compare

PPL = {"name": "ppl", "kind": "perplexity", "direction": "lower_is_better",
       "builtin": "wiki-eval", "threshold": 0.8}
GK = {"name": "gk", "kind": "multiple_choice", "direction": "higher_is_better",
      "task": "bigbench:general_knowledge", "threshold": 0.8}
FLIPS = {"name": "flips", "kind": "answer_flips", "direction": "lower_is_better",
         "threshold": 0.8}


def test_every_kind_has_a_scorer_and_the_scorers_no_other_kind() -> None:
    assert set(kinds.SCORERS) == set(metric_kinds.METRIC_KINDS)
    for name, kind in metric_kinds.METRIC_KINDS.items():
        assert (kinds.SCORERS[name].hf is None) == (not kind.per_model), name


@pytest.mark.parametrize(("metric", "field"), [
    ({**PPL, "top_k": 8}, "top_k applies to kind kl_divergence only"),
    ({**PPL, "task": "x"}, "task applies to kind multiple_choice only"),
    ({**GK, "seq_len": 64}, "seq_len applies to kind "),
    ({**PPL, "direction": "higher_is_better"}, "a perplexity metric is lower_is_better"),
    ({**PPL, "score_from": 4}, "score_from applies to kind long_perplexity only"),
    ({**PPL, "kind": "kl_divergence", "max_tokens": 65536, "top_k": 64},
     "keeps more than 1,048,576 log-probabilities"),
])
def test_a_field_of_another_kind_is_refused_with_its_owner(metric: dict[str, Any],
                                                           field: str) -> None:
    with pytest.raises(ValidationError) as err:
        MetricSpec(**metric)
    assert field in str(err.value)


def test_answer_flips_pool_the_suites_multiple_choice_metrics() -> None:
    suite = EvalSuite(name="s", metrics=[PPL, GK, {**GK, "name": "gk2"}, FLIPS])
    assert suite.flips_of(suite.metrics[3]) == ["gk", "gk2"]
    with pytest.raises(ValidationError, match=r"\['ppl'\] is not one"):
        EvalSuite(name="s", metrics=[PPL, GK, {**FLIPS, "of": ["ppl"]}])
    with pytest.raises(ValidationError, match="none found"):
        EvalSuite(name="s", metrics=[PPL, FLIPS])


def _scores(**metrics: Score) -> Scores:
    out = Scores()
    out.metrics.update(metrics)
    return out


def test_divergence_rows_have_a_zero_baseline_and_their_own_recovery() -> None:
    kld = {"name": "kld", "kind": "kl_divergence", "direction": "lower_is_better",
           "builtin": "wiki-eval", "max_tokens": 4096, "threshold": 0.9}
    suite = EvalSuite(name="s", metrics=[GK, kld, FLIPS])
    base = _scores(gk=Score(value=0.5, n=4, seconds=0, per_example=[1, 0, 1, 0],
                            per_example_choice=[0, 1, 0, 1]),
                   kld=Score(value=0.0, n=8, seconds=0, per_window=[0.0, 0.0]))
    cand = _scores(gk=Score(value=0.25, n=4, seconds=0, per_example=[1, 0, 0, 0],
                            per_example_choice=[0, 1, 1, 1]),
                   kld=Score(value=0.05, n=8, seconds=0, per_window=[0.04, 0.06]))
    rows = {r.name: gate.judge(r) for r in compare(suite, base, cand)}
    k, f = rows["kld"], rows["flips"]
    assert (k.baseline, k.candidate, k.n) == (0.0, 0.05, 8)
    assert k.recovery == pytest.approx(math.exp(-0.05)) and k.verdict == "pass"
    assert k.diff_se == pytest.approx(0.01)  # the per-window KLs against zeros
    assert (f.baseline, f.candidate, f.recovery) == (0.0, 0.25, 0.75)
    assert f.verdict == "fail" and f.settings["right_to_wrong"] == 1
    assert f.baseline_stderr is None and f.diff_se == pytest.approx(0.25)


def test_a_new_kind_is_one_entry_in_each_table(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    """A fake kind, `vocab_size` (the tokenizer's size, higher is better), added at run time:
    the suite validates it, the hf engine scores it, the row and the gate read it."""
    monkeypatch.setitem(metric_kinds.METRIC_KINDS, "vocab_size", metric_kinds.MetricKind(
        "vocab_size", "higher_is_better", frozenset(), "the tokenizer's size"))

    def score(job: kinds.ScoreJob) -> Score:
        return Score(value=float(job.tokenizer), n=1, seconds=0.0)

    monkeypatch.setitem(kinds.SCORERS, "vocab_size",
                        kinds.Scorer(score, None, kinds.SCORERS["perplexity"].pair,
                                     no_vllm="a fake"))
    suite = EvalSuite(name="s", metrics=[{"name": "v", "kind": "vocab_size",
                                          "direction": "higher_is_better", "threshold": 0.9}])
    job = kinds.ScoreJob(None, 100, suite.metrics[0], 1, tmp_path)
    base = _scores(v=kinds.SCORERS["vocab_size"].hf(job))  # type: ignore[misc]
    cand = _scores(v=Score(value=80.0, n=1, seconds=0.0))
    row = gate.judge(compare(suite, base, cand)[0])
    assert (row.recovery, row.verdict) == (0.8, "fail")
    assert kinds.vllm_problem(suite) == ("metric v (kind vocab_size) is scored by the hf "
                                         "engine only: a fake; use --engine hf or a suite "
                                         "without it")
    monkeypatch.delitem(metric_kinds.METRIC_KINDS, "vocab_size")
    with pytest.raises(ValidationError, match="Input should be"):
        EvalSuite(name="s", metrics=[{"name": "v", "kind": "vocab_size",
                                      "direction": "higher_is_better", "threshold": 0.9}])


def test_the_vllm_engine_is_refused_before_any_model_loads(tmp_path: Path) -> None:
    from quantize.stages.eval import run
    from quantize.stages.eval.engine import EngineChoice

    kld = {"name": "kld", "kind": "kl_divergence", "direction": "lower_is_better",
           "builtin": "wiki-eval", "threshold": 0.9}
    suite = EvalSuite(name="s", metrics=[PPL, kld])
    choice = EngineChoice("vllm", "vllm", "asked for", vllm_python="/nonexistent/python")
    with pytest.raises(EvalError) as err:  # the paths do not exist: nothing was loaded
        run(tmp_path / "no-candidate", tmp_path / "no-base", "f", suite, "cpu", {},
            tmp_path, choice)
    assert "metric kld (kind kl_divergence) is scored by the hf engine only" in str(err.value)


def test_structural_rows_keep_the_ratio_rule() -> None:
    row = MetricRow(name="expert_coverage", kind="expert_coverage",
                    direction="higher_is_better", baseline=1.0, candidate=0.0, threshold=1.0)
    assert (gate.judge(row).recovery, gate.judge(row).verdict) == (0.0, "fail")
