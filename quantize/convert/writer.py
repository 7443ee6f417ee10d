"""Output shards written into a work folder that survives a crash: each finished shard is
recorded (file, sha256, the source tensors it came from) in a progress file, so a re-run of
the same conversion skips it. The shard plan is fixed before any work from the source's
headers, so a re-run writes the same files with the same names.

The work folder only becomes the output folder by one rename, once everything is written
and checked (quantize.convert.run); a reader never sees half a conversion.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from quantize.convert.shards import TensorGroup
from quantize.run.files import atomic_write_json, sha256_file

PROGRESS = ".convert-progress.json"
INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 4 << 30  # what transformers' save_pretrained defaults to (~4-5 GB)


@dataclass(frozen=True)
class ShardPlan:
    """Output shard file names and the source groups each one is made from."""

    files: tuple[str, ...]
    groups: tuple[tuple[TensorGroup, ...], ...]


def plan_shards(groups: list[TensorGroup], estimate: Callable[[TensorGroup], int],
                max_bytes: int = DEFAULT_SHARD_BYTES) -> ShardPlan:
    """Cut the groups, in order, into output shards of at most `max_bytes` (estimated output
    bytes; a group larger than that gets a shard of its own)."""
    chunks: list[list[TensorGroup]] = []
    size = 0
    for g in groups:
        est = estimate(g)
        if not chunks or (size + est > max_bytes and chunks[-1]):
            chunks.append([])
            size = 0
        chunks[-1].append(g)
        size += est
    n = len(chunks)
    files = ("model.safetensors",) if n == 1 else tuple(
        f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n))
    return ShardPlan(files, tuple(tuple(c) for c in chunks))


class ResumableWriter:
    """Writes the planned shards into `work`, keeping a progress record keyed by `key` (what
    makes two runs the same conversion: source fingerprint, target, options). A record with
    another key, or a shard whose bytes no longer match its sha256, is not reused."""

    def __init__(self, work: Path, key: dict[str, Any], plan: ShardPlan,
                 metadata: dict[str, str] | None = None) -> None:
        self.work = work
        self.key = key
        self.plan = plan
        self.metadata = metadata or {"format": "pt"}
        self.done: dict[str, dict[str, Any]] = {}
        self.resumed: list[str] = []
        self._open()

    def _open(self) -> None:
        record = self.work / PROGRESS
        old: dict[str, Any] = {}
        if record.is_file():
            try:
                old = json.loads(record.read_text())
            except ValueError:
                old = {}
        if old.get("key") != self.key:
            if self.work.exists():
                shutil.rmtree(self.work)
            old = {}
        self.work.mkdir(parents=True, exist_ok=True)
        for file, entry in (old.get("shards") or {}).items():
            path = self.work / file
            if file in self.plan.files and path.is_file() and \
                    sha256_file(path) == entry.get("sha256"):
                self.done[file] = entry
                self.resumed.append(file)
        self._save()

    def _save(self) -> None:
        atomic_write_json(self.work / PROGRESS, {"key": self.key, "shards": self.done})

    def is_done(self, i: int) -> bool:
        return self.plan.files[i] in self.done

    def entry(self, i: int) -> dict[str, Any]:
        return self.done[self.plan.files[i]]

    def write(self, i: int, tensors: dict[str, torch.Tensor], sources: list[str],
              extra: dict[str, Any] | None = None) -> None:
        """Write shard `i` (to a temp name, then renamed) and record it as finished."""
        file = self.plan.files[i]
        tmp = self.work / f".{file}.tmp"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata=self.metadata)
        os.replace(tmp, self.work / file)
        self.done[file] = {"sha256": sha256_file(self.work / file), "sources": sources,
                           "tensors": sorted(tensors),
                           "bytes": (self.work / file).stat().st_size, **(extra or {})}
        self._save()

    def finish(self) -> list[str]:
        """Write the index (when there is more than one shard); the files written."""
        files = list(self.plan.files)
        if len(files) > 1:
            weight_map = {t: f for f in files for t in self.done[f]["tensors"]}
            total = sum(int(self.done[f]["bytes"]) for f in files)
            atomic_write_json(self.work / INDEX, {"metadata": {"total_size": total},
                                                  "weight_map": dict(sorted(
                                                      weight_map.items()))})
            files.append(INDEX)
        return files
