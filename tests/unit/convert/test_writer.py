"""quantize.convert.writer: a fixed shard plan and a progress record that only reuses
shards whose bytes still match."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from quantize.convert.shards import TensorGroup
from quantize.convert.writer import INDEX, PROGRESS, ResumableWriter, plan_shards

GROUPS = [TensorGroup((f"t{i}",), 100) for i in range(5)]


def test_plan_cuts_by_estimated_bytes() -> None:
    plan = plan_shards(GROUPS, lambda g: g.nbytes, max_bytes=250)
    assert [len(c) for c in plan.groups] == [2, 2, 1]
    assert plan.files[0] == "model-00001-of-00003.safetensors"
    assert plan_shards(GROUPS, lambda g: g.nbytes, 10_000).files == ("model.safetensors",)
    # a group larger than a shard gets one of its own
    assert [len(c) for c in plan_shards(GROUPS, lambda g: 500, 250).groups] == [1] * 5


def _write_all(w: ResumableWriter) -> None:
    for i, chunk in enumerate(w.plan.groups):
        if not w.is_done(i):
            w.write(i, {g.names[0]: torch.full((4,), float(i)) for g in chunk},
                    [g.names[0] for g in chunk])


def test_resume_reuses_only_matching_shards(tmp_path: Path) -> None:
    plan = plan_shards(GROUPS, lambda g: g.nbytes, 250)
    w = ResumableWriter(tmp_path, {"k": 1}, plan)
    _write_all(w)
    assert w.finish()[-1] == INDEX
    again = ResumableWriter(tmp_path, {"k": 1}, plan)
    assert again.resumed == list(plan.files)
    (tmp_path / plan.files[1]).write_bytes(b"torn")
    torn = ResumableWriter(tmp_path, {"k": 1}, plan)
    assert torn.resumed == [plan.files[0], plan.files[2]]
    other = ResumableWriter(tmp_path, {"k": 2}, plan)  # another conversion: start over
    assert other.resumed == [] and not (tmp_path / plan.files[0]).exists()
    assert json.loads((tmp_path / PROGRESS).read_text())["key"] == {"k": 2}
