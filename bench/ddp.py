"""Distributed calibration on GPUs: GPTQ W4A16 (recipe gptq-int4) of the Llama-3.1-8B
architecture with random weights, on 1 GPU and then on 2 GPUs under torchrun
(`quantize run --gpus 2`'s code path: quantize.backends.distributed), on the same
calibration tokens. Reports wall time, speedup, peak memory per GPU and how far the two
exports differ, into OUT/ddp.json, and prints a table.

On the 2-GPU machine (wheels, tokenizer and a fresh quantize/ snapshot carried in .whl/, made
here by `python -m bench.prepare_carry`), in one call of under 10 minutes:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 \\
        python3 -m bench.ddp --out $OUT --deadline-s 540

The same code on a toy model and CPU processes (gloo), to check the script without a GPU:

    python -m bench.ddp --device cpu --preset tiny --calib bench/calib-tiny.yaml \\
        --source tree --out /tmp/ddp-smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORK = Path("/tmp/quantize-bench")
RECIPE = "gptq-int4"
# seconds on an H200 for 128 x 2048 tokens: 1 GPU measured 84 s for plain oneshot
# (bench/RESULTS.md) plus load and save; 2 GPUs add torchrun's start
EST_S = {1: 150, 2: 130}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def child_env(source: str) -> dict[str, str]:
    """The carried quantize/ snapshot first on the path (what was checked here);
    `--source tree` uses the working tree instead."""
    from bench.gpu import child_env as gpu_env

    env = gpu_env(snapshot=True)
    snapshot = ROOT / ".whl" / "quantize-src"
    if source == "tree":
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in env["PYTHONPATH"].split(os.pathsep) if p != str(snapshot))
    elif not (snapshot / "quantize" / "backends" / "_ddp_worker.py").is_file():
        sys.exit(f"{snapshot} has no quantize/backends/_ddp_worker.py: run `python -m "
                 "bench.prepare_carry` on the development machine first (or --source tree)")
    return env


# --- one measured run, in its own process (python -m bench.ddp --child ...) ---------------
def child(a: argparse.Namespace) -> None:
    import torch

    from quantize.backends import QuantizeJob, resolve_batch_size
    from quantize.backends import llmcompressor as llmc
    from quantize.backends.distributed import shares
    from quantize.recipe.recipe import load_recipe

    recipe = load_recipe(RECIPE)
    samples = json.loads(Path(a.samples).read_text())
    share = samples[: -(-len(samples) // a.world)]
    batch = resolve_batch_size(recipe.batch_size, a.device, share)
    group = recipe.group_size if isinstance(recipe.group_size, int) else 128
    job = QuantizeJob(Path(a.model), recipe, group, samples, a.device, batch,
                      placement=a.placement, world_size=a.world)
    out = Path(a.out_dir) / "quantize"
    shutil.rmtree(out.parent, ignore_errors=True)
    out.mkdir(parents=True)
    rec: dict[str, Any] = {"gpus": a.world, "device": a.device, "placement": a.placement,
                           "samples": len(samples),
                           "seq_len": max(len(s) for s in samples),
                           "tokens": sum(len(s) for s in samples), "batch_size": batch,
                           "samples_per_process": shares(len(samples), a.world)}
    t0 = time.perf_counter()
    if a.world == 1:  # the one-process path of LLMCompressorBackend.quantize, phase by phase
        from transformers import AutoTokenizer

        llmc.prepare_engine()
        src, dtype = llmc.dtypes(job)
        tok = AutoTokenizer.from_pretrained(job.model_path)
        model = llmc.load_model(job, dtype)
        t1 = time.perf_counter()
        llmc.calibrate(model, tok, job, samples, out.parent / "logs")
        t2 = time.perf_counter()
        llmc.save(model, tok, out, dtype, src, write=True)
        rec |= {"load_s": round(t1 - t0, 1), "oneshot_s": round(t2 - t1, 1),
                "save_s": round(time.perf_counter() - t2, 1)}
        if a.device != "cpu":
            rec["per_process"] = [{
                "rank": 0,
                "gpu_peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                "gpu_peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2)}]
    else:  # what `quantize run --gpus N` does: the launcher, torchrun, the workers
        summary = llmc.BACKEND.quantize(job, out)
        rec |= {k: summary[k] for k in ("load_s", "oneshot_s", "save_s", "torchrun_s",
                                        "per_process", "process_group")}
    rec["wall_s"] = round(time.perf_counter() - t0, 1)
    Path(a.json_out).write_text(json.dumps(rec))


# --- the driver -------------------------------------------------------------------------
def calibration(calib: str, model: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    from quantize.recipe.recipe import load_recipe
    from quantize.stages import calibrate

    spec, base = calibrate.resolve_spec(load_recipe(RECIPE), calib)
    return calibrate.tokenize(spec, calibrate.read_texts(spec, base),
                              AutoTokenizer.from_pretrained(model))


def compare(one: Path, two: Path) -> dict[str, Any]:
    """How far the 2-GPU export is from the 1-GPU one: the share of equal 4-bit values in
    the packed weights (8 per int32), overall and in the worst module, and the largest
    relative difference of the scales. GPTQ rounds each column with the error of the ones
    before, so a Hessian summed in another order can flip a rounding and those after it."""
    import torch
    from safetensors import safe_open

    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    equal = total = 0
    worst_module, worst_share = "", 1.0
    worst_scale = 0.0
    for shard in sorted(one.glob("*.safetensors")):
        with safe_open(shard, "pt") as fa, safe_open(two / shard.name, "pt") as fb:
            for k in fa.keys():  # noqa: SIM118 (safe_open is not a dict)
                x, y = fa.get_tensor(k), fb.get_tensor(k)
                if k.endswith("weight_packed"):
                    nx, ny = (x.unsqueeze(-1) >> shifts) & 0xF, (y.unsqueeze(-1) >> shifts) & 0xF
                    same = int((nx == ny).sum())
                    equal += same
                    total += nx.numel()
                    if same / nx.numel() < worst_share:
                        worst_module, worst_share = k, same / nx.numel()
                elif k.endswith("weight_scale"):
                    d = (x.float() - y.float()).abs().max() / x.float().abs().max()
                    worst_scale = max(worst_scale, float(d))
    return {"int4_values_equal": round(equal / max(total, 1), 6), "int4_values": total,
            "worst_module": worst_module, "worst_module_equal": round(worst_share, 6),
            "worst_scale_rel_diff": round(worst_scale, 6)}


def quality(model: Path, exports: dict[str, Path], device: str, n: int = 4,
            seq: int = 512) -> dict[str, Any]:
    """KL(source || export) of next-token distributions on held-out text (the shipped wiki
    eval passages), for each export: what quantizing changed, 1 GPU vs 2 GPUs. The weights
    are random, so the absolute value means little; the two rows are compared."""
    import inspect

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig

    from quantize.recipe.texts import BUILTIN_TEXT

    tok = AutoTokenizer.from_pretrained(model)
    ids = tok(BUILTIN_TEXT["wiki-eval"].read_text(encoding="utf-8"))["input_ids"][:n * seq]
    x = torch.tensor(ids).view(n, seq).to(device)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    new_flag = "dequantize" in inspect.signature(CompressedTensorsConfig).parameters
    qcfg = CompressedTensorsConfig(**({"dequantize": True} if new_flag
                                      else {"run_compressed": False}))

    def logp(path: Path, **kw: Any) -> Any:
        m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device, **kw)
        with torch.no_grad():
            out = torch.log_softmax(m.eval()(x).logits.float(), -1)
        del m
        if device != "cpu":
            torch.cuda.empty_cache()
        return out

    t0 = time.perf_counter()
    p = logp(model)
    res: dict[str, Any] = {"tokens": n * seq}
    for world, path in exports.items():
        r = logp(path, quantization_config=qcfg)
        res[f"kl_{world}"] = float((p.exp() * (p - r)).sum(-1).mean())
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def table(runs: list[dict[str, Any]]) -> str:
    lines = ["| run | GPUs | samples per process | wall s | load s | oneshot s | save s | speedup "
             "(wall) | speedup (oneshot) | GPU peak allocated GiB per GPU |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    base = next((r for r in runs if r.get("label") == "1gpu" and "wall_s" in r), None)
    for r in runs:
        if "wall_s" not in r:
            lines.append(f"| {r['label']} | {r['gpus']} | – | {r.get('error')} | | | | | | |")
            continue
        sp = f"{base['wall_s'] / r['wall_s']:.2f}" if base else "–"
        so = f"{base['oneshot_s'] / r['oneshot_s']:.2f}" if base else "–"
        peaks = ", ".join(str(p.get("gpu_peak_allocated_gib", "–"))
                          for p in r.get("per_process", []))
        lines.append(f"| {r['label']} | {r['gpus']} | "
                     f"{'/'.join(map(str, r['samples_per_process']))} | "
                     f"{r['wall_s']} | {r['load_s']} | {r['oneshot_s']} | {r['save_s']} | "
                     f"{sp} | {so} | {peaks or '–'} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--gpus", default="1,2", help="comma-separated process counts to run")
    p.add_argument("--calib", default="bench/calib-128x2048.yaml")
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="llama3.1-8b")
    p.add_argument("--deadline-s", type=float, default=540)
    p.add_argument("--source", choices=("snapshot", "tree"), default="snapshot")
    p.add_argument("--placement", choices=("resident", "onload", "onload+offload"),
                   default="resident",
                   help="where the weights live (quantize.checks.resources): the whole model "
                   "on each GPU, or in host memory onloaded layer by layer")
    p.add_argument("--control", action="store_true",
                   help="also run 1 GPU on the samples in another order (the noise reference)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-quality", help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--samples", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a)
        return
    if a.child_quality:
        exports = dict(item.split("=", 1) for item in a.child_quality.split(","))
        res = quality(Path(a.model), {k: Path(v) for k, v in exports.items()}, a.device)
        Path(a.json_out).write_text(json.dumps(res))
        return
    if a.out is None:
        p.error("--out is required")
    run(a)


def run(a: argparse.Namespace) -> None:
    from bench.gpu import TOKENIZER, environment, sh, write_calib_text

    MODEL_8B = Path("/tmp/llama31-8b-random")  # the folder earlier sessions used

    t_start = time.perf_counter()
    a.out.mkdir(parents=True, exist_ok=True)
    env = child_env(a.source)
    results: dict[str, Any] = {"bench": "ddp", "recipe": RECIPE, "calib": a.calib,
                               "placement": a.placement,
                               "env": environment(), "runs": []}
    if a.source == "tree":
        results["env"]["quantize_source"] = "working tree"
    log(json.dumps(results["env"]))
    write_calib_text()
    model = MODEL_8B if a.preset == "llama3.1-8b" else WORK / f"model-{a.preset}"
    tokenizer = TOKENIZER
    if not (tokenizer / "tokenizer.json").is_file():  # no carry: the default model's own
        from quantize.model.source import default_model_dir
        tokenizer = default_model_dir()
    log(f"model {a.preset} -> {model}")
    _, line = sh([sys.executable, "-m", "bench.make_model", "--preset", a.preset, "--out",
                  str(model), "--tokenizer", str(tokenizer), "--device", a.device], env, 300,
                 a.out / "log.txt")
    results["model"] = json.loads(line) if line else {"error": "make_model failed (log.txt)"}
    log(json.dumps(results["model"]))
    if "error" in results["model"]:
        _save(a.out, results)
        sys.exit("model creation failed; see log.txt")
    samples = calibration(a.calib, model)
    sfile = WORK / "ddp-samples.json"
    sfile.write_text(json.dumps(samples))
    log(f"calibration: {len(samples)} x {max(len(s) for s in samples)} tokens")
    # (label, processes, samples file); the control calibrates one process on the same
    # samples with the two halves swapped: how much the order of the Hessian sums alone moves
    # GPTQ's roundings, the noise the 2-GPU result is judged against
    plan = [(f"{w}gpu", w, sfile) for w in (int(x) for x in a.gpus.split(","))]
    if a.control:
        half = len(samples) // 2
        cfile = WORK / "ddp-samples-swapped.json"
        cfile.write_text(json.dumps(samples[half:] + samples[:half]))
        plan.append(("1gpu-reordered", 1, cfile))
    outs: dict[str, Path] = {}
    for label, world, samples_file in plan:
        left = a.deadline_s - (time.perf_counter() - t_start)
        if left < EST_S.get(world, 150) * (0.1 if a.device == "cpu" else 1):
            results["runs"].append({"label": label, "gpus": world,
                                    "error": f"skipped: {left:.0f} s left"})
            log(f"{label}: skipped, {left:.0f} s left")
            continue
        log(f"{label}: quantizing on {world} process(es) ...")
        jpath = WORK / f"ddp-{label}.json"
        jpath.unlink(missing_ok=True)
        outs[label] = WORK / f"ddp-out-{label}"
        cmd = [sys.executable, "-m", "bench.ddp", "--child", "--world", str(world),
               "--model", str(model), "--samples", str(samples_file), "--out-dir",
               str(outs[label]), "--json-out", str(jpath), "--device", a.device,
               "--placement", a.placement]
        rc, _ = sh(cmd, env, max(left - 10, 10), a.out / "log.txt")
        rec = {"label": label, **json.loads(jpath.read_text())} if rc == 0 and \
            jpath.is_file() else {"label": label, "gpus": world, "error": f"rc {rc} (log.txt)"}
        tr = outs[label] / "logs" / "torchrun.log"
        if tr.is_file():
            shutil.copy2(tr, a.out / f"torchrun-{label}.log")
        results["runs"].append(rec)
        log(f"{label}: {rec.get('wall_s', rec.get('error'))} s")
        _save(a.out, results)
    done = {r["label"] for r in results["runs"] if "wall_s" in r}
    for other in ("2gpu", "1gpu-reordered"):
        if {"1gpu", other} <= done:
            results[f"1gpu_vs_{other}"] = compare(outs["1gpu"] / "quantize",
                                                  outs[other] / "quantize")
            log(f"1gpu vs {other}: {json.dumps(results[f'1gpu_vs_{other}'])}")
            _save(a.out, results)
    left = a.deadline_s - (time.perf_counter() - t_start)
    if len(done) > 1 and left > (20 if a.device == "cpu" else 120):
        # in its own process, killed at the deadline so the table below is always printed
        log("quality: KL to the source model on held-out text ...")
        qpath = WORK / "ddp-quality.json"
        qpath.unlink(missing_ok=True)
        exports = ",".join(f"{k}={outs[k] / 'quantize'}" for k in sorted(done))
        rc, _ = sh([sys.executable, "-m", "bench.ddp", "--child-quality", exports, "--model",
                    str(model), "--json-out", str(qpath), "--device", a.device], env,
                   max(left - 15, 10), a.out / "log.txt")
        results["quality"] = json.loads(qpath.read_text()) if rc == 0 and qpath.is_file() \
            else {"error": f"rc {rc} (log.txt)"}
        log(json.dumps(results["quality"]))
    elif len(done) > 1:
        results["quality"] = {"skipped": f"{left:.0f} s left"}
    for o in outs.values():
        shutil.rmtree(o, ignore_errors=True)
    results["total_s"] = round(time.perf_counter() - t_start, 1)
    _save(a.out, results)
    print(table(results["runs"]), flush=True)


def _save(out: Path, results: dict[str, Any]) -> None:
    (out / "ddp.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
