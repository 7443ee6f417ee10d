"""Whether a stage runs, and why, as data (quantize.run.stage.Status), on fake stages: no
model, no pipeline, just inputs, an execute and the run folder."""

from __future__ import annotations

from pathlib import Path

from quantize.run import stage as S


def _execute(text: str):  # type: ignore[no-untyped-def]
    def run(out: Path) -> dict[str, object]:
        (out / "result.txt").write_text(text)
        return {"chars": len(text)}
    return run


def test_status_reasons_and_the_log_line(tmp_path: Path) -> None:
    inputs = {"a": 1, "b": "x"}
    assert S.status("fake", None, inputs, tmp_path / "fake", rerun=False).reason == "no-result"
    rec = S.build(tmp_path, "fake", inputs, _execute("hello"))
    assert rec.done and rec.summary == {"chars": 5} and set(rec.outputs) == {"result.txt"}
    up = S.status("fake", rec, inputs, tmp_path / "fake", rerun=False)
    assert up.reason == "up-to-date" and not up.must_run and up.key == rec.key
    assert S.status("fake", rec, inputs, tmp_path / "fake", rerun=True).reason == "rerun"
    changed = S.status("fake", rec, {"a": 2, "b": "x"}, tmp_path / "fake", rerun=False)
    assert (changed.reason, changed.changed) == ("inputs-changed", ("a",))
    assert changed.message() == "inputs changed (a)"
    (tmp_path / "fake" / "result.txt").write_text("tampered")
    broken = S.status("fake", rec, inputs, tmp_path / "fake", rerun=False)
    assert broken.reason == "outputs-changed" and "result.txt" in broken.detail


def test_deferred_inputs_are_only_resolved_against_a_finished_result(tmp_path: Path) -> None:
    asked: list[int] = []

    def slow() -> str:
        asked.append(1)
        return "fp"

    inputs = {"model": {"fingerprint": slow}}
    assert S.status("fake", None, inputs, tmp_path / "fake", rerun=False).reason == "no-result"
    assert asked == []  # nothing to compare with: not waited for
    rec = S.build(tmp_path, "fake", inputs, _execute("x"))
    assert rec.inputs == {"model": {"fingerprint": "fp"}} and asked == [1]
    assert S.status("fake", rec, inputs, tmp_path / "fake", rerun=False).must_run is False


def test_record_stage_runs_once_then_reuses(tmp_path: Path) -> None:
    calls: list[int] = []

    def execute(out: Path) -> dict[str, object]:
        calls.append(1)
        (out / "r.txt").write_text("r")
        return {"n": len(calls)}

    st, rec = S.record_stage(tmp_path, "verify", {"k": 1}, execute)
    assert st.reason == "no-result" and rec.summary == {"n": 1}
    st, rec = S.record_stage(tmp_path, "verify", {"k": 1}, execute)
    assert st.reason == "up-to-date" and rec.summary == {"n": 1} and calls == [1]
