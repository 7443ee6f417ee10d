"""Streaming reader over a safetensors folder: every shard's header checked before any work,
then the tensors handed out one group at a time (a weight with the side tensors it needs,
wherever they are stored), so memory stays near the largest group however big the model.

A group is a primary tensor plus its dependencies, as the converter names them (e.g.
`x.weight` -> {`x.weight_scale_inv`}): the index says which shard holds each one, so a
scale stored in another shard than its weight is found without reading either shard whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from quantize.errors import ModelError
from quantize.model.formats import TensorInfo, folder_tensors

# side tensors that cannot stand alone: stored without their weight, the checkpoint is broken
ORPHAN_SUFFIXES = ("qzeros", "scales", "g_idx", "weight_scale_inv", "weight_scale",
                   "weight_zero_point", "weight_shape", "weight_g_idx")


@dataclass(frozen=True)
class TensorGroup:
    """One primary tensor and its dependencies, in a stable order (primary first)."""

    names: tuple[str, ...]
    nbytes: int


class SourceShards:
    """A validated safetensors folder: headers read and checked on construction."""

    def __init__(self, folder: Path, tensors: dict[str, TensorInfo] | None = None) -> None:
        self.folder = Path(folder)
        self.tensors = tensors if tensors is not None else folder_tensors(self.folder)
        if not self.tensors:
            raise ModelError(problem="holds no tensors", path=self.folder, path_sep=" ",
                             hint="pass a model folder with safetensors weights")

    @property
    def names(self) -> set[str]:
        return set(self.tensors)

    def groups(self, deps: Callable[[str], set[str]]) -> list[TensorGroup]:
        """Every tensor in exactly one group, in storage order (file, then offset): a tensor
        some other tensor depends on rides with that one; a dependency that is not stored is
        refused here, before any work."""
        needed: dict[str, set[str]] = {}
        for name in self.tensors:
            d = {x for x in deps(name) if x != name}
            missing = sorted(x for x in d if x not in self.tensors)
            if missing:
                raise ModelError(problem=f"tensor {name!r} needs {missing[0]!r}, which no "
                                 "shard holds", path=self.folder,
                                 hint="re-download the checkpoint (a shard or the index is "
                                      "incomplete)")
            needed[name] = d
        partner = set().union(*needed.values()) if needed else set()
        order = sorted(self.tensors.values(), key=lambda t: (t.file, t.start))
        out: list[TensorGroup] = []
        seen: set[str] = set()
        for info in order:
            if info.name in partner:
                continue
            names = (info.name, *sorted(needed[info.name]))
            dup = seen.intersection(names)
            if dup:
                raise ModelError(problem=f"tensor {sorted(dup)[0]!r} belongs to two weights",
                                 path=self.folder, hint="the checkpoint is inconsistent")
            seen.update(names)
            out.append(TensorGroup(names, sum(self.tensors[n].nbytes for n in names)))
        orphans = sorted(set(self.tensors) - seen) or sorted(
            g.names[0] for g in out if len(g.names) == 1 and
            g.names[0].rpartition(".")[2] in ORPHAN_SUFFIXES)
        if orphans:
            raise ModelError(problem=f"side tensor {orphans[0]!r} has no weight it belongs "
                             "to", path=self.folder, hint="the checkpoint is inconsistent")
        return out

    def load(self, names: tuple[str, ...] | list[str]) -> dict[str, torch.Tensor]:
        """The named tensors, each read alone from its shard (safe_open reads one tensor's
        bytes, not the file)."""
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.tensors[n].file, []).append(n)
        out: dict[str, torch.Tensor] = {}
        for file, tnames in by_file.items():
            with safe_open(str(self.folder / file), framework="pt") as f:
                for n in tnames:
                    out[n] = f.get_tensor(n)
        return {n: out[n] for n in names}

    def largest_group_bytes(self, groups: list[TensorGroup]) -> int:
        return max((g.nbytes for g in groups), default=0)
