"""`python -m bench import`: the raw files behind the current tables, as records.

Before the runner each driver wrote its own shape (a list of quant_run rows, portable_probe's
stdout lines, consumer_ppl's per-model dict, make_quantize_cpu's rows, a run folder's
manifest). This reads those shapes and writes the same records a run of `python -m bench`
writes, so the renderer has one input. What a raw file did not record stays null: none of
them kept package versions except a run folder's manifest, so `versions` holds only the
commit that added the file (`recorded_in`), never a guess.

    python -m bench import                           # the files in IMPORTS, into bench/results
    python -m bench import --run-folder runs/X --job make-quantize-cpu --row cold
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from bench import records
from bench.jobs import Job, load_job

RESULTS = records.RESULTS
H100 = {"kind": "cuda", "name": "NVIDIA H100", "count": 1}
CPU2 = {"kind": "cpu", "name": "2-core x86-64 CPU, no GPU", "count": 2}

Values = dict[str, dict[str, Any]]


def _added_in(path: Path) -> str | None:
    out = subprocess.run(["git", "log", "--diff-filter=A", "--format=%h", "-1", "--",
                          str(path)], cwd=records.ROOT, capture_output=True, text=True)
    return out.stdout.strip() or None


def _versions(path: Path) -> dict[str, Any]:
    return {**{p: None for p in ("python", *records.VERSION_PACKAGES)}, "quantize": None,
            "recorded_in": _added_in(path)}


def quant_rows(job: Job, raw: list[dict[str, Any]], prefix: str) -> Values:
    """bench/gpu_session.py rows.json: label PREFIX-<row label>."""
    by = {r["label"].removeprefix(prefix): r for r in raw if "label" in r}
    out: Values = {}
    for row in job.rows:
        r = by[row.label]
        vals = {"quantize_s": r["stage_s"]["quantize"], "calibrate_s": r["stage_s"]["calibrate"],
                "wall_s": r["wall_s"], "gpu_peak_alloc_gib": r["gpu_peak_alloc_gib"],
                "gpu_peak_reserved_gib": r["gpu_peak_reserved_gib"],
                "rss_peak_gib": r["rss_peak_gib"], "safetensors_out_gib": r["safetensors_out_gib"]}
        out[row.label] = {k: vals[k] for k in job.measure}
    return out


def probe_rows(job: Job, lines: list[dict[str, Any]]) -> Values:
    by = {d["variant"]: d for d in lines}
    names = {"wiki_ppl": "wiki", "novel_ppl": "novel", "quantize_s": "quantize_s"}
    return {r.label: {m: by[r.variant or ""][names[m]] for m in job.measure} for r in job.rows}


def consumer_rows(job: Job, raw: list[dict[str, Any]]) -> Values:
    by_recipe: dict[str | None, dict[str, Any]] = {None: raw[0]}
    for r in raw[1:]:  # an export's folder is runs/<model>-<recipe>/export
        by_recipe[Path(r["model"]).parent.name.removeprefix("SmolLM2-135M-Instruct-")] = r
    out: Values = {}
    for row in job.rows:
        r = by_recipe[row.recipe]
        vals = {"wiki_ppl": r.get(f"wiki-eval:{row.loader}"),
                "novel_ppl": r.get(f"novel:{row.loader}"),
                "seconds": round(r.get("wiki-eval:seconds", 0) + r.get("novel:seconds", 0), 1)}
        out[row.label] = {m: vals[m] for m in job.measure}
    return out


def mq_rows(job: Job, raw: list[dict[str, Any]]) -> Values:
    out: Values = {}
    for r in raw:
        ev = r.get("eval_timing") or {}
        vals = {"wall_s": r["wall_s"], "quantize_s": r["stage_s"]["quantize"],
                "eval_s": r["stage_s"]["eval"], "eval_baseline_s": ev.get("baseline_s"),
                "eval_candidate_s": ev.get("candidate_s"), "import_s": r.get("import_s")}
        out[r["cache"]] = {**{m: vals[m] for m in job.measure}, "gate": r["gate"]["verdict"]}
    return out


def _write(job: Job, values: Values, dev: dict[str, Any], vers: dict[str, Any], date: str,
           source: str, extra: dict[str, Any] | None = None,
           results: Path = RESULTS) -> Path:
    ratio = records.ratios(job, values)
    run = f"{date}T00:00:00Z" if len(date) == 10 else date
    recs = [records.make(job, run, label, vals, ratio[label], dev, vers, date=date,
                         source=source, extra=extra) for label, vals in values.items()]
    dest = results / f"{job.name}.jsonl"
    if dest.is_file() and any(r["run"] == run for r in records.read(dest)):
        print(f"{dest}: run {run} already there, left as it is")
        return dest
    return records.append(recs, results)


def run_folder(folder: Path, job_name: str, row: str, results: Path = RESULTS) -> Path:
    """One `make quantize` run folder (manifest, eval.json, gate.json) as one row."""
    job = load_job(job_name)
    man = json.loads((folder / "manifest.json").read_text())
    ev = json.loads((folder / "eval" / "eval.json").read_text())
    gate = json.loads((folder / "gate" / "gate.json").read_text())
    stages = man["stages"]
    vals = {"quantize_s": stages["quantize"]["duration_s"],
            "eval_s": stages["eval"]["duration_s"],
            "eval_baseline_s": ev["timing"]["baseline_s"],
            "eval_candidate_s": ev["timing"]["candidate_s"]}
    values = {row: {**{m: vals[m] for m in job.measure if m in vals},
                    "gate": gate["verdict"]}}
    if job.row(row).recipe != man["recipe"]["name"]:
        raise SystemExit(f"{folder}: recipe {man['recipe']['name']}, the job's row {row} "
                         f"runs {job.row(row).recipe}")
    vers = {"python": man["versions"].get("python"),
            **{p: man["versions"].get(p) for p in records.VERSION_PACKAGES},
            "quantize": None, "quantize_version": man["versions"].get("quantize")}
    date = stages["calibrate"]["started"][:10]
    note = f"{folder}/manifest.json (a make quantize run; runs/ is not committed)"
    return _write(job, values, CPU2, vers, date, note,
                  results=results)


def import_all(results: Path = RESULTS) -> list[Path]:
    """The raw files of the current tables (read-only; every file must still exist)."""
    R = records.RESULTS
    out = []
    for job, name, prefix in (("default-candidates-8b", "2026-12-07-default-candidates-8b-h100",
                               "8b-t-"),
                              ("default-candidates-moe12",
                               "2026-12-07-default-candidates-moe12-h100", "moe12-t-")):
        f = R / f"{name}.json"
        j = load_job(job)
        out.append(_write(j, quant_rows(j, json.loads(f.read_text()), prefix), H100,
                          _versions(f), "2026-12-07", str(f.relative_to(records.ROOT)),
                          results=results))
    f = R / "2026-12-07-portable-candidates-cpu.jsonl"
    j = load_job("portable-candidates")
    lines = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    out.append(_write(j, probe_rows(j, lines), CPU2, _versions(f), "2026-12-07",
                      str(f.relative_to(records.ROOT)), results=results))
    f = R / "2026-12-07-consumer-ppl-cpu.json"
    j = load_job("consumer-ppl")
    out.append(_write(j, consumer_rows(j, json.loads(f.read_text())), CPU2, _versions(f),
                      "2026-12-07", str(f.relative_to(records.ROOT)), results=results))
    f = R / "make-quantize-cpu-2026-12-05.json"
    j = load_job("make-quantize-cpu").model_copy(update={"rows": [
        r.model_copy(update={"recipe": "gptq-int4-asym"}) for r in load_job(
            "make-quantize-cpu").rows]})
    out.append(_write(j, mq_rows(j, json.loads(f.read_text())), CPU2, _versions(f),
                      "2026-12-05", str(f.relative_to(records.ROOT)), results=results))
    return out
