"""Giving a replaced module's memory back at once, under compressed-tensors' offloading.

`quantize.model.moe.linearize` swaps each fused-experts module for per-expert Linears, one MoE
layer at a time, so that only one layer is ever held twice. Two things kept the memory anyway
when the model was loaded through compressed-tensors' `load_offloaded_model` (the disk tier of
quantize.checks.placement, and several processes), measured on a 1.5 GiB random Qwen3-MoE
(8 layers, 64 experts; bench/moe_tiers.py):

- `offload_module` wraps each module's `forward` in a closure over the module: a reference
  cycle, so `del` frees nothing until Python's cyclic collector happens to run. Anonymous
  memory grew by one layer's experts per layer (+0.19 GiB each, 1.89 -> 3.40 GiB); on an H200
  host Qwen3-30B-A3B was OOM-killed at 67.6 GiB with 57.1 GiB of weights planned.
  `release_module` deletes the tensors through the module's offload cache instead, which also
  removes their offload files.
- Under disk offload every new per-expert tensor is allocated, written to the offload folder
  and freed, between small long-lived allocations (modules, meta tensors, cache entries):
  glibc keeps the freed holes, which the next layer's tensors do not fit, and the heap grew
  by one layer's experts per layer on disk (0.58 -> 1.90 GiB, 0.59 after malloc_trim).
  `trim_heap` returns them after each layer.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any


def release_module(module: Any) -> None:
    """Drop every tensor of `module` (and its children), which is leaving the model, now.

    Deleting through an offload cache also drops its disk copy: DiskCache's own file or link,
    and (on the process that writes) the file transformers wrote into the offload folder for a
    tensor the checkpoint does not hold (a fused expert tensor), which the link points to. A
    checkpoint file is never touched. Plain (not offloaded) modules just lose their tensors."""
    from compressed_tensors.distributed import is_source_process
    from compressed_tensors.offload.cache import DiskCache

    for mod in module.modules():
        for store in (mod._parameters, mod._buffers):
            for key in list(store):
                target: Path | None = None
                if isinstance(store, DiskCache) and is_source_process():
                    info = DiskCache.index.get(store.offloaded_values[key]) or {}
                    link = info.get("safetensors_file")
                    if link and os.path.islink(link):
                        target = Path(os.path.realpath(link))
                del store[key]  # DiskCache: removes its own file (or link) and index entry
                if target is not None and target.parent == Path(store.offload_dir) \
                        and target.is_file():
                    target.unlink()


@functools.cache
def _malloc_trim() -> Any:
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim this way
        return None


def trim_heap() -> None:
    """Return the heap's free pages to the system (glibc's malloc_trim; elsewhere a no-op)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
