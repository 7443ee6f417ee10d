"""The streaming loop every safetensors conversion runs: plan the output shards from the
headers, then for each shard read its groups one at a time, convert, write, record. Peak
memory is one group plus one output shard's buffer; a crash leaves finished shards that a
re-run with the same key skips (quantize.convert.writer)."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from quantize.convert.base import GroupConverter
from quantize.convert.produced import Produced, TensorCheck
from quantize.convert.shards import SourceShards
from quantize.convert.writer import DEFAULT_SHARD_BYTES, PROGRESS, ResumableWriter, plan_shards
from quantize.model.formats import Detected
from quantize.progress import info
from quantize.run.files import atomic_write_json

# files of a source folder that are not carried over as they are
_REWRITTEN = ("config.json", "model.safetensors.index.json")


def fingerprint(detected: Detected) -> str:
    """What identifies the source for resume and caching: every tensor's header entry and
    each shard's size and mtime (cheap at any model size; a re-downloaded or edited shard
    changes its mtime, so its finished output shards are not reused)."""
    h = hashlib.sha256()
    for name in sorted(detected.tensors):
        t = detected.tensors[name]
        h.update(f"{name}|{t.file}|{t.dtype}|{t.shape}|{t.start}|{t.end}\n".encode())
    for file in sorted({t.file for t in detected.tensors.values()}):
        st = (detected.path / file).stat()
        h.update(f"{file}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def aux_files(folder: Path) -> list[Path]:
    """Everything beside the weights that the output must carry: tokenizer files, chat
    template, generation_config.json, processor configs, custom code, license, README."""
    out = []
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.suffix != ".safetensors" and p.name not in _REWRITTEN and \
                not p.name.startswith("."):
            out.append(p)
    return out


def convert_folder(detected: Detected, conv: GroupConverter, work: Path, *,
                   options: dict[str, Any] | None = None,
                   max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                   on_shard: Callable[[int], None] | None = None) -> Produced:
    """Convert `detected` (a safetensors folder) into `work` with `conv`; resumable."""
    src = SourceShards(detected.path, detected.tensors)
    groups = src.groups(conv.deps)  # refuses missing dependencies before any work
    plan = plan_shards(groups, conv.estimate, max_shard_bytes)
    key = {"source": fingerprint(detected), "converter": conv.name,
           "options": options or {}, "max_shard_bytes": max_shard_bytes}
    writer = ResumableWriter(work, key, plan)
    if writer.resumed:
        info(f"resuming: {len(writer.resumed)} of {len(plan.files)} output shard(s) already "
             "written and verified")
    produced = Produced(source_names=src.names)
    for i, chunk in enumerate(plan.groups):
        if not writer.is_done(i):
            buf: dict[str, Any] = {}
            mapped: dict[str, str] = {}
            dropped: dict[str, str] = {}
            checks: list[TensorCheck] = []
            for group in chunk:
                done = conv.convert(src.load(group.names))
                buf.update(done.tensors)
                mapped.update(done.mapped)
                dropped.update(done.dropped)
                checks.extend(done.checks)
            sources = [n for g in chunk for n in g.names]
            writer.write(i, buf, sources, {
                "mapped": mapped, "dropped": dropped,
                "checks": [[c.source, c.target, c.max_abs, c.cosine] for c in checks]})
            del buf
            info(f"  shard {i + 1}/{len(plan.files)} {plan.files[i]} written")
            if on_shard is not None:
                on_shard(i)
        entry = writer.entry(i)
        produced.mapped.update(entry["mapped"])
        produced.dropped.update(entry["dropped"])
        produced.checks.extend(TensorCheck(*c) for c in entry["checks"])
    produced.files = writer.finish()
    for aux in aux_files(detected.path):
        shutil.copy2(aux, work / aux.name)
        produced.files.append(aux.name)
    config = json.loads((detected.path / "config.json").read_text())
    atomic_write_json(work / "config.json", conv.config(config))
    produced.files.append("config.json")
    produced.notes.extend(conv.notes())
    return produced


def finished(work: Path) -> None:
    """Drop the resume record once the folder is complete (it is not part of the model)."""
    (work / PROGRESS).unlink(missing_ok=True)
