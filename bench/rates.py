"""The card's ceilings, measured in the same process family as the runs they judge.

Matrix products of 8192³ on random data (never zeros: they run faster) in bf16, fp32
(PyTorch's default "highest" precision, as llm-compressor's Hessian uses) and tf32; a
device-to-device copy (bytes read + written); host-to-device copies from pageable and pinned
memory (what offloading layers or activations to the CPU costs).
"""

from __future__ import annotations

import json
import time
from typing import Any


def _time_cuda(fn: Any, reps: int, warmup: int = 3) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def matmul_tflops(dtype: str, n: int = 8192, reps: int = 10) -> float:
    import torch

    tf32_before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        dt = torch.bfloat16 if dtype == "bf16" else torch.float32
        a = torch.randn(n, n, device="cuda", dtype=dt)
        b = torch.randn(n, n, device="cuda", dtype=dt)
        t = _time_cuda(lambda: a @ b, reps)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32_before
    return 2 * n**3 / t / 1e12


def copy_gbps(gib: float = 4.0) -> float:
    import torch

    n = int(gib * 2**30) // 2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = _time_cuda(lambda: dst.copy_(src), 10)
    return 2 * src.numel() * 2 / t / 1e9


def h2d_gbps(pinned: bool, gib: float = 2.0) -> float:
    import torch

    n = int(gib * 2**30) // 2
    src = torch.ones(n, dtype=torch.bfloat16)  # values do not matter to a copy
    if pinned:
        src = src.pin_memory()
    dst = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    t = _time_cuda(lambda: dst.copy_(src, non_blocking=pinned), 5, warmup=1)
    return src.numel() * 2 / t / 1e9


def measure() -> dict[str, Any]:
    import torch

    t0 = time.perf_counter()
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "tflops": {k: round(matmul_tflops(k), 1) for k in ("bf16", "fp32", "tf32")},
        "d2d_copy_gbps": round(copy_gbps(), 0),
        "h2d_pageable_gbps": round(h2d_gbps(False), 1),
        "h2d_pinned_gbps": round(h2d_gbps(True), 1),
    }
    out["seconds"] = round(time.perf_counter() - t0, 1)
    torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    print(json.dumps(measure()))
