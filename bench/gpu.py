"""What a run needs on the lent GPU machine, in one place, so `python -m bench JOB.yaml` runs
there as it runs here.

That machine has torch, transformers, accelerate and safetensors but not llm-compressor,
compressed-tensors, datasets, loguru or pydantic, no network and no .git: the missing wheels,
the default model's tokenizer (the random-weight models borrow it) and a snapshot of
quantize/ travel in the git-ignored `.whl/` that bench/prepare_carry.py fills, installed there
with `pip install --target /tmp/site`. `--gpu-carry` prints the device command that does this
and then runs the job; the children of a run get PYTHONPATH=ROOT:/tmp/site and the offline
switches from `child_env()`. bench/ddp.py uses the same helpers.
"""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / ".whl"
SITE = Path(os.environ.get("BENCH_SITE", "/tmp/site"))
WORK = Path("/tmp/quantize-bench")
MODELS = Path(os.environ.get("BENCH_MODELS", "/dev/shm" if Path("/dev/shm").is_dir()
                             else "/tmp"))
TOKENIZER = CARRY / "smollm2-tokenizer"
SNAPSHOT = CARRY / "quantize-src"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def child_env(snapshot: bool = False) -> dict[str, str]:
    """The environment of one measured child: this tree (or, with snapshot, the quantize/
    copied by prepare_carry, what was checked here) and /tmp/site on the path, offline."""
    env = dict(os.environ)
    paths = [str(SNAPSHOT)] if snapshot and SNAPSHOT.is_dir() else []
    paths += [str(ROOT)]
    if SITE.is_dir():
        paths.append(str(SITE))
    paths.append(env.get("PYTHONPATH", ""))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.update(OFFLINE, PYTHONUNBUFFERED="1", LLM_COMPRESSOR_LOG_LEVEL="ERROR")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if SITE.is_dir():  # the GPU machine: its own model cache, kept while the machine is warm
        env.setdefault("QUANTIZE_CACHE", str(WORK / "qcache"))
    return env


def write_calib_text() -> None:
    """bench/calib-128x2048.yaml reads the shipped calibration text written twice."""
    dst = WORK / "wiki_x2.txt"
    if not dst.is_file():
        WORK.mkdir(parents=True, exist_ok=True)
        text = (ROOT / "quantize" / "data" / "wiki_calibration.txt").read_text()
        dst.write_text(text + "\n" + text)


def tokenizer() -> Path:
    """The carried tokenizer there; the default model's here (converting it once if needed)."""
    if (TOKENIZER / "tokenizer.json").is_file():
        return TOKENIZER
    from quantize.model.source import resolve_model

    return resolve_model(None).path


def sh(cmd: list[str], env: dict[str, str], timeout: float, log: Path) -> tuple[int, str]:
    """Run a child, append its output to the log; return (rc, last JSON-looking stdout line)."""
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
    return "\n".join(ln.rsplit("\r", 1)[-1] for ln in text.splitlines())[-n:]


def environment() -> dict[str, Any]:
    """Machine facts for a driver's own JSON (bench/ddp.py)."""
    import importlib.metadata as md

    env: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                           "python": platform.python_version(), "cpus": os.cpu_count()}
    for pkg in ("torch", "transformers", "accelerate", "llmcompressor", "compressed-tensors",
                "datasets", "safetensors", "tokenizers", "pydantic"):
        try:
            env[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            env[pkg] = "absent"
    try:
        env["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        env["gpu"] = "nvidia-smi unavailable"
    env["tmp_free_gib"] = round(shutil.disk_usage("/tmp").free / 2**30, 1)
    snap = SNAPSHOT / "SNAPSHOT.txt"
    env["quantize_source"] = snap.read_text().strip() if snap.is_file() else "working tree"
    return env


def carry_command(job_file: str, commit: str | None) -> str:
    """The one command for the device tool's run(command=..., carry=[".whl"])."""
    pip = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "
           f"--upgrade --target {SITE} .whl/*.whl")
    env = f"export PYTHONPATH=$PWD:{SITE} PYTHONUNBUFFERED=1" + "".join(
        f" {k}={v}" for k, v in OFFLINE.items()) + (f" QUANTIZE_COMMIT={commit}" if commit
                                                     else "")
    return f"{pip} && {env} && python3 -m bench {shlex.quote(job_file)} --out $OUT"


def carry_report(job_file: str, commit: str | None) -> str:
    """What --gpu-carry prints here: whether .whl/ is ready, and the device command."""
    lines = []
    ignored = subprocess.run(["git", "check-ignore", "-q", ".whl/x"], cwd=ROOT).returncode == 0
    if not ignored:
        lines.append("first: echo /.whl/ >> .git/info/exclude   (wheels are never committed)")
    wheels = sorted(CARRY.glob("*.whl")) if CARRY.is_dir() else []
    if not wheels or not (TOKENIZER / "tokenizer.json").is_file():
        lines.append("then: python -m bench.prepare_carry       (wheels + tokenizer into .whl/)")
    else:
        size = sum(p.stat().st_size for p in CARRY.rglob("*") if p.is_file())
        lines.append(f".whl/ ready: {len(wheels)} wheels, {size / 2**20:.1f} MiB (limit 64 "
                     "MiB with the tree)")
    lines += ["device tool: run(carry=[\".whl\"], command=", "  " + carry_command(job_file,
                                                                                     commit),
              ")", "then here: python -m bench add <files_at>/<job>.jsonl && "
              "python -m bench render"]
    return "\n".join(lines)
