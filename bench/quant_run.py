"""One timed quantization run, in its own process so memory peaks are its own.

  python -m bench.quant_run --mode pipeline --recipe gptq-int4 --model DIR \
      --calib bench/calib-32x2048.yaml --out /tmp/x --json-out r.json
  python -m bench.quant_run --mode oneshot ... [--batch-size 8] [--offload-device cuda]
      [--tf32] [--load-device cpu]

`pipeline` times quantize.pipeline.run(RunOptions(..., until="export")): calibrate, quantize
and export as `quantize run` does them. `oneshot` is the plain llm-compressor call with the
same tokens, modifiers (built by the same function), load dtype/device and save call, so
the ratio of the two is the pipeline's overhead. Both run under the same phase timers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from bench import profiler


class RssSampler(threading.Thread):
    """Peak resident memory of this process, sampled every 0.2 s."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        import psutil

        self.proc = psutil.Process()
        self.peak = self.proc.memory_info().rss
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.2):
            self.peak = max(self.peak, self.proc.memory_info().rss)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mode", choices=("pipeline", "oneshot"), required=True)
    p.add_argument("--recipe", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--calib", required=True, help="calibration spec YAML")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--offload-device", default="cpu",
                   help="where llm-compressor keeps layer activations between layers")
    p.add_argument("--load-device", default=None,
                   help="device_map for from_pretrained (default: --device; cpu = load on "
                        "the host and let the sequential pipeline onload layer by layer)")
    p.add_argument("--tf32", action="store_true",
                   help="allow TF32 for fp32 matmuls (the engine's Hessian accumulation)")
    p.add_argument("--fast-hessian", action="store_true",
                   help="the pipeline's GPU Hessian (quantize.backends._gpu_fast): bf16 GEMM "
                        "with fp32 output, one product per shared input")
    p.add_argument("--no-mask", action="store_true",
                   help="drop the all-ones attention mask of equal-length samples, as the "
                        "pipeline does on a GPU")
    p.add_argument("--sdpa", action="store_true",
                   help="attention through SDPA in the traced layers (_gpu_fast."
                        "sdpa_in_traced_layers; what the pipeline does on a GPU)")
    p.add_argument("--gpu-free-gib", type=float, default=None,
                   help="pipeline only: the memory check sees at most this much free GPU "
                        "memory (a smaller card), so it picks its memory-saving placement")
    p.add_argument("--no-imatrix-batch", action="store_true",
                   help="pipeline only: the library's per-module imatrix search instead of "
                        "the shared one (quantize.backends._imatrix_batch), for the A/B")
    p.add_argument("--torch-profile", default=None,
                   help="append torch.profiler tables of a few layer forwards to this file")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--keep", action="store_true", help="keep the output folder")
    p.add_argument("--json-out", required=True)
    p.add_argument("--label", default="")
    return p.parse_args(argv)


def check_args(a: argparse.Namespace) -> None:
    if a.mode == "pipeline" and (a.batch_size != 1 or a.offload_device != "cpu" or a.tf32
                                 or a.fast_hessian or a.no_mask or a.sdpa
                                 or a.load_device not in (None, a.device)):
        raise SystemExit("the pipeline uses its own defaults (on a GPU: TF32, activations on "
                         "the GPU, batch `auto`, loading on --device); vary knobs only with "
                         "--mode oneshot")


def run_pipeline(a: argparse.Namespace) -> dict[str, Any]:
    from quantize.pipeline import RunOptions, run

    if a.gpu_free_gib is not None:  # emulate a smaller card for the memory check only
        import quantize.checks.resources as res

        real = res.gpu_free_bytes
        res.gpu_free_bytes = lambda: min(real(), int(a.gpu_free_gib * 2**30))

    pipe = run(RunOptions(recipe=a.recipe, model=a.model, dataset=a.calib, out=Path(a.out),
                          until="export", device=a.device))
    from quantize.run.results import CalibrationSummary

    stages = pipe.manifest.stages
    calib = pipe.manifest.result("calibrate", CalibrationSummary)
    quant = stages["quantize"].summary
    return {"tokens": calib.tokens, "num_samples": calib.num_samples,
            "seq_len": calib.seq_len, "calib_fingerprint": calib.fingerprint,
            "stage_s": {k: v.duration_s for k, v in stages.items()},
            # what the pipeline chose, so the row says which oneshot row it matches
            "batch_size": quant.get("batch_size", 1),
            "weights": quant.get("weights"),
            "gpu_placement": (pipe.facts.memory or {}).get("gpu_placement"),
            **({"tf32": True, "offload_device": "cuda", "fast_hessian": True, "no_mask": True,
                "sdpa": True} if a.device == "cuda" else {})}


def calibration_samples(recipe_name: str, calib: str, model: str) -> list[list[int]]:
    """The same tokens the pipeline's calibrate stage makes (same spec, seed and packing)."""
    from transformers import AutoTokenizer

    from quantize.recipe.recipe import load_recipe
    from quantize.stages import calibrate

    spec, base = calibrate.resolve_spec(load_recipe(recipe_name), calib)
    tok = AutoTokenizer.from_pretrained(model)
    return calibrate.tokenize(spec, calibrate.read_texts(spec, base), tok)


def run_oneshot(a: argparse.Namespace, prof: profiler.Prof | None) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantize.backends._gpu_fast import fast_hessian, sdpa_in_traced_layers
    from quantize.backends.llmcompressor import SHARD_SIZE, build_modifiers, prepare_engine
    from quantize.checks.preflight import check
    from quantize.model.config import read_config, torch_dtype
    from quantize.recipe.recipe import load_recipe
    from quantize.stages.calibrate import fingerprint

    prepare_engine()
    recipe = load_recipe(a.recipe)
    model_dir = Path(a.model)
    # A plain user writes the group size down; only `auto` needs the pipeline's preflight.
    group_size = recipe.group_size if isinstance(recipe.group_size, int) or \
        recipe.group_size is None else \
        check(recipe, read_config(model_dir))["group_size"]
    if prof:
        prof.enter("tokenize")
    samples = calibration_samples(a.recipe, a.calib, a.model) if recipe.needs_calibration else []
    if prof:
        prof.exit()
    src_dtype = torch_dtype(read_config(model_dir), allow_fp32=True)
    dtype = torch.float32 if a.device == "cpu" else src_dtype
    load_device = a.load_device or a.device
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, device_map=None if load_device == "cpu" else load_device)
    # what a user of plain oneshot writes for an MoE model too: routers stay dense (the
    # pipeline derives the same list, quantize.model.moe)
    from quantize.model.moe import derived_ignore

    extra = [x for x in derived_ignore(model) if x not in recipe.ignore]
    if extra:
        recipe = recipe.model_copy(update={"ignore": [*recipe.ignore, *extra]})
    kwargs: dict[str, Any] = {}
    if samples:
        cols: dict[str, Any] = {"input_ids": samples}
        if not a.no_mask:
            cols["attention_mask"] = [[1] * len(s) for s in samples]
        ds = Dataset.from_dict(cols)
        kwargs = {"dataset": ds, "num_calibration_samples": len(samples),
                  "max_seq_length": max(len(s) for s in samples),
                  "shuffle_calibration_samples": False, "batch_size": a.batch_size,
                  "sequential_offload_device": a.offload_device,
                  "moe_calibrate_all_experts": recipe.calibrate_all_experts}
    out = Path(a.out)
    with fast_hessian(a.fast_hessian), sdpa_in_traced_layers(model, a.sdpa):
        oneshot(model=model, processor=tokenizer,  # type: ignore[arg-type]
                recipe=build_modifiers(recipe, group_size), **kwargs)
    if dtype != src_dtype:
        model.to(src_dtype)
    model.save_pretrained(out, save_compressed=True, max_shard_size=SHARD_SIZE)
    tokenizer.save_pretrained(out)
    tokens = sum(len(s) for s in samples)
    return {"tokens": tokens, "num_samples": len(samples),
            "seq_len": max((len(s) for s in samples), default=0),
            "calib_fingerprint": fingerprint(samples) if samples else None}


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    check_args(a)
    os.environ.setdefault("LLM_COMPRESSOR_LOG_LEVEL", "ERROR")
    import torch

    if a.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
    cuda = torch.cuda.is_available() and a.device == "cuda"
    prof = None if a.no_profile else profiler.Prof()
    missing = profiler.install(prof) if prof else []
    if a.torch_profile and cuda:
        profiler.torch_profile_forward(a.torch_profile)
    if cuda:
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # context creation stays out of the timing
        torch.cuda.reset_peak_memory_stats()
    if a.no_imatrix_batch:
        from quantize.backends import _imatrix_batch

        _imatrix_batch.batched_imatrix = lambda enabled=True: contextlib.nullcontext()
    shutil.rmtree(a.out, ignore_errors=True)
    rss = RssSampler()
    rss.start()
    rss0 = rss.peak
    t0 = time.perf_counter()
    if prof:
        prof.enter("other")
    result = run_pipeline(a) if a.mode == "pipeline" else run_oneshot(a, prof)
    if prof:
        prof.exit()
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    rss.stop.set()
    saved = Path(a.out) / "export" if a.mode == "pipeline" else Path(a.out)
    out_bytes = sum(p.stat().st_size for p in saved.glob("*.safetensors"))
    record: dict[str, Any] = {
        "label": a.label, "mode": a.mode, "recipe": a.recipe, "model": a.model,
        "calib": a.calib, "batch_size": a.batch_size, "offload_device": a.offload_device,
        "load_device": a.load_device or a.device, "tf32": a.tf32, "device": a.device,
        "fast_hessian": a.fast_hessian, "no_mask": a.no_mask, "sdpa": a.sdpa,
        "gpu_free_gib_cap": a.gpu_free_gib, "imatrix_batch": not a.no_imatrix_batch,
        "profiled": prof is not None, "wall_s": round(wall, 2), **result,
        "gpu_peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda
        else None,
        "gpu_peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda
        else None,
        "rss_peak_gib": round(rss.peak / 2**30, 2),
        "rss_start_gib": round(rss0 / 2**30, 2),
        "ru_maxrss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "safetensors_out_gib": round(out_bytes / 2**30, 2),
    }
    if prof:
        rep = profiler.hooks_report(prof)
        record.update(rep)
        record["groups_s"] = profiler.group_phases(rep["phases_s"])
        record["unpatched"] = missing
    if not a.keep:
        shutil.rmtree(a.out, ignore_errors=True)
    Path(a.json_out).write_text(json.dumps(record))
    print(json.dumps({k: v for k, v in record.items() if k not in ("gptq_losses", "calls")}))


if __name__ == "__main__":
    main()
