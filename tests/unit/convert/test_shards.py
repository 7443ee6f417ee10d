"""quantize.convert.shards: groups resolved across shards from the index, missing or
orphan side tensors refused before any work, one tensor read at a time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures.convert_models import save_sharded

from quantize.convert.shards import SourceShards
from quantize.errors import ModelError


def _folder(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_sharded(tensors, tmp_path, lambda n: n.endswith("scale_inv"))
    return tmp_path


def _deps(name: str) -> set[str]:
    return {name.removesuffix("weight") + "weight_scale_inv"} if name.endswith("proj.weight") \
        else set()


def test_a_scale_in_another_shard_rides_with_its_weight(tmp_path: Path) -> None:
    f = _folder(tmp_path, {"a.proj.weight": torch.ones(4, 4), "a.proj.weight_scale_inv":
                           torch.full((1, 1), 2.0), "norm.weight": torch.ones(4)})
    src = SourceShards(f)
    groups = src.groups(_deps)
    assert [g.names for g in groups] == [("a.proj.weight", "a.proj.weight_scale_inv"),
                                         ("norm.weight",)]
    assert src.tensors["a.proj.weight_scale_inv"].file != src.tensors["a.proj.weight"].file
    loaded = src.load(groups[0].names)
    assert float(loaded["a.proj.weight_scale_inv"]) == 2.0
    assert src.largest_group_bytes(groups) == 4 * 4 * 4 + 4


def test_a_missing_dependency_is_refused(tmp_path: Path) -> None:
    f = _folder(tmp_path, {"a.proj.weight": torch.ones(4, 4), "b.weight_scale_inv":
                           torch.ones(1, 1)})
    with pytest.raises(ModelError, match=r"needs 'a.proj.weight_scale_inv', which no shard"):
        SourceShards(f).groups(_deps)


def test_an_orphan_side_tensor_is_refused(tmp_path: Path) -> None:
    f = _folder(tmp_path, {"a.weight": torch.ones(2), "b.qzeros": torch.ones(1)})
    with pytest.raises(ModelError, match=r"side tensor 'b.qzeros' has no weight"):
        SourceShards(f).groups(lambda _n: set())
