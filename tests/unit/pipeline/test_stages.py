"""The stages, declared once (quantize/pipeline/stages.py): every one has its CLI command with
the declared help, its Makefile target and its disk need; a stage added to the declaration is
run, recorded and skipped by the pipeline with nothing else edited."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from quantize.cli.app import main
from quantize.errors import QuantizeError
from quantize.pipeline import Pipeline, stages
from quantize.pipeline.disk import DiskContext
from quantize.recipe.paths import PROJECT_ROOT
from quantize.run.manifest import Manifest, RunFolder
from quantize.run.results import Record


def test_each_stage_has_its_command_target_and_disk_need(tmp_path: Path) -> None:
    make = (PROJECT_ROOT / "Makefile").read_text()
    targets = {t for line in make.splitlines() if (m := re.match(r"^([\w .-]+):", line))
               for t in m.group(1).split()}
    assert stages.names() == ("calibrate", "quantize", "export", "eval", "gate")
    for st in stages.PIPELINE:
        cmd = main.commands[st.name]
        assert cmd.help == st.help
        assert st.name in targets, f"no Makefile target for {st.name}"
        params = {p.name for p in cmd.params}
        assert ("run_dir" in params) == (st.takes == "run")
    rerun = next(p for p in main.commands["run"].params if p.name == "rerun")
    assert list(rerun.type.choices) == [*stages.names(), "all"]  # type: ignore[attr-defined]
    ctx = DiskContext(tmp_path, tmp_path, tmp_path, None, None, None, None, "cpu",  # type: ignore[arg-type]
                      (4, 16), 2)
    assert [n.what for n in stages.PIPELINE[0].disk(ctx)] == ["calibrate"]
    ev = next(st for st in stages.PIPELINE if st.name == "eval")
    assert [n.what for n in ev.disk(ctx)] == ["eval", "baseline cache"]


def test_upto_names_the_stages_and_refuses_an_unknown_one() -> None:
    assert [st.name for st in stages.upto("export")] == ["calibrate", "quantize", "export"]
    with pytest.raises(QuantizeError) as err:
        stages.upto("evaluate")
    assert err.value.problem == "unknown stage 'evaluate'"
    assert err.value.hint is not None and "calibrate, quantize, export" in err.value.hint


class _FakeSummary(Record):
    words: int


def _fake_pipeline(run_dir: Path, rerun: tuple[str, ...] = ()) -> Pipeline:
    """A pipeline object with the state a stage reads, no model behind it."""
    from types import SimpleNamespace

    pipe = object.__new__(Pipeline)
    pipe.run_dir, pipe.keys = run_dir, {}
    pipe.manifest = Manifest()
    pipe.opts = SimpleNamespace(rerun=rerun)  # type: ignore[assignment]
    return pipe


def test_a_stage_added_to_the_declaration_is_run_recorded_and_skipped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []

    def plan(pipe: object) -> tuple[dict[str, object], object]:
        def execute(out: Path) -> _FakeSummary:
            calls.append(out)
            (out / "words.txt").write_text("one two three")
            return _FakeSummary(words=3)

        return {"text": "one two three"}, execute

    fake = stages.Stage("count", "Count words.", plan, lambda c: [])  # type: ignore[arg-type]
    monkeypatch.setattr(stages, "PIPELINE", (*stages.PIPELINE, fake))
    assert stages.names()[-1] == "count"
    pipe = _fake_pipeline(tmp_path)
    pipe._stage(fake)
    rec = RunFolder(tmp_path).read().stage("count")
    assert rec is not None and rec.result(_FakeSummary).words == 3
    assert (tmp_path / "count" / "words.txt").read_text() == "one two three"
    assert pipe.keys["count"] == rec.key
    pipe._stage(fake)  # unchanged: skipped
    assert len(calls) == 1
    _fake_pipeline(tmp_path, rerun=("count",))._stage(fake)  # --rerun count: runs again
    assert len(calls) == 2
