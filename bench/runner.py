"""Run one job: each row through the single-run driver that already measures it, in its own
process (so a row's memory peak and imports are its own), rows in the job file's order (the
author writes the A B ... A alternation), then the ratios against the baseline rows of *this*
run, and one record per row appended to OUT/JOB.jsonl.

The drivers are wrapped, not rewritten: bench/quant_run.py (a timed `quantize run` up to the
export), bench/portable_probe.py (the portable candidates in memory), bench/consumer_ppl.py
(exports as their users load them), bench/make_quantize_cpu.py (`make quantize` cold and warm).
Each returns {row label: {value: number}}; everything else is the record's business.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import gpu, records
from bench.jobs import Job

Values = dict[str, dict[str, Any]]


def _run(cmd: list[str], log: Path, timeout: float) -> str:
    """A driver's process; its stdout, or exit naming the log on failure."""
    print(f"$ {' '.join(cmd)}", flush=True)
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        p = subprocess.run([sys.executable, *cmd], cwd=gpu.ROOT, env=gpu.child_env(),
                           stdout=subprocess.PIPE, stderr=f, text=True, timeout=timeout)
        f.write(p.stdout)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])}... failed (exit {p.returncode}); see {log}")
    return p.stdout


def model_path(job: Job, work: Path) -> str:
    """`default` as the CLI takes it; a make_model preset built once (reused while the folder
    stays); anything else a folder."""
    from bench.make_model import PRESETS, SHIPPED

    if job.model == "default" or Path(job.model).is_dir():
        return job.model
    if job.model not in {**PRESETS, **SHIPPED}:
        raise SystemExit(f"model {job.model!r}: not `default`, a folder, or a bench/"
                         f"make_model.py preset ({', '.join(sorted({**PRESETS, **SHIPPED}))})")
    out = gpu.MODELS / f"bench-{job.model}"
    _run(["-m", "bench.make_model", "--preset", job.model, "--out", str(out), "--tokenizer",
          str(gpu.tokenizer()), "--device", job.device], work / "build.log", job.timeout_s)
    return str(out)


def quant_run(job: Job, work: Path) -> Values:
    model = model_path(job, work)
    if job.calibration and "128x2048" in job.calibration:
        gpu.write_calib_text()
    out: Values = {}
    for row in job.rows:
        assert row.recipe is not None
        res = work / f"{row.label}.json"
        _run(["-m", "bench.quant_run", "--mode", "pipeline", "--recipe", row.recipe,
              "--model", model, "--calib", job.calibration or "bench/calib-32x2048.yaml",
              "--device", job.device, "--no-profile", "--out", str(work / "export"),
              "--json-out", str(res), "--label", row.label, *row.args],
             work / "quant_run.log", job.timeout_s)
        r = json.loads(res.read_text())
        stage = r.get("stage_s") or {}
        vals = {"quantize_s": stage.get("quantize"), "calibrate_s": stage.get("calibrate"),
                "wall_s": r.get("wall_s"), "gpu_peak_alloc_gib": r.get("gpu_peak_alloc_gib"),
                "gpu_peak_reserved_gib": r.get("gpu_peak_reserved_gib"),
                "rss_peak_gib": r.get("rss_peak_gib"),
                "safetensors_out_gib": r.get("safetensors_out_gib")}
        out[row.label] = {k: vals[k] for k in job.measure}
    return out


def _calibration(job: Job, work: Path) -> Path:
    """A calibration.safetensors: the job's file, or the calibrate stage of the recipe it
    names on the job's model (what `quantize run` would use)."""
    spec = job.calibration or "gptq-int4-asym-g32"
    if spec.endswith(".safetensors"):
        return Path(spec)
    run_dir = work / f"calibrate-{Path(spec).stem}"
    _run(["-m", "quantize.cli", "calibrate", spec, "--model", job.model, "--out",
          str(run_dir)], work / "calibrate.log", job.timeout_s)
    return run_dir / "calibrate" / "calibration.safetensors"


def portable_probe(job: Job, work: Path) -> Values:
    variants = [r.variant for r in job.rows]
    stdout = _run(["-m", "bench.portable_probe", ",".join(v for v in variants if v),
                   "--calibration", str(_calibration(job, work))], work / "probe.log",
                  job.timeout_s * len(variants))
    got = {d["variant"]: d for d in map(json.loads, filter(None, stdout.splitlines()))}
    names = {"wiki_ppl": "wiki", "novel_ppl": "novel", "quantize_s": "quantize_s"}
    return {r.label: {m: got[r.variant or ""][names[m]] for m in job.measure} for r in job.rows}


def consumer_ppl(job: Job, work: Path) -> Values:
    from quantize.model.source import resolve_model

    base = resolve_model(None if job.model == "default" else job.model).path
    recipes = list(dict.fromkeys(r.recipe for r in job.rows if r.recipe))
    exports = []
    for recipe in recipes:
        run_dir = work / f"export-{Path(recipe).stem}"
        _run(["-m", "quantize.cli", "export", recipe, "--model", job.model, "--out",
              str(run_dir)], work / "export.log", job.timeout_s)
        exports.append(str(run_dir / "export"))
    res = work / "consumer.json"
    _run(["-m", "bench.consumer_ppl", "--base", str(base), *exports, "--out", str(res)],
         work / "consumer.log", job.timeout_s * (1 + len(exports)))
    rows = json.loads(res.read_text())
    by_recipe: dict[str | None, dict[str, Any]] = {None: rows[0]}
    by_recipe.update(zip(recipes, rows[1:], strict=True))
    out: Values = {}
    for r in job.rows:
        raw = by_recipe[r.recipe]
        vals = {"wiki_ppl": raw.get(f"wiki-eval:{r.loader}"),
                "novel_ppl": raw.get(f"novel:{r.loader}"),
                "seconds": (raw.get("wiki-eval:seconds") or 0) + (raw.get("novel:seconds") or 0)}
        out[r.label] = {m: vals[m] for m in job.measure}
    return out


def make_quantize(job: Job, work: Path) -> Values:
    from quantize.model.source import cache_root, resolve_model

    resolve_model(None)  # the converted model, which each row's fresh cache copies
    recipes = {r.recipe for r in job.rows}
    if len(recipes) != 1:
        raise SystemExit("make_quantize: every row runs the same recipe (rows: cold, warm)")
    res = work / "mq.json"
    _run(["-m", "bench.make_quantize_cpu", "--row", f"current={gpu.ROOT}", "--cache", "both",
          "--recipe", recipes.pop() or "gptq-int4-asym-g32", "--model-cache", str(cache_root()),
          "--out", str(work / "mq"), "--json-out", str(res)], work / "mq.log",
         job.timeout_s * 3)
    out: Values = {}
    for raw in json.loads(res.read_text()):
        stage, ev = raw["stage_s"], raw.get("eval_timing") or {}
        vals = {"wall_s": raw["wall_s"], "quantize_s": stage.get("quantize"),
                "eval_s": stage.get("eval"), "eval_baseline_s": ev.get("baseline_s"),
                "eval_candidate_s": ev.get("candidate_s"), "import_s": raw.get("import_s")}
        out[raw["cache"]] = {**{m: vals[m] for m in job.measure}, "gate": raw["gate"]["verdict"]}
    missing = [r.label for r in job.rows if r.label not in out]
    if missing:
        raise SystemExit(f"make_quantize rows are `cold` and `warm`; no result for {missing}")
    return {r.label: out[r.label] for r in job.rows}


DRIVERS = {"quant_run": quant_run, "portable_probe": portable_probe,
           "consumer_ppl": consumer_ppl, "make_quantize": make_quantize}


def run_job(job: Job, out_dir: Path, work: Path | None = None) -> Path:
    """Measure every row, then write the run's records; returns the JSONL it appended to."""
    run = records.now()
    vers, dev = records.versions(), records.device(job.device)
    with tempfile.TemporaryDirectory(prefix=f"bench-{job.name}-") as tmp:
        w = work or Path(tmp)
        w.mkdir(parents=True, exist_ok=True)
        values = DRIVERS[job.driver](job, w)
    ratio = records.ratios(job, values)
    recs = [records.make(job, run, label, vals, ratio[label], dev, vers)
            for label, vals in values.items()]
    path = records.append(recs, out_dir)
    for r in recs:
        print(json.dumps({"row": r["row"], "values": r["values"], "ratios": r["ratios"]}))
    return path
