"""`make quantize` on the CPU, end to end, with a per-phase profile (issue 33, goals 4 and 6).

Each row is one `quantize run RECIPE --model default` (what `make quantize` runs) in
its own process, the CLI called in-process under bench/profiler.py's phase timers plus the
eval's regions below; its wall time is measured from the parent, process start and imports
included. Rows run back to back in one command, so a source tree before a change and after it
see the same machine (another process may share the CPU: compare ratios, not seconds).

  python -m bench.make_quantize_cpu --out /tmp/mq --row before=/tmp/base --row after=. \
      [--cache cold|warm|both] [--recipe R] [--model-cache /work/qcache] [--json-out r.json]

`--row NAME=SRC` runs the source tree SRC (a checkout or `git archive` of a commit; its
`quantize` package is imported, this file's profiler is used). `--cache cold`: a fresh model
cache holding only the converted model (no baseline scores), as on the first `make quantize`
after conversion; `warm`: the same cache again, the baseline's scores now cached; `both`
(default): cold, then warm. The model cache given is copied, never written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent

# the eval's regions, on top of bench/profiler.py's TARGETS (missing ones are listed, not fatal:
# a source tree before a change lacks the functions the change added)
EVAL_TARGETS: list[tuple[str, str, str]] = [
    ("quantize.stages.eval", "load_model", "eval_load"),
    ("quantize.metrics", "perplexity", "eval_ppl"),
    ("quantize.metrics", "multiple_choice", "eval_mc"),
    ("quantize.stages.eval.choice", "score_task", "eval_mc"),
    ("lm_eval.tasks", "TaskManager.__init__", "lmeval_task_index"),
    ("lm_eval.models.huggingface", "HFLM.__init__", "lmeval_hflm_init"),
    ("lm_eval.models.huggingface", "HFLM._loglikelihood_tokens", "lmeval_forward"),
    ("lm_eval.evaluator", "simple_evaluate", "lmeval_other"),
    ("llmcompressor.observers.imatrix", "_grid_search", "observer_search"),
    ("quantize.backends._imatrix", "grid_search", "observer_search"),
    ("llmcompressor.modifiers.gptq.base", "quantize_weight", "gptq_solve_weight"),
]

GROUPS = {
    "quantize: load + data": ("load_model", "load_tokenizer", "dataset", "q_calibrate",
                              "q_calib_load", "trace", "session_init", "calibration_start"),
    "quantize: layer forwards (calibrate + propagate)": ("forward", "act_cache_init",
                                                         "act_fetch", "act_store"),
    "quantize: Hessian accumulation": ("hessian",),
    "quantize: observer search (imatrix_mse)": ("observer_search",),
    "quantize: GPTQ solve": ("gptq_solve_weight", "gptq_solve", "epoch_end"),
    "quantize: compress + save": ("compress", "save_write", "session_finalize",
                                  "calibration_end"),
    "eval: load models": ("eval_load",),
    "eval: perplexity": ("eval_ppl",),
    "eval: multiple choice, model forwards": ("lmeval_forward",),
    "eval: multiple choice, lm-eval task index + setup": ("lmeval_task_index",
                                                          "lmeval_hflm_init", "lmeval_other",
                                                          "eval_mc"),
    "pipeline: hashing, manifest, checks": ("q_model_hash", "q_hash_outputs",
                                            "q_check_outputs", "q_manifest", "q_preflight",
                                            "q_check_model", "q_check_arch", "q_export",
                                            "q_compat"),
}


def group(phases: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    seen: set[str] = set()
    for name, members in GROUPS.items():
        out[name] = round(sum(phases.get(m, 0.0) for m in members), 2)
        seen.update(members)
    out["other (imports, CLI, glue)"] = round(
        sum(v for k, v in phases.items() if k not in seen), 2)
    return out


def child(source: str, cache: str, out: str, result: str, recipe: str) -> None:
    """One `quantize run` of the default recipe in this process, under the phase timers."""
    sys.path.insert(0, source)
    os.chdir(source)
    os.environ["QUANTIZE_CACHE"] = cache
    t_import = time.perf_counter()
    try:  # what the CLI does before torch loads (a source tree from before it lacks it)
        from quantize.cli.app import openmp_waits_passively

        openmp_waits_passively()
    except ImportError:
        pass
    from bench import profiler

    prof = profiler.Prof()
    prof.enter("other")
    import quantize

    assert quantize.__file__ is not None and quantize.__file__.startswith(source), \
        quantize.__file__
    from quantize.cli.app import main

    profiler.TARGETS.extend(EVAL_TARGETS)
    missing = profiler.install(prof)
    import_s = time.perf_counter() - t_import
    code = 0
    try:
        main.main(["run", recipe, "--model", "default", "--out", out],
                  standalone_mode=False)
    except SystemExit as exc:
        code = int(exc.code or 0)
    prof.exit()
    rep = profiler.hooks_report(prof)
    manifest = json.loads((Path(out) / "manifest.json").read_text())
    ev = json.loads((Path(out) / "eval" / "eval.json").read_text())
    gate = json.loads((Path(out) / "gate" / "gate.json").read_text())
    Path(result).write_text(json.dumps({
        "exit": code, "import_s": round(import_s, 2),
        "stage_s": {k: v.get("duration_s") for k, v in manifest["stages"].items()},
        "baseline_cached": ev["baseline"]["cached"],
        "eval_timing": ev["timing"],
        "metrics": {r["name"]: {"baseline": r["baseline"], "candidate": r["candidate"],
                                "recovery": r["recovery"], "diff_se": r["diff_se"], "n": r["n"]}
                    for r in ev["metrics"]},
        "gate": {"verdict": gate["verdict"],
                 "rows": {r["name"]: [r["verdict"], r.get("note", "")] for r in gate["rows"]}},
        "gptq_loss_sum": rep.get("gptq_loss_sum"),
        "phases_s": rep["phases_s"], "groups_s": group(rep["phases_s"]),
        "calls": rep["calls"], "unpatched": missing}))


def run_row(name: str, source: Path, cache: Path, out: Path, recipe: str) -> dict[str, Any]:
    result = out / f"{name}.result.json"
    run_dir = out / f"{name}.run"
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(HERE), "QUANTIZE_CACHE": str(cache)}
    t0 = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "bench.make_quantize_cpu", "--child", str(source),
             str(cache), str(run_dir), str(result), recipe],
            cwd=HERE, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not result.is_file():
        raise SystemExit(f"row {name} failed (exit {proc.returncode}); see {out / name}.log")
    rec = json.loads(result.read_text())
    rec.update({"row": name, "source": str(source), "recipe": recipe, "wall_s": round(wall, 1)})
    return rec


def fresh_cache(model_cache: Path, dest: Path) -> Path:
    """A cache holding the converted model and the hashes only (no baseline scores)."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    shutil.copytree(model_cache / "models", dest / "models")
    if (model_cache / "hashes.json").is_file():
        shutil.copy2(model_cache / "hashes.json", dest / "hashes.json")
    return dest


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        child(*argv[1:6])
        return
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--row", action="append", required=True, help="NAME=SOURCE_TREE")
    p.add_argument("--cache", choices=("cold", "warm", "both"), default="both")
    p.add_argument("--recipe", default="gptq-int4-asym-g32",
                   help="the recipe each row runs (default: make quantize's)")
    p.add_argument("--model-cache", default=os.environ.get("QUANTIZE_CACHE", "/work/qcache"))
    p.add_argument("--out", required=True)
    p.add_argument("--json-out", default=None)
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    trees = []
    passes = ["cold", "warm"] if a.cache == "both" else [a.cache]
    for spec in a.row:
        name, _, src = spec.partition("=")
        cache = fresh_cache(Path(a.model_cache), out / f"{name}.cache")
        trees.append((name, Path(src).resolve(), cache))
        if passes == ["warm"]:  # fill the baseline cache first, untimed
            run_row(f"{name}-fill", Path(src).resolve(), cache, out, a.recipe)
    for kind in passes:  # the rows alternate within each pass: the same machine state
        for name, src_path, cache in trees:
            rec = run_row(f"{name}-{kind}", src_path, cache, out, a.recipe)
            rec["cache"] = kind
            rows.append(rec)
            print(json.dumps({k: rec[k] for k in ("row", "wall_s", "stage_s", "groups_s",
                                                  "baseline_cached", "gate")}), flush=True)
    for rec in rows:
        m = rec["metrics"]
        print(f"{rec['row']:>14}: {rec['wall_s']:6.1f} s wall | quantize "
              f"{rec['stage_s'].get('quantize')} s, eval {rec['stage_s'].get('eval')} s | "
              f"wiki_ppl {m['wiki_ppl']['candidate']:.4f} | gate {rec['gate']['verdict']}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
