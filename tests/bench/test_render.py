"""bench/render.py and bench/records.py: the results tables match their records, a stale
table is caught, and the records say what they were measured against."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import legacy, records, render, runner
from bench.jobs import Job, load_job


def test_every_results_table_in_the_repo_matches_its_records() -> None:
    stale = render.render(check=True)
    assert stale == [], f"run `python -m bench render`: {stale} are out of date"


def _job(**kw: Any) -> Job:
    base: dict[str, Any] = {
        "name": "t", "description": "d", "driver": "quant_run", "device": "cpu",
        "rows": [{"label": "a", "recipe": "gptq-int4"}, {"label": "x", "recipe": "r"},
                 {"label": "b", "recipe": "gptq-int4"}],
        "baseline": ["a", "b"], "measure": ["quantize_s"]}
    return Job.model_validate({**base, **kw})


def test_stale_table_is_reported_then_rewritten(tmp_path: Path) -> None:
    results = tmp_path / "results"
    job = _job()
    vals = {"a": {"quantize_s": 10.0}, "x": {"quantize_s": 15.0}, "b": {"quantize_s": 20.0}}
    rat = records.ratios(job, vals)
    dev = {"kind": "cpu", "name": "test cpu", "count": 2}
    recs = [records.make(job, "2026-01-01T00:00:00Z", k, v, rat[k], dev, {"torch": "9"})
            for k, v in vals.items()]
    records.append(recs, results)
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "x.md"
    doc.write_text("intro\n<!-- bench:table t -->\n| old | 1.00 |\n<!-- /bench:table -->\nend\n")
    render.TABLES["t"] = render.quantize_speed(("t",))
    try:
        assert render.render(check=True, root=tmp_path, results=results) == [doc]
        assert "| old |" in doc.read_text()  # --check writes nothing
        assert render.render(root=tmp_path, results=results) == [doc]
        text = doc.read_text()
        assert "15.00 s (1.00×)" in text and "| old |" not in text
        assert text.startswith("intro\n") and text.endswith("<!-- /bench:table -->\nend\n")
        assert render.render(check=True, root=tmp_path, results=results) == []
    finally:
        del render.TABLES["t"]


def test_unknown_table_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown table 'nope'"):
        render.render_text("<!-- bench:table nope -->\n<!-- /bench:table -->\n", "f.md",
                           tmp_path)


def test_ratios_against_the_same_runs_baseline() -> None:
    job = _job(measure=["quantize_s"])
    r = records.ratios(job, {"a": {"quantize_s": 10.0}, "x": {"quantize_s": 18.0},
                             "b": {"quantize_s": 14.0}})
    assert r == {"a": {}, "x": {"quantize_s": 1.5}, "b": {}}
    ppl = Job.model_validate({
        "name": "p", "description": "d", "driver": "consumer_ppl",
        "rows": [{"label": "bt", "loader": "transformers"}, {"label": "bl", "loader": "hf"},
                 {"label": "q", "loader": "hf", "recipe": "r", "against": ["bl"]}],
        "baseline": ["bt", "bl"], "measure": ["wiki_ppl"]})
    r = records.ratios(ppl, {"bt": {"wiki_ppl": 10.0}, "bl": {"wiki_ppl": 9.0},
                             "q": {"wiki_ppl": 10.0}})
    assert r["q"] == {"wiki_ppl": 0.9}  # a recovery, against its own loader's bf16


@pytest.mark.parametrize(("change", "message"), [
    ({"baseline": ["zz"]}, "not a row label"),
    ({"measure": ["wiki_ppl"]}, "does not measure"),
    ({"rows": [{"label": "a"}], "baseline": []}, "needs `recipe`"),
])
def test_inconsistent_job_is_refused(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _job(**change)


def test_shipped_jobs_load() -> None:
    names = {p.stem for p in (records.ROOT / "bench" / "jobs").glob("*.yaml")}
    assert {"quantize-speed-8b", "quantize-speed-moe12", "portable-candidates",
            "consumer-ppl", "make-quantize-cpu"} <= names
    for n in names:
        assert load_job(n).name == n


def test_run_job_writes_complete_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    job = _job()
    fake = {"a": {"quantize_s": 10.0}, "x": {"quantize_s": 12.0}, "b": {"quantize_s": 10.0}}
    monkeypatch.setitem(runner.DRIVERS, "quant_run", lambda j, w: fake)
    monkeypatch.setenv("QUANTIZE_COMMIT", "abc1234")
    path = runner.run_job(job, tmp_path)
    recs = records.read(path)
    assert [r["row"] for r in recs] == ["a", "x", "b"]
    x = recs[1]
    assert x["ratios"] == {"quantize_s": 1.2} and x["baseline"] == ["a", "b"]
    assert x["versions"]["quantize"] == "abc1234" and "torch" in x["versions"]
    assert x["device"]["kind"] == "cpu" and x["device"]["count"] >= 1
    # the same file again adds nothing; a copy from elsewhere is merged once
    out = tmp_path / "merged"
    assert records.add([path], out) == [out / "t.jsonl"]
    assert records.add([path], out) == []
    assert len(records.read(out / "t.jsonl")) == 3


def test_committed_records_are_the_raw_files_imported(tmp_path: Path) -> None:
    """No number of the imported records was typed by hand: importing the raw files again
    gives the same values and ratios."""
    made = {p.name for p in legacy.import_all(results=tmp_path)}
    for name in made:
        again = records.read(tmp_path / name)
        kept = [r for r in records.read(records.RESULTS / name)
                if r["run"] in {a["run"] for a in again}]
        strip = lambda rs: [(r["row"], r["values"], r["ratios"]) for r in rs]  # noqa: E731
        assert strip(again) == strip(kept), name


def test_record_check_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "x.jsonl"
    bad.write_text(json.dumps({"job": "x"}) + "\n")
    with pytest.raises(SystemExit, match=r"x\.jsonl:1: not a bench record"):
        records.read(bad)
