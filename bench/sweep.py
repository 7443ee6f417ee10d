"""The 4-bit comparison of issue #15 on the default model: each variant recipe through the
real pipeline (calibrate -> quantize -> export -> eval -> gate), one after another, every one
with the same calibration spec unless the variant names its own.

  python -m bench.sweep --out DIR [--device cpu|cuda] [--deadline-s S] NAME_OR_YAML...

Names are looked up in bench/variants/ and then in recipes/. On a GPU the numerics are kept
those of the CPU path users run (`make quantize`): calibration and eval in fp32, TF32 off,
so the GPU only makes the sweep faster, not different. Everything lands in DIR/sweep.json
(one row per variant: eval metrics with baseline and recovery, gate verdict, export bytes,
quantize seconds, peak memory), rewritten after each variant, so a deadline or a crash keeps
what finished. `python -m bench.sweep --table DIR/sweep.json` prints the markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ROOT / "bench" / "variants"
# seconds each kind of variant took on an H200 in fp32 (to skip what no longer fits)
ESTIMATE_S = {"gptq": 60, "rtn": 30, "awq": 150, "autoround": 240, "awq+gptq": 180}


def recipe_path(name: str) -> str:
    if name.endswith((".yaml", ".yml")):
        return name
    own = VARIANTS / f"{name}.yaml"
    return str(own) if own.is_file() else name


def fp32_on_gpu() -> None:
    """Calibrate and evaluate in fp32 on the GPU, TF32 off: the CPU path's numerics."""
    import torch

    import quantize.backends.llmcompressor as engine
    import quantize.stages.eval as ev

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    engine.dtypes = lambda job, _orig=engine.dtypes: (_orig(job)[0], torch.float32)
    engine._gpu_speedups = lambda offload=False: {
        "sequential_offload_device": "cpu" if offload else "cuda"}

    def load_fp32(path: Path, device: str, _orig: Any = ev.load_model) -> tuple[Any, Any]:
        model, tok = _orig(path, "cpu")
        return model.to(device), tok

    ev.load_model = load_fp32


def row(name: str, run_dir: Path, error: str | None, wall_s: float,
        recipe: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"variant": name, "wall_s": round(wall_s, 1), "error": error,
                           "recipe": recipe}
    man_path = run_dir / "manifest.json"
    if not man_path.is_file():
        return out
    man = json.loads(man_path.read_text())
    st = man.get("stages", {})
    q = st.get("quantize", {})
    out["quantize_s"] = q.get("duration_s")
    out["peak_rss_gib"] = (q.get("summary") or {}).get("peak_rss_gib")
    out["export_bytes"] = (st.get("export", {}).get("summary") or {}).get("weights_bytes")
    out["calibration"] = st.get("calibrate", {}).get("summary")
    ev_path = run_dir / "eval" / "eval.json"
    if ev_path.is_file():
        ev = json.loads(ev_path.read_text())
        out["metrics"] = {m["name"]: {k: m.get(k) for k in (
            "baseline", "candidate", "recovery", "n", "diff_se", "threshold")}
            for m in ev["metrics"]}
    gate = run_dir / "gate" / "gate.json"
    if gate.is_file():
        out["gate"] = json.loads(gate.read_text()).get("verdict")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="default")
    ap.add_argument("--suite", default=None, help="eval suite (default: each recipe's)")
    ap.add_argument("--deadline-s", type=float, default=float("inf"))
    ap.add_argument("--table", type=Path, help="print the table of a sweep.json and stop")
    ap.add_argument("--resume", action="store_true",
                    help="keep the finished rows of an existing OUT/sweep.json and skip them "
                         "(a variant stopped part-way resumes at its first unfinished stage)")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    start = time.monotonic()
    if args.device != "cpu":
        fp32_on_gpu()
    from quantize.errors import QuantizeError
    from quantize.pipeline import RunOptions, run
    from quantize.recipe.recipe import load_recipe

    args.out.mkdir(parents=True, exist_ok=True)
    result_path = args.out / "sweep.json"
    rows: list[dict[str, Any]] = []
    if args.resume and result_path.is_file():
        rows = [r for r in json.loads(result_path.read_text())["rows"]
                if not str(r.get("error") or "").startswith("skipped")]
    done = {r["variant"] for r in rows}
    result: dict[str, Any] = {"device": args.device, "rows": rows}
    try:
        import torch

        result["torch"] = torch.__version__
        if args.device != "cpu":
            result["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    for name in args.names:
        path = recipe_path(name)
        if Path(path).stem in done:
            continue
        recipe = load_recipe(path)
        est = ESTIMATE_S.get(recipe.method, 60)
        if time.monotonic() - start + est > args.deadline_s:
            rows.append({"variant": name, "error": "skipped: deadline"})
            continue
        run_dir = args.out / "runs" / Path(path).stem
        t0 = time.monotonic()
        error = None
        if args.device != "cpu":
            import torch

            torch.cuda.reset_peak_memory_stats()
        try:
            run(RunOptions(recipe=path, model=args.model, out=run_dir, device=args.device,
                           suite=args.suite))
        except QuantizeError as exc:  # a failed gate still has its eval
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        except Exception as exc:  # an engine crash ends this variant, not the sweep
            error = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        r = row(Path(path).stem, run_dir, error, time.monotonic() - t0,
                recipe.model_dump(mode="json", exclude={"description", "eval"}))
        if args.device != "cpu":
            import torch

            r["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        rows.append(r)
        result_path.write_text(json.dumps(result, indent=1))
        print(f"{name}: {r.get('gate')} {r.get('error') or ''} {r['wall_s']} s", flush=True)
    result_path.write_text(json.dumps(result, indent=1))
    print(table(result))


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def table(result: dict[str, Any]) -> str:
    rows = [r for r in result["rows"] if r.get("metrics")]
    names = list(rows[0]["metrics"]) if rows else []
    head = ["variant", "method", "scheme", "observer", *names, "MiB", "quantize s", "gate"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        rec = r.get("recipe") or {}
        cells = [r["variant"], str(rec.get("method", "?")), str(rec.get("scheme", "?")),
                 str(rec.get("observer") or "minmax")]
        for n in names:
            m = r["metrics"].get(n, {})
            cand = m.get("candidate")
            val = "—" if cand is None else (f"{cand:.2f}" if n.endswith("ppl")
                                            else f"{100 * cand:.1f}%")
            cells.append(f"{val} ({_pct(m.get('recovery'))})")
        eb = r.get("export_bytes")
        cells += ["—" if eb is None else f"{eb / 2**20:.1f}", str(r.get("quantize_s")),
                  str(r.get("gate"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
