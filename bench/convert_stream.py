"""Streaming proof of `quantize convert`: write a random FP8-block Llama-like checkpoint
whose bf16 output is larger than this machine's RAM, convert it to bf16 in a child process
(optionally inside a cgroup memory limit far below the model's size), and record time, peak
RSS (VmHWM of the converting process) and a projection for 70B / 405B / 671B models from the
measured rate and each model's largest tensor group.

    python bench/convert_stream.py --layers 15 --workdir /tmp/convert-bench \
        [--cgroup /sys/fs/cgroup/memory/convtest] --out bench/results/<date>-convert-stream.json

Random weights: the values do not matter to streaming; every byte is still read, multiplied
and written. The big files are deleted at the end."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HIDDEN, INTER, KV, VOCAB, BLOCK = 8192, 28672, 1024, 32000, 128  # Llama-70B widths


def _fp8(rows: int, cols: int):  # type: ignore[no-untyped-def]
    import torch

    # random finite e4m3 bytes: magnitudes below 0x7f (0x7f/0xff are NaN), random sign
    mag = torch.randint(0, 0x7E, (rows, cols), dtype=torch.uint8)
    sign = torch.randint(0, 2, (rows, cols), dtype=torch.uint8) << 7
    return (mag | sign).view(torch.float8_e4m3fn)


def write_source(folder: Path, layers: int) -> dict[str, int]:
    """Shards of one decoder layer each (scales of a layer in the next shard: cross-shard
    dependencies), an index and a DeepSeek-style config."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    shapes = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (KV, HIDDEN),
              "self_attn.v_proj": (KV, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
              "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN),
              "mlp.down_proj": (HIDDEN, INTER)}
    n_files = layers + 1
    weight_map: dict[str, str] = {}
    pending_scales: dict[str, torch.Tensor] = {}
    for i in range(n_files):
        name = f"model-{i + 1:05d}-of-{n_files:05d}.safetensors"
        part: dict[str, torch.Tensor] = dict(pending_scales)
        pending_scales = {}
        if i < layers:
            for mod, (r, c) in shapes.items():
                key = f"model.layers.{i}.{mod}"
                part[f"{key}.weight"] = _fp8(r, c)
                pending_scales[f"{key}.weight_scale_inv"] = torch.rand(
                    math.ceil(r / BLOCK), math.ceil(c / BLOCK)) * 1e-3
            for norm in ("input_layernorm", "post_attention_layernorm"):
                part[f"model.layers.{i}.{norm}.weight"] = torch.ones(HIDDEN,
                                                                     dtype=torch.bfloat16)
        else:
            part["model.embed_tokens.weight"] = torch.randn(VOCAB, HIDDEN).to(torch.bfloat16)
            part["lm_head.weight"] = torch.randn(VOCAB, HIDDEN).to(torch.bfloat16)
            part["model.norm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
        del part
        print(f"  wrote source shard {i + 1}/{n_files}", flush=True)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {},
                                                                     "weight_map": weight_map}))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": layers,
              "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": VOCAB,
              "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192},
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                      "activation_scheme": "dynamic",
                                      "weight_block_size": [BLOCK, BLOCK]}}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    sizes = {p.name: p.stat().st_size for p in folder.glob("*.safetensors")}
    return {"files": len(sizes), "bytes": sum(sizes.values())}


_CHILD = """
import json, sys, time
from pathlib import Path
from quantize.convert.run import Options, convert, peak_rss
t0 = time.perf_counter()
r = convert(Path(sys.argv[1]), "hf-bf16", Path(sys.argv[2]),
            Options(smoke=False, max_shard_bytes=int(sys.argv[3])))
print("RESULT " + json.dumps({"seconds": time.perf_counter() - t0, "peak_rss": peak_rss(),
      "largest_group": r.largest_group_bytes, "tensors": r.tensors.tensors,
      "worst_max_abs": r.tensors.worst_max_abs, "min_cosine": r.tensors.min_cosine,
      "preserved": r.preserved}))
"""


def run_child(src: Path, out: Path, shard_bytes: int, cgroup: Path | None) -> dict:
    def enter() -> None:
        os.nice(10)
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    proc = subprocess.run([sys.executable, "-c", _CHILD, str(src), str(out), str(shard_bytes)],
                          preexec_fn=enter, capture_output=True, text=True, check=False)
    sys.stderr.write(proc.stderr[-4000:])
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        raise SystemExit(f"convert failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(line[0].removeprefix("RESULT "))


# elements of the largest tensor (the bf16 embedding or the widest fp8 weight) and the
# source's bytes (one byte a parameter for FP8-block)
PROJECT = {"Llama-3.1-70B (FP8-block)": (128256 * 8192, 70.6e9),
           "Llama-3.1-405B (FP8-block)": (128256 * 16384, 405.9e9),
           "DeepSeek-V3 / R1 671B (FP8-block)": (129280 * 7168, 671.0e9)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=15)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/convert-bench"))
    ap.add_argument("--cgroup", type=Path, default=None)
    ap.add_argument("--shard-bytes", type=int, default=1 << 30)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    src, dst = args.workdir / "fp8-src", args.workdir / "bf16-out"
    shutil.rmtree(args.workdir, ignore_errors=True)
    t0 = time.perf_counter()
    source = write_source(src, args.layers)
    write_s = time.perf_counter() - t0
    limit = None
    if args.cgroup is not None:
        limit = int((args.cgroup / "memory.limit_in_bytes").read_text())
    res = run_child(src, dst, args.shard_bytes, args.cgroup)
    out_bytes = sum(p.stat().st_size for p in dst.glob("*.safetensors"))
    rate = source["bytes"] / res["seconds"]  # fp8 source bytes per second
    # the loop holds one group in and out (at most 4 bytes an element: a bf16 tensor passed
    # through, or fp8 in + bf16 out), chunk-sized float32 temporaries, and one output shard
    # buffer; the rest of the measured peak is the process itself (torch, safetensors maps)
    gate = INTER * HIDDEN
    overhead = max(res["peak_rss"] - 4 * max(gate, VOCAB * HIDDEN) - args.shard_bytes, 0)
    proj = {}
    for name, (elems, params) in PROJECT.items():
        proj[name] = {"largest_group_elements": elems, "estimated_seconds": params / rate,
                      "estimated_peak_rss_bytes": overhead + 4 * elems + args.shard_bytes}
    result = {"what": "FP8-block -> bf16, random Llama-70B-width layers",
              "machine": f"{os.cpu_count()} CPU cores shared, "
                         f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') >> 30} GiB",
              "layers": args.layers, "source_bytes": source["bytes"],
              "source_files": source["files"], "output_bytes": out_bytes,
              "write_source_seconds": write_s, "convert": res,
              "cgroup_memory_limit_bytes": limit, "output_shard_bytes": args.shard_bytes,
              "rate_source_bytes_per_s": rate, "projection": proj}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    if not args.keep:
        shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
