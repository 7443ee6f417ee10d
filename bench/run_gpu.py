"""The GPU benchmark driver: one call of the lent machine runs one plan.

  python -m bench.run_gpu --plan gptq --out $OUT --deadline-s 500

It records the environment, measures the card's matrix/copy rates, builds (or reuses) the
random-weight Llama-3.1-8B folder, then runs each row of the plan as its own process
(bench.quant_run / bench.eval_run) until the deadline, skipping rows whose estimate no longer
fits. Everything lands in $OUT/results.json; the table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import flops

ROOT = Path(__file__).resolve().parent.parent
WORK = Path("/tmp/quantize-bench")
MODEL_8B = Path("/tmp/llama31-8b-random")
TOKENIZER = ROOT / ".whl" / "smollm2-tokenizer"
C32, C16, C128 = "bench/calib-32x2048.yaml", "bench/calib-16x2048.yaml", \
    "bench/calib-128x2048.yaml"
C8 = "bench/calib-8x2048.yaml"
NOPACK = "bench/calib-nopack-128.yaml"

# (label, quant_run arguments, estimated seconds on an H200 for the 8B model)
Row = tuple[str, list[str], int]
TUNED = ["--tf32", "--offload-device", "cuda"]
PLANS: dict[str, list[Row]] = {
    "gptq": [
        ("gptq pipeline", ["--mode", "pipeline", "--recipe", "gptq-int4", "--calib", C32], 120),
        ("gptq oneshot", ["--mode", "oneshot", "--recipe", "gptq-int4", "--calib", C32], 110),
        ("gptq oneshot tf32", ["--mode", "oneshot", "--recipe", "gptq-int4", "--calib", C32,
                               "--tf32"], 80),
        ("gptq oneshot tf32+gpu-acts", ["--mode", "oneshot", "--recipe", "gptq-int4",
                                        "--calib", C32, *TUNED], 75),
        ("gptq pipeline tf32", ["--mode", "pipeline", "--recipe", "gptq-int4", "--calib", C32,
                                "--tf32"], 85),
    ],
    "tuning": [
        ("gptq oneshot tuned bs8", ["--mode", "oneshot", "--recipe", "gptq-int4", "--calib",
                                    C32, *TUNED, "--batch-size", "8"], 70),
        ("gptq oneshot tuned cpu-load", ["--mode", "oneshot", "--recipe", "gptq-int4",
                                         "--calib", C32, *TUNED, "--load-device", "cpu"], 110),
        ("gptq oneshot tuned 128x2048", ["--mode", "oneshot", "--recipe", "gptq-int4",
                                         "--calib", C128, *TUNED], 110),
        ("gptq oneshot unprofiled", ["--mode", "oneshot", "--recipe", "gptq-int4", "--calib",
                                     C32, "--no-profile"], 110),
        ("gptq oneshot tuned no-packing", ["--mode", "oneshot", "--recipe", "gptq-int4",
                                           "--calib", NOPACK, *TUNED], 80),
    ],
    "recipes": [
        ("fp8 pipeline", ["--mode", "pipeline", "--recipe", "fp8-dynamic", "--calib", C16], 60),
        ("fp8 oneshot", ["--mode", "oneshot", "--recipe", "fp8-dynamic", "--calib", C16], 55),
        ("w8a8 pipeline", ["--mode", "pipeline", "--recipe", "w8a8-int8", "--calib", C16], 110),
        ("w8a8 oneshot", ["--mode", "oneshot", "--recipe", "w8a8-int8", "--calib", C16], 100),
        ("awq pipeline", ["--mode", "pipeline", "--recipe", "awq-int4", "--calib", C8], 130),
        ("awq oneshot", ["--mode", "oneshot", "--recipe", "awq-int4", "--calib", C8], 120),
    ],
    # After the hashing/copy fixes: the pipeline (its GPU defaults: TF32, activations on the
    # GPU, batch 8 of packed windows) against plain oneshot with the same settings, and the
    # library's own defaults at the 128 x 2048 tokens as the bar.
    "overhead": [
        ("gptq pipeline", ["--mode", "pipeline", "--recipe", "gptq-int4", "--calib", C32], 60),
        ("gptq oneshot same-settings", ["--mode", "oneshot", "--recipe", "gptq-int4",
                                        "--calib", C32, *TUNED, "--batch-size", "8"], 55),
        ("fp8 pipeline", ["--mode", "pipeline", "--recipe", "fp8-dynamic", "--calib", C16], 40),
        ("fp8 oneshot", ["--mode", "oneshot", "--recipe", "fp8-dynamic", "--calib", C16], 35),
        ("gptq pipeline 128x2048", ["--mode", "pipeline", "--recipe", "gptq-int4", "--calib",
                                    C128], 100),
        ("gptq oneshot same-settings 128x2048", ["--mode", "oneshot", "--recipe", "gptq-int4",
                                                 "--calib", C128, *TUNED, "--batch-size",
                                                 "8"], 95),
        ("gptq oneshot library-defaults 128x2048", ["--mode", "oneshot", "--recipe",
                                                    "gptq-int4", "--calib", C128], 230),
    ],
    "overhead2": [
        ("w8a8 pipeline", ["--mode", "pipeline", "--recipe", "w8a8-int8", "--calib", C16], 80),
        ("w8a8 oneshot same-settings", ["--mode", "oneshot", "--recipe", "w8a8-int8", "--calib",
                                        C16, *TUNED, "--batch-size", "8"], 75),
        ("awq pipeline", ["--mode", "pipeline", "--recipe", "awq-int4", "--calib", C8], 90),
        ("awq oneshot same-settings", ["--mode", "oneshot", "--recipe", "awq-int4", "--calib",
                                       C8, *TUNED, "--batch-size", "8"], 85),
    ],
    # every recipe's pair in one call (filled in below from the two plans above)
    "final": [],
    # the same rows on the toy model: a check that every row runs, in seconds
    "smoke": [
        ("gptq pipeline", ["--mode", "pipeline", "--recipe", "gptq-int4", "--calib",
                           "bench/calib-tiny.yaml"], 30),
        ("gptq oneshot tuned bs8", ["--mode", "oneshot", "--recipe", "gptq-int4", "--calib",
                                    "bench/calib-tiny.yaml", *TUNED, "--batch-size", "8"], 30),
        ("awq oneshot", ["--mode", "oneshot", "--recipe", "awq-int4", "--calib",
                         "bench/calib-tiny.yaml"], 30),
        ("w8a8 oneshot cpu-load", ["--mode", "oneshot", "--recipe", "w8a8-int8", "--calib",
                                   "bench/calib-tiny.yaml", "--load-device", "cpu"], 30),
        ("fp8 pipeline", ["--mode", "pipeline", "--recipe", "fp8-dynamic", "--calib",
                          "bench/calib-tiny.yaml"], 30),
    ],
}
PLANS["final"] = PLANS["overhead"][:4] + PLANS["overhead2"]
# issue 20: the pipeline (its GPU defaults: TF32, activations on the GPU, batch 8, the bf16
# Hessian of quantize/backends/_gpu_fast.py, no all-ones mask) against plain oneshot given the
# same settings, the library's defaults, and the library's knobs alone; in priority order
# (run_gpu skips what no longer fits the deadline; --rows picks rows for a second call)
SAME = [*TUNED, "--batch-size", "8", "--fast-hessian", "--no-mask"]
PLANS["issue20"] = [
    ("gptq pipeline 128x2048", ["--mode", "pipeline", "--recipe", "gptq-int4", "--calib",
                                C128], 75),
    ("gptq oneshot same-settings 128x2048", ["--mode", "oneshot", "--recipe", "gptq-int4",
                                             "--calib", C128, *SAME], 75),
    ("gptq oneshot library-defaults 128x2048", ["--mode", "oneshot", "--recipe", "gptq-int4",
                                                "--calib", C128], 235),
    ("fp8 pipeline", ["--mode", "pipeline", "--recipe", "fp8-dynamic", "--calib", C16], 35),
    ("fp8 oneshot same-settings", ["--mode", "oneshot", "--recipe", "fp8-dynamic", "--calib",
                                   C16, *SAME], 35),
    ("w8a8 pipeline", ["--mode", "pipeline", "--recipe", "w8a8-int8", "--calib", C16], 55),
    ("w8a8 oneshot same-settings", ["--mode", "oneshot", "--recipe", "w8a8-int8", "--calib",
                                    C16, *SAME], 55),
    ("awq pipeline", ["--mode", "pipeline", "--recipe", "awq-int4", "--calib", C8], 60),
    ("awq oneshot same-settings", ["--mode", "oneshot", "--recipe", "awq-int4", "--calib",
                                   C8, *SAME], 60),
    ("gptq oneshot knobs-only 128x2048", ["--mode", "oneshot", "--recipe", "gptq-int4",
                                          "--calib", C128, *TUNED, "--batch-size", "8"], 95),
    # each change against the library's knobs alone, at 32 x 2048 (the first row also warms
    # Triton's kernel cache, which the first GPTQ process on a machine fills: +1.3 s)
    ("gptq oneshot same-settings 32x2048", ["--mode", "oneshot", "--recipe", "gptq-int4",
                                            "--calib", C32, *SAME, "--torch-profile",
                                            str(WORK / "torch-profile.txt")], 55),
    ("gptq oneshot knobs-only 32x2048", ["--mode", "oneshot", "--recipe", "gptq-int4",
                                         "--calib", C32, *TUNED, "--batch-size", "8"], 60),
    ("gptq pipeline 32x2048", ["--mode", "pipeline", "--recipe", "gptq-int4", "--calib", C32],
     55),
    # batch 1: the memory side of the speed/memory trade-off (goal 3)
    ("gptq oneshot same-settings bs1 128x2048", ["--mode", "oneshot", "--recipe", "gptq-int4",
                                                 "--calib", C128, *TUNED, "--fast-hessian",
                                                 "--no-mask"], 80),
]
EVAL_EST_S = 60


class Clock:
    def __init__(self, deadline_s: float) -> None:
        self.t0 = time.perf_counter()
        self.deadline = deadline_s

    def left(self) -> float:
        return self.deadline - (time.perf_counter() - self.t0)


def sh(cmd: list[str], env: dict[str, str], timeout: float, log: Path) -> tuple[int, str]:
    """Run a child, append its output to the log; return (rc, last stdout line)."""
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                           cwd=ROOT)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as exc:
        rc = 124
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}  (rc {rc})\n{_tail(err, 4000)}\n{_tail(out, 2000)}\n")
    lines = [x for x in out.strip().splitlines() if x.startswith("{")]
    return rc, lines[-1] if lines else ""


def _tail(text: str, n: int) -> str:
    # progress bars rewrite one line with \r; keep the last state of each line
    lines = [ln.rsplit("\r", 1)[-1] for ln in text.splitlines()]
    return "\n".join(lines)[-n:]


def environment() -> dict[str, Any]:
    import importlib.metadata as md

    env: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                           "python": platform.python_version(), "cpus": os.cpu_count()}
    for pkg in ("torch", "transformers", "accelerate", "llmcompressor", "compressed-tensors",
                "datasets", "pyarrow", "fsspec", "safetensors", "tokenizers", "pydantic"):
        try:
            env[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            env[pkg] = "absent"
    try:
        env["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        env["gpu"] = "nvidia-smi unavailable"
    du = shutil.disk_usage("/tmp")
    env["tmp_free_gib"] = round(du.free / 2**30, 1)
    snap = ROOT / ".whl" / "quantize-src" / "SNAPSHOT.txt"
    env["quantize_source"] = snap.read_text().strip() if snap.is_file() else "working tree"
    return env


def write_calib_text() -> None:
    """bench/calib-128x2048.yaml reads the shipped calibration text written twice."""
    WORK.mkdir(parents=True, exist_ok=True)
    text = (ROOT / "quantize" / "data" / "wiki_calibration.txt").read_text()
    (WORK / "wiki_x2.txt").write_text(text + "\n" + text)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    src = ROOT / ".whl" / "quantize-src"
    paths = [str(src)] if src.is_dir() else []
    paths += [str(ROOT), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["QUANTIZE_CACHE"] = str(WORK / "qcache")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def add_floor(rec: dict[str, Any], rates: dict[str, Any], cfg: dict[str, Any]) -> None:
    if not rates.get("tflops") or "wall_s" not in rec:
        return
    d = flops.Dims.from_config(cfg)
    fl = flops.floor(rec["recipe"], d, rec.get("tokens") or 0, rec.get("seq_len") or 1,
                     rates["tflops"], tf32=rec.get("tf32", False))
    rec["floor"] = fl.as_dict()
    if fl.seconds_tensor > 0:
        rec["x_floor"] = round(rec["wall_s"] / fl.seconds_tensor, 1)
        rec["x_floor_engine"] = round(rec["wall_s"] / fl.seconds_engine, 1)
        calib = sum(v for k, v in rec.get("groups_s", {}).items()
                    if k in ("forward", "hessian/stats", "act_cache", "trace"))
        if calib:
            rec["calib_x_floor"] = round(calib / fl.seconds_tensor, 1)


def table(records: list[dict[str, Any]]) -> str:
    head = ("| row | tokens | wall s | load | fwd | hess/stats | solve/search | act cache | "
            "save | pipeline | other | ×floor | GPU peak GiB | RSS peak GiB |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        if "wall_s" not in r:
            lines.append(f"| {r['label']} | – | {r.get('error', 'skipped')} |" + " |" * 11)
            continue
        g = r.get("groups_s", {})
        lines.append(
            f"| {r['label']} | {r.get('tokens', 0)} | {r['wall_s']} | {g.get('load', '')} | "
            f"{g.get('forward', '')} | {g.get('hessian/stats', '')} | "
            f"{g.get('solve/search', '')} | {g.get('act_cache', '')} | "
            f"{g.get('compress+save', '')} | {g.get('pipeline', '')} | {g.get('other', '')} | "
            f"{r.get('x_floor', '')} | {r.get('gpu_peak_alloc_gib')} | {r.get('rss_peak_gib')} |")
    return "\n".join(lines)


def run_plan(a: argparse.Namespace, clock: Clock, env: dict[str, str], out: Path,
             model: Path, rates: dict[str, Any], results: dict[str, Any]) -> None:
    cfg = json.loads((model / "config.json").read_text())
    log = out / "log.txt"
    # --rows: exactly these rows, in this order (also re-running a merged one); otherwise
    # the plan's rows that no earlier call merged in
    done = {r["label"] for r in results["runs"]}
    by_label = {r[0]: r for r in PLANS[a.plan]}
    rows = [by_label[x] for x in a.rows.split(",")] if a.rows else \
        [r for r in PLANS[a.plan] if r[0] not in done]
    for label, args, est in rows:
        if a.eval_lmeval and label == EVAL_BEFORE:
            eval_vs_lmeval(a, clock, env, out, model, results)
        if clock.left() < est + 10:
            results["runs"].append({"label": label, "error": f"skipped: {clock.left():.0f}s "
                                    f"left, needs ~{est}s"})
            continue
        if a.device == "cpu":  # script checks on a machine without a GPU
            args = ["cpu" if x == "cuda" else "bench/calib-tiny.yaml"
                    if x.startswith("bench/calib-") and x.endswith("x2048.yaml") else x
                    for x in args]
        jpath = WORK / "run.json"
        jpath.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "bench.quant_run", "--model", str(model), "--out",
               str(WORK / "out"), "--device", a.device, "--json-out", str(jpath), "--label",
               label, *args]
        t0 = time.perf_counter()
        rc, _ = sh(cmd, env, max(clock.left() - 5, 10), log)
        if rc == 0 and jpath.is_file():
            rec = json.loads(jpath.read_text())
            add_floor(rec, rates, cfg)
        else:
            rec = {"label": label, "error": f"rc {rc} (see log.txt)"}
        rec["process_s"] = round(time.perf_counter() - t0, 1)
        results["runs"].append(rec)
        save(out, results, a)
        print(f"[{time.strftime('%H:%M:%S')}] {label}: "
              f"{rec.get('wall_s', rec.get('error'))} s", flush=True)
    if a.eval and clock.left() > EVAL_EST_S:
        jpath = WORK / "eval.json"
        cmd = [sys.executable, "-m", "bench.eval_run", "--model", str(model), "--device",
               a.device, "--json-out", str(jpath), "--bf16-tflops",
               str(rates.get("tflops", {}).get("bf16", 0))]
        rc, _ = sh(cmd, env, max(clock.left() - 5, 10), log)
        results["eval"] = json.loads(jpath.read_text()) if rc == 0 and jpath.is_file() \
            else {"error": f"rc {rc}"}
        (out / "results.json").write_text(json.dumps(results, indent=1))


EVAL_BEFORE = "fp8 pipeline"  # where the lm-eval comparison runs in the issue20 plan


def save(out: Path, results: dict[str, Any], a: argparse.Namespace) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1))
    # kept on the machine: a next call while it is warm can --merge it
    (WORK / "last-results.json").write_text(json.dumps(results, indent=1))
    if (WORK / "torch-profile.txt").is_file():
        shutil.copy2(WORK / "torch-profile.txt", out / "torch-profile.txt")
    if a.plan.startswith("issue20"):
        from bench import latest

        latest.write(results, out / "latest.json")


def eval_vs_lmeval(a: argparse.Namespace, clock: Clock, env: dict[str, str], out: Path,
                   model: Path, results: dict[str, Any]) -> None:
    """Goal 4: bench.eval_vs_lmeval on the 8B model (same windows and batch)."""
    if clock.left() < EVAL_EST_S + 10 or "eval_vs_lmeval" in results:
        return
    jpath = WORK / "eval_vs_lmeval.json"
    jpath.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "bench.eval_vs_lmeval", "--model", str(model), "--device",
           a.device, "--tokens", "32768", "--seq-len", "1024", "--batch", "8", "--json-out",
           str(jpath)]
    rc, _ = sh(cmd, env, max(clock.left() - 5, 10), out / "log.txt")
    results["eval_vs_lmeval"] = json.loads(jpath.read_text()) if rc == 0 and jpath.is_file() \
        else {"error": f"rc {rc} (see log.txt)"}
    save(out, results, a)
    print(f"[{time.strftime('%H:%M:%S')}] eval vs lm-eval: "
          f"{results['eval_vs_lmeval'].get('lm_eval_over_quantize')}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--plan", choices=sorted(PLANS), required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--deadline-s", type=float, default=520)
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="llama3.1-8b")
    p.add_argument("--no-rates", action="store_true")
    p.add_argument("--eval", action="store_true", help="also run bench.eval_run at the end")
    p.add_argument("--eval-lmeval", action="store_true",
                   help="also run bench.eval_vs_lmeval (before the fp8 rows of issue20)")
    p.add_argument("--rows", default="", help="comma-separated labels: run only these rows")
    p.add_argument("--merge", type=Path, default=None,
                   help="results.json of an earlier call: its rows are kept (tagged with "
                        "that call's date) and latest.json is computed from both")
    a = p.parse_args()
    clock = Clock(a.deadline_s)
    a.out.mkdir(parents=True, exist_ok=True)
    env = child_env()
    results: dict[str, Any] = {"plan": a.plan, "env": environment(), "runs": []}
    if a.merge and not a.merge.is_file():
        print(f"--merge {a.merge}: not there (a fresh machine); nothing merged", flush=True)
    elif a.merge:
        earlier = json.loads(a.merge.read_text())
        when = earlier.get("env", {}).get("date")
        results["runs"] = [{**r, "call": r.get("call", when)} for r in earlier["runs"]
                           if "wall_s" in r]
        results["earlier_env"] = earlier.get("env")
        for k in ("eval_vs_lmeval",):
            if k in earlier and "error" not in earlier[k]:
                results[k] = earlier[k]
    print(json.dumps(results["env"]), flush=True)
    write_calib_text()
    log = a.out / "log.txt"
    rates: dict[str, Any] = {}
    if not a.no_rates and a.device == "cuda":
        _, line = sh([sys.executable, "-m", "bench.rates"], env, 120, log)
        rates = json.loads(line) if line else {}
        print(json.dumps(rates), flush=True)
    results["rates"] = rates
    model = MODEL_8B if a.preset == "llama3.1-8b" else WORK / f"model-{a.preset}"
    _, line = sh([sys.executable, "-m", "bench.make_model", "--preset", a.preset, "--out",
                  str(model), "--tokenizer", str(TOKENIZER), "--device", a.device], env, 300,
                 log)
    results["model"] = json.loads(line) if line else {"error": "make_model failed"}
    print(json.dumps(results["model"]), flush=True)
    (a.out / "results.json").write_text(json.dumps(results, indent=1))
    if "error" not in results["model"]:
        run_plan(a, clock, env, a.out, model, rates, results)
        if a.eval_lmeval:
            eval_vs_lmeval(a, clock, env, a.out, model, results)
    save(a.out, results, a)
    print(table(results["runs"]))
    if "eval" in results:
        print(json.dumps(results["eval"]))


if __name__ == "__main__":
    main()
