"""Metric kinds: one entry in THE kind table (quantize/recipe/metric_kinds.py) plus its scorer
(quantize/metrics/kinds.py); the suite, the eval rows and the gate take a new one with
nothing else edited."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import ValidationError

from quantize.errors import EvalError
from quantize.metrics import kinds
from quantize.recipe import metric_kinds
from quantize.recipe.recipe import EvalSuite, parse_metric, rebuild_suite
from quantize.run.results import MetricRow, Score, Scores
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


@pytest.mark.parametrize(("metric", "problem"), [
    ({**PPL, "top_k": 8}, ("perplexity", "top_k", "Extra inputs are not permitted")),
    ({**PPL, "task": "x"}, ("perplexity", "task", "Extra inputs are not permitted")),
    ({**GK, "seq_len": 64}, ("multiple_choice", "seq_len", "Extra inputs are not permitted")),
    ({**PPL, "score_from": 4}, ("perplexity", "score_from", "Extra inputs are not permitted")),
    ({**GK, "task": None}, ("multiple_choice", "task", "Input should be a valid string")),
    ({**PPL, "direction": "higher_is_better"},
     ("perplexity", "a perplexity metric is lower_is_better")),
    ({**PPL, "kind": "kl_divergence", "max_tokens": 65536, "top_k": 64},
     ("kl_divergence", "keeps more than 1,048,576 log-probabilities")),
    ({**PPL, "kind": "bleu"}, ("kind: Input should be 'perplexity', 'long_perplexity', "
                               "'multiple_choice', 'kl_divergence' or 'answer_flips'",)),
])
def test_each_kind_is_its_own_model(metric: dict[str, Any], problem: tuple[str, ...]) -> None:
    """A field of another kind is unknown to this one; the kind's own rules apply."""
    with pytest.raises(ValidationError) as err:
        parse_metric(metric)
    e = err.value.errors()[0]
    assert [str(p) for p in e["loc"]][:len(problem) - 1] == list(problem[:-1])
    assert problem[-1] in e["msg"]


def test_a_suite_file_names_the_line_and_field_without_the_kind_tag(tmp_path: Path) -> None:
    from quantize.errors import RecipeError
    from quantize.recipe.recipe import load_suite

    p = tmp_path / "s.yaml"
    p.write_text("name: s\nmetrics:\n  - name: ppl\n    kind: perplexity\n"
                 "    direction: lower_is_better\n    builtin: wiki-eval\n"
                 "    threshold: 0.9\n    top_k: 8\n")
    with pytest.raises(RecipeError) as err:
        load_suite(str(p))
    assert (err.value.line, err.value.problem) == (8, "metrics.0.top_k: unknown field")


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


class VocabSizeSpec(metric_kinds.MetricBase):
    """A fake kind: the tokenizer's size, higher is better."""

    kind: Literal["vocab_size"] = "vocab_size"
    at_least: int = 1


def test_a_new_kind_is_one_entry_in_each_table(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    """A fake kind added at run time: the suite validates it (its own field too), the hf
    engine scores it, the row and the gate read it, the vLLM engine says why not."""
    monkeypatch.setitem(metric_kinds.METRIC_KINDS, "vocab_size", metric_kinds.MetricKind(
        "vocab_size", "higher_is_better", VocabSizeSpec))

    def score(job: kinds.ScoreJob) -> Score:
        return Score(value=float(job.tokenizer), n=1, seconds=0.0)

    monkeypatch.setitem(kinds.SCORERS, "vocab_size",
                        kinds.Scorer(score, None, kinds.SCORERS["perplexity"].pair,
                                     no_vllm="a fake"))
    fake = {"name": "v", "kind": "vocab_size", "direction": "higher_is_better",
            "threshold": 0.9, "at_least": 3}
    try:
        rebuild_suite()
        suite = EvalSuite(name="s", metrics=[fake])
        assert isinstance(suite.metrics[0], VocabSizeSpec) and suite.metrics[0].at_least == 3
        job = kinds.ScoreJob(None, 100, suite.metrics[0], 1, tmp_path)
        base = _scores(v=kinds.SCORERS["vocab_size"].hf(job))  # type: ignore[misc]
        cand = _scores(v=Score(value=80.0, n=1, seconds=0.0))
        row = gate.judge(compare(suite, base, cand)[0])
        assert (row.recovery, row.verdict) == (0.8, "fail")
        assert kinds.vllm_problem(suite) == ("metric v (kind vocab_size) is scored by the hf "
                                             "engine only: a fake",
                                             "use --engine hf or a suite without it")
    finally:
        monkeypatch.undo()
        rebuild_suite()
    with pytest.raises(ValidationError, match="Input should be"):
        EvalSuite(name="s", metrics=[fake])


def test_suites_of_the_flat_model_keep_their_eval_keys() -> None:
    """A suite without the later kinds hashes as when every metric was one flat model
    (measured on the code before the kinds were split), so earlier runs are not re-scored."""
    from quantize.recipe.recipe import canonical_hash, load_suite
    from quantize.stages.eval import measured_settings

    assert canonical_hash(measured_settings(load_suite("smoke"))) == (
        "af989203e5c2e43ccbafe7527eb7926e0d4a50f3af1ea9a69d3e1b515993bab9")


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
    assert err.value.problem is not None and err.value.problem.startswith(
        "eval engine vllm (asked for): metric kld (kind kl_divergence) is scored by the hf "
        "engine only: ")
    assert err.value.hint == "use --engine hf or a suite without it"


def test_structural_rows_keep_the_ratio_rule() -> None:
    row = MetricRow(name="expert_coverage", kind="expert_coverage",
                    direction="higher_is_better", baseline=1.0, candidate=0.0, threshold=1.0)
    assert (gate.judge(row).recovery, gate.judge(row).verdict) == (0.0, "fail")
