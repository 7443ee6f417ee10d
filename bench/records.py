"""The one result record: a JSON line per measured row, in bench/results/JOB.jsonl.

Every number a results table shows comes from one of these lines, so a record carries what a
reader needs to trust or reproduce it without the session that made it: the job and row, the
recipe and model, the device (name, count), the versions (torch, transformers, llmcompressor,
compressed-tensors, lm-eval, and the quantize commit), the date, the measured values, and the
ratios against the job's baseline rows *measured in the same run* (same process or call, so
the machine state is shared: a ratio across runs would mix hosts).

    {"schema": 1, "job": "quantize-speed-8b", "run": "2026-12-07T10:12:00Z",
     "row": "asym32", "title": null, "recipe": "gptq-int4-asym-g32", "model": "llama3.1-8b",
     "driver": "quant_run", "device": {"kind": "cuda", "name": "NVIDIA H100 80GB HBM3",
     "count": 1}, "versions": {"torch": "2.11.0+cu130", ..., "quantize": "fc1214a"},
     "date": "2026-12-07T10:14:31Z", "values": {"quantize_s": 57.67, ...},
     "baseline": ["gptq-a", "gptq-b"], "ratios": {"quantize_s": 1.1095}, "source": null}

`ratios[v]` is value / mean(baseline values) for times and memory, and mean(baseline) / value
(a recovery) for perplexities (bench/jobs.py RECOVERY_VALUES). `source` names the raw file a
record was imported from (bench/legacy.py), null for a run of `python -m bench`.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.jobs import RECOVERY_VALUES, Job

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SCHEMA = 1
VERSION_PACKAGES = ("torch", "transformers", "llmcompressor", "compressed-tensors", "lm_eval")
REQUIRED = ("schema", "job", "run", "row", "recipe", "model", "driver", "device", "versions",
            "date", "values", "baseline", "ratios")


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def quantize_commit() -> str | None:
    """The code measured: QUANTIZE_COMMIT (set by the GPU command, where no .git travels),
    else git's HEAD with `+dirty` when quantize/ has uncommitted changes."""
    if os.environ.get("QUANTIZE_COMMIT"):
        return os.environ["QUANTIZE_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--short", "quantize"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (head + ("+dirty" if dirty else "")) or None


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in VERSION_PACKAGES:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    out["quantize"] = quantize_commit()
    return out


def device(kind: str) -> dict[str, Any]:
    """The card (name, count) for cuda; the processor and core count for cpu."""
    if kind == "cuda":
        import torch

        if torch.cuda.is_available():
            return {"kind": "cuda", "name": torch.cuda.get_device_name(0),
                    "count": torch.cuda.device_count()}
        raise SystemExit("the job wants device: cuda and torch sees no GPU here")
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"kind": "cpu", "name": name, "count": os.cpu_count()}


def ratios(job: Job, values: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per row label, each numeric value against the mean of its baseline rows' (same run)."""
    out: dict[str, dict[str, float]] = {}
    for label, vals in values.items():
        base_rows = [values[b] for b in job.baseline_of(label) if b in values]
        r: dict[str, float] = {}
        for key, v in vals.items():
            bs = [b[key] for b in base_rows if isinstance(b.get(key), (int, float))]
            if not isinstance(v, (int, float)) or not bs or not v:
                continue
            base = sum(bs) / len(bs)
            if base:
                r[key] = round(base / v if key in RECOVERY_VALUES else v / base, 6)
        out[label] = r
    return out


def make(job: Job, run: str, label: str, values: dict[str, Any], ratio: dict[str, float],
         dev: dict[str, Any], vers: dict[str, Any], *, date: str | None = None,
         source: str | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    row = job.row(label)
    rec: dict[str, Any] = {
        "schema": SCHEMA, "job": job.name, "run": run, "row": label, "title": row.title,
        "recipe": row.recipe, "model": job.model, "driver": job.driver, "device": dev,
        "versions": vers, "date": date or now(), "values": values,
        "baseline": job.baseline_of(label), "ratios": ratio, "source": source}
    if row.variant:
        rec["variant"] = row.variant
    if row.loader:
        rec["loader"] = row.loader
    if extra:
        rec.update(extra)
    return rec


def check(rec: dict[str, Any], where: str = "") -> None:
    missing = [k for k in REQUIRED if k not in rec]
    if missing or rec.get("schema") != SCHEMA:
        raise SystemExit(f"{where}: not a bench record (missing {missing}, schema "
                         f"{rec.get('schema')!r}; bench/records.py describes the format)")


def append(records: list[dict[str, Any]], out_dir: Path = RESULTS) -> Path:
    """Add one run's records to OUT/JOB.jsonl (one file per job, every run appended)."""
    if not records:
        raise ValueError("no records")
    path = out_dir / f"{records[0]['job']}.jsonl"
    out_dir.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        for rec in records:
            check(rec, str(path))
            f.write(json.dumps(rec, sort_keys=False) + "\n")
    return path


def read(path: Path) -> list[dict[str, Any]]:
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            rec = json.loads(line)
            check(rec, f"{path}:{n}")
            out.append(rec)
    return out


def latest(job: str, results: Path = RESULTS) -> list[dict[str, Any]]:
    """The newest run's records of a job (a table shows one run: its ratios share a host)."""
    path = results / f"{job}.jsonl"
    if not path.is_file():
        return []
    recs = read(path)
    last = max(r["run"] for r in recs)
    return [r for r in recs if r["run"] == last]


def add(files: list[Path], results: Path = RESULTS) -> list[Path]:
    """`python -m bench add FILE.jsonl...`: records that came back from the GPU machine's
    $OUT, appended to the job's file here (a run already present is not added twice)."""
    written = []
    for f in files:
        recs = read(f)
        by_job: dict[str, list[dict[str, Any]]] = {}
        for r in recs:
            by_job.setdefault(r["job"], []).append(r)
        for job, rs in by_job.items():
            dest = results / f"{job}.jsonl"
            have = {r["run"] for r in read(dest)} if dest.is_file() else set()
            new = [r for r in rs if r["run"] not in have]
            if new:
                written.append(append(new, results))
    return written
