"""bench/vllm_gpu.py's job queue: shared jobs run side by side, an `alone` job waits for the
GPU to be idle and holds it, a job whose input failed is skipped, timeouts are recorded."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench import vllm_gpu


def _job(name: str, code: str, **kw: object) -> vllm_gpu.Job:
    return vllm_gpu.Job(name, [sys.executable, "-c", code], **kw)  # type: ignore[arg-type]


def test_queue_order_alone_and_failures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                        ) -> None:
    monkeypatch.setattr(vllm_gpu, "WORK", tmp_path)
    span = ("import time; t=time.time(); time.sleep(0.6); "
            "open('{f}','a').write('{n} %f %f\\n' % (t, time.time()))")
    f = tmp_path / "spans.txt"
    q = [_job("a", span.format(f=f, n="a")), _job("b", span.format(f=f, n="b")),
         _job("solo", span.format(f=f, n="solo"), alone=True),
         _job("bad", "raise SystemExit('ValueError: no kernel for this format')"),
         _job("after-bad", "pass", needs=["bad"]),
         _job("slow", "import time; time.sleep(30)", timeout=1),
         _job("c", span.format(f=f, n="c"), needs=["solo"])]
    vllm_gpu.run_queue(60, q)
    spans = {ln.split()[0]: (float(ln.split()[1]), float(ln.split()[2]))
             for ln in f.read_text().splitlines()}
    assert spans["a"][0] < spans["b"][1] and spans["b"][0] < spans["a"][1]  # side by side
    assert spans["solo"][0] >= max(spans["a"][1], spans["b"][1])  # waited for the GPU
    assert spans["c"][0] >= spans["solo"][1]
    st = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "state").glob("*.json")}
    assert st["bad"]["ok"] is False and "no kernel" in st["bad"]["error"]
    assert "skipped" in st["after-bad"] and st["slow"]["error"] == "timeout"
    assert json.loads((tmp_path / "DONE").read_text()) == []
    # a second run resumes: every job has a state, nothing runs again
    vllm_gpu.run_queue(60, q)
    assert len(f.read_text().splitlines()) == 4


def test_a_session_runs_the_rows_it_names_with_what_they_need() -> None:
    queue = [_job("a", "pass"), _job("b", "pass", needs=["a"]), _job("c", "pass"),
             _job("d", "pass", needs=["b", "vllm"])]
    assert [j.name for j in vllm_gpu.select(queue, "d")] == ["a", "b", "d"]
    assert [j.name for j in vllm_gpu.select(queue, "c, x*")] == ["c"]
    assert vllm_gpu.select(queue, "") == queue
