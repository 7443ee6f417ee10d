"""Host memory of loading a fused-expert MoE the way the pipeline does, per host tier
(quantize.checks.placement): `quantize.backends.llmcompressor.load_model` with the RAM tier,
or the disk tier with a given RAM budget (compressed-tensors' `load_offloaded_model`,
`device_map="auto_offload"`), each in its own process. Anonymous memory (RssAnon) after
`from_pretrained`, before each MoE layer is linearized, its peak during `linearize`
(sampled every 10 ms), after it, after malloc_trim, and the bytes left in the offload folder.

  python -m bench.moe_tiers --out DIR [--tiers ram,disk:2.0,disk:1.2,disk:0.5]

Issue 28: Qwen3-30B-A3B under the disk tier was OOM-killed in `linearize` at 67.6 GiB of
anonymous memory with 57.1 GiB of weights planned. Before quantize.model.release (8 layers,
64 experts, 1.54 GiB): RssAnon grew by one layer's experts (0.19 GiB) per layer, peak 3.02 GiB
with every weight in RAM under compressed-tensors (RAM tier 2.08), 2.65 GiB with a 1.2 GiB
budget, 2.08 GiB with 0.5 GiB; after it every tier peaks at its loaded size plus one layer
(2.08, 1.52, 0.77 GiB) and the offload folder holds the spilled experts once (1.31 GiB, was
2.63).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any


def _anon() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon"):
                return int(line.split()[1]) / 2**20
    return 0.0


def child(model_dir: Path, tier: str, offload: Path) -> dict[str, Any]:
    import ctypes
    import shutil
    from types import SimpleNamespace

    import torch
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D

    import quantize.model.moe as moe
    from quantize.backends import QuantizeJob
    from quantize.backends.llmcompressor import load_model

    peak = [0.0]

    def sample() -> None:
        while True:
            peak[0] = max(peak[0], _anon())
            time.sleep(0.01)

    threading.Thread(target=sample, daemon=True).start()
    row: dict[str, Any] = {"tier": tier, "per_layer_gib": []}
    make = LinearExperts2D.from_experts_module.__func__  # type: ignore[attr-defined]

    def traced(cls: Any, experts: Any, config: Any) -> Any:
        row["per_layer_gib"].append(round(_anon(), 3))
        return make(cls, experts, config)

    LinearExperts2D.from_experts_module = classmethod(traced)  # type: ignore[method-assign,assignment]
    linearize = moe.linearize

    def watched(model: Any) -> Any:
        row["after_load_gib"], peak[0] = _anon(), _anon()
        t0 = time.perf_counter()
        out = linearize(model)
        row["linearize_s"] = time.perf_counter() - t0
        row["peak_linearize_gib"], row["after_linearize_gib"] = peak[0], _anon()
        return out

    moe.linearize = watched
    kind, _, budget = tier.partition(":")
    shutil.rmtree(offload, ignore_errors=True)
    offload.mkdir(parents=True)
    job = QuantizeJob(model_path=model_dir, recipe=SimpleNamespace(trust_remote_code=False),  # type: ignore[arg-type]
                      group_size=128, samples=[], device="cpu", placement="onload",
                      host_tier=kind, cpu_budget=int(float(budget) * 2**30) if budget else None,
                      offload_dir=offload if kind == "disk" else None)
    t = time.perf_counter()
    load_model(job, torch.bfloat16)
    row["load_s"] = time.perf_counter() - t
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    row["after_trim_gib"] = _anon()
    files = list(offload.iterdir())
    row["offload_gib"] = sum(f.stat().st_size for f in files if not f.is_symlink()) / 2**30
    row["offload_files"] = len(files)
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--moe-inter", type=int, default=512)
    p.add_argument("--tiers", default="ram,disk:2.0,disk:1.2,disk:0.5")
    p.add_argument("--child", default=None)
    a = p.parse_args()
    model_dir = a.out / "model"
    if a.child:
        print(json.dumps(child(model_dir, a.child, a.out / "offload")))
        return
    from bench.moe_load import build

    info = build(model_dir, a)
    rows = []
    for tier in a.tiers.split(","):
        res = subprocess.run([sys.executable, "-m", "bench.moe_tiers", "--out", str(a.out),
                              "--child", tier], capture_output=True, text=True, check=True)
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    (a.out / "moe_tiers.json").write_text(json.dumps({"model": info, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
