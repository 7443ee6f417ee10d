"""CPU AWQ vs GPTQ (issue #20, goal 5): quantize-stage time and wiki perplexity of AWQ and
GPTQ recipes on the default model, in ONE process, one after another, so both see the same
machine load (the 2-core machine is shared; lone absolute times mean little).

  python -m bench.awq_cpu --out DIR [--record-search VARIANT] VARIANT...
  python -m bench.awq_cpu --analyse DIR/search.json
  python -m bench.awq_cpu --layers N VARIANT...   # profile: oneshot on the first N layers

Each variant (a name in bench/variants/ or recipes/, or a YAML path) runs the real pipeline
(calibrate -> quantize -> export -> eval) with the perplexity-only suite bench/wiki-ppl.yaml
(the default suite's wiki_ppl metric, unchanged). DIR/awq_cpu.json gets one row per variant
(quantize stage seconds from the run manifest, wiki_ppl, recovery, paired noise) and a
`cpu_awq_vs_gptq` block, the input of bench/results/latest.json's block of that name: the
first AWQ row against the first GPTQ row, plus each AWQ row's paired perplexity difference
against the first AWQ row (same windows). Each row also has the quantize stage's process CPU
seconds (all threads), which other users of the machine disturb less than wall time.
--record-search NAME keeps, for that variant's AWQ mappings, the search loss of every grid
candidate on every calibration batch (DIR/search.json); --analyse then says which candidate
a search on fewer samples or a coarser grid would have picked, and what that choice loses on
all samples, without re-running anything. --layers N profiles plain `oneshot` (the recipe's
modifiers, fp32, batch 1, the same calibration tokens) on the model cut to its first N
decoder layers: wall and CPU seconds, and the time AWQ spends in its search's forwards.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

from bench.sweep import recipe_path

SUITE = str(Path(__file__).resolve().parent / "wiki-ppl.yaml")


def record_search(sink: list[dict[str, Any]]) -> None:
    """Wrap AWQ's search so each mapping's per-batch losses land in `sink`."""
    import torch
    from llmcompressor.modifiers.transform.awq import AWQModifier

    best, loss = AWQModifier._compute_best_scale, AWQModifier._compute_loss

    def best_scale(self: Any, mapping: Any, *a: Any, **k: Any) -> Any:
        sink.append({"mapping": mapping.smooth_name, "parent": type(mapping.parent).__name__,
                     "grid": [list(g) for g in self._get_grid_search_params()], "loss": []})
        return best(self, mapping, *a, **k)

    def compute_loss(self: Any, fp16: list[Any], quant: list[Any]) -> float:
        sink[-1]["loss"].append([
            [float(torch.nn.functional.mse_loss(f, q, reduction="sum")), f.numel()]
            for f, q in zip(fp16, quant, strict=True)])
        return float(loss(self, fp16, quant))

    AWQModifier._compute_best_scale = best_scale  # type: ignore[method-assign]
    AWQModifier._compute_loss = compute_loss  # type: ignore[method-assign]


def time_quantize(sink: list[float]) -> None:
    """Process CPU seconds (all threads) of each llm-compressor quantize call."""
    from quantize.backends.llmcompressor import LLMCompressorBackend

    orig = LLMCompressorBackend.quantize

    def quantize(self: Any, job: Any, out: Path) -> dict[str, Any]:
        t0 = time.process_time()
        try:
            return orig(self, job, out)
        finally:
            sink.append(time.process_time() - t0)

    LLMCompressorBackend.quantize = quantize  # type: ignore[method-assign]


def capture_scores(store: dict[str, Any]) -> None:
    """Keep each candidate's per-window NLLs (eval.json drops them) for paired differences."""
    import quantize.stages.eval as ev

    orig = ev.score

    def score(path: Any, suite: Any, device: Any, role: str, engine: Any) -> Any:
        out = orig(path, suite, device, role, engine)
        if role == "candidate":
            store["last"] = out.metrics["wiki_ppl"].per_window_nll
        return out

    ev.score = score  # type: ignore[assignment]


def run_variant(name: str, out: Path, scores: dict[str, Any]) -> dict[str, Any]:
    from quantize.pipeline import RunOptions, run
    from quantize.recipe.recipe import load_recipe

    path = recipe_path(name)
    recipe = load_recipe(path)
    run_dir = out / "runs" / Path(path).stem
    t0 = time.monotonic()
    run(RunOptions(recipe=path, model="default", out=run_dir, device="cpu", suite=SUITE,
                   until="eval"))
    man = json.loads((run_dir / "manifest.json").read_text())
    metric = next(m for m in json.loads((run_dir / "eval" / "eval.json").read_text())["metrics"]
                  if m["name"] == "wiki_ppl")
    return {"variant": Path(path).stem, "method": recipe.method,
            "awq": recipe.awq.model_dump() if recipe.awq else None,
            "quantize_stage_s": man["stages"]["quantize"]["duration_s"],
            "wall_s": round(time.monotonic() - t0, 1), "load_avg_after": os.getloadavg(),
            "wiki_ppl": metric["candidate"], "baseline_ppl": metric["baseline"],
            "recovery": metric["recovery"], "n_tokens": metric["n"],
            "diff_se_vs_baseline": metric["diff_se"], "per_window_nll": scores.pop("last", None)}


def paired(a: list[float] | None, b: list[float] | None) -> dict[str, float] | None:
    """Mean per-window NLL difference b - a and its standard error (log-perplexity)."""
    if not a or not b or len(a) != len(b) or len(a) < 2:
        return None
    d = [y - x for x, y in zip(a, b, strict=True)]
    mean = sum(d) / len(d)
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d))
    return {"mean_log_ppl_diff": round(mean, 5), "se": round(se, 5), "windows": len(d)}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    awq = [r for r in rows if r["method"] == "awq"]
    gptq = [r for r in rows if r["method"] == "gptq"]
    block: dict[str, Any] = {}
    if awq and gptq:
        a, g = awq[0], gptq[0]
        block = {"awq_quantize_stage_s": a["quantize_stage_s"],
                 "gptq_quantize_stage_s": g["quantize_stage_s"],
                 "ratio": round(a["quantize_stage_s"] / g["quantize_stage_s"], 2),
                 "awq_wiki_ppl": round(a["wiki_ppl"], 4), "gptq_wiki_ppl": round(g["wiki_ppl"], 4),
                 "awq_variant": a["variant"], "gptq_variant": g["variant"],
                 "awq_quantize_cpu_s": a.get("quantize_cpu_s"),
                 "gptq_quantize_cpu_s": g.get("quantize_cpu_s"),
                 "note": "default model (SmolLM2-135M-Instruct, bf16, fp32 compute), shared "
                 "2-core CPU, one process, rows back to back (bench/awq_cpu.py)"}
    for r in awq[1:]:
        r["vs_first_awq"] = paired(awq[0]["per_window_nll"], r["per_window_nll"])
        r["ratio_vs_first_gptq"] = (round(r["quantize_stage_s"] / gptq[0]["quantize_stage_s"], 2)
                                    if gptq else None)
    return block


def analyse(records: list[dict[str, Any]]) -> dict[str, Any]:
    """For each (samples, grid) setting: how often the reduced search picks the full search's
    candidate, and the full-sample loss of its pick over the best, summed over mappings."""
    out: dict[str, Any] = {}
    for rec in records:
        loss = rec["loss"]  # [candidate][batch] = [sum of squares, elements]
        n_b = len(loss[0])
        grid = [tuple(g) for g in rec["grid"]]
        full = [sum(s for s, _ in c) / sum(n for _, n in c) for c in loss]
        best = min(full)
        for k in (1, 2, 4, 8, 16, n_b):
            if k > n_b:
                continue
            idx = sorted({(i * n_b) // k for i in range(k)})
            for n_grid, keep in _grids(grid).items():
                sub = {c: sum(loss[c][b][0] for b in idx) for c in keep}
                pick = min(sub, key=lambda c: sub[c])
                o = out.setdefault(f"samples={k} n_grid={n_grid}",
                                   {"same_pick": 0, "mappings": 0, "excess_loss": 0.0,
                                    "best_loss": 0.0})
                o["same_pick"] += int(full[pick] == best)
                o["mappings"] += 1
                o["excess_loss"] += full[pick] - best
                o["best_loss"] += best
    for o in out.values():
        o["excess_loss_pct"] = round(100 * o.pop("excess_loss") / o.pop("best_loss"), 4)
    return out


def profile(names: list[str], layers: int) -> list[dict[str, Any]]:
    """oneshot of each variant on the first `layers` decoder layers, one after another."""
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.quant_run import calibration_samples
    from quantize.backends._awq_search import SubsetSearchAWQModifier
    from quantize.backends.llmcompressor import build_modifiers, prepare_engine
    from quantize.model.source import default_model_dir
    from quantize.recipe.recipe import load_recipe

    prepare_engine()
    spent = {"search_forward_s": 0.0, "search_forward_calls": 0}
    for cls in (AWQModifier, SubsetSearchAWQModifier):
        def run_samples(self: Any, module: Any, _orig: Any = cls._run_samples) -> Any:
            t0 = time.perf_counter()
            out = _orig(self, module)
            spent["search_forward_s"] += time.perf_counter() - t0
            spent["search_forward_calls"] += 1
            return out
        cls._run_samples = run_samples  # type: ignore[method-assign]
    model_dir = default_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    samples = calibration_samples("awq-int4", "wiki", str(model_dir))
    rows = []
    for name in names:
        recipe = load_recipe(recipe_path(name))
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
        spent.update(search_forward_s=0.0, search_forward_calls=0)
        ds = Dataset.from_dict({"input_ids": samples,
                                "attention_mask": [[1] * len(x) for x in samples]})
        group = recipe.group_size if isinstance(recipe.group_size, int) else None
        t0, c0 = time.perf_counter(), time.process_time()
        oneshot(model=model, processor=tok, recipe=build_modifiers(recipe, group),
                dataset=ds, num_calibration_samples=len(samples), batch_size=1,
                max_seq_length=max(len(x) for x in samples), shuffle_calibration_samples=False)
        rows.append({"variant": Path(recipe_path(name)).stem, "layers": layers,
                     "wall_s": round(time.perf_counter() - t0, 1),
                     "cpu_s": round(time.process_time() - c0, 1),
                     "search_forward_s": round(spent["search_forward_s"], 1),
                     "search_forward_calls": spent["search_forward_calls"],
                     "tokens": sum(len(x) for x in samples), "load_avg": os.getloadavg()})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _grids(grid: list[tuple[Any, ...]]) -> dict[int, list[int]]:
    """Candidate indices of the grids a smaller n_grid makes, where they are a subset of the
    recorded one (duo_scaling true: ratios i/(n_grid-2) plus the unscaled candidate)."""
    n = len(grid)
    out = {n: list(range(n))}
    if not all(g[1] for g in grid[1:]) or grid[0] != (0.0, False):
        return out
    step = n - 2
    for smaller in range(3, n):
        if step % (smaller - 2) == 0:
            stride = step // (smaller - 2)
            out[smaller] = [0] + [1 + i * stride for i in range(smaller - 1)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--record-search", default=None, metavar="VARIANT",
                    help="record this variant's search losses (patched in just before it runs)")
    ap.add_argument("--analyse", type=Path, help="a search.json: print the analysis and stop")
    ap.add_argument("--layers", type=int, help="profile oneshot on the first N decoder layers")
    args = ap.parse_args()
    if args.analyse:
        print(json.dumps(analyse(json.loads(args.analyse.read_text())), indent=1))
        return
    if args.layers:
        rows = profile(args.names, args.layers)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "profile.json").write_text(json.dumps(rows, indent=1))
        return
    import llmcompressor
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    cpu_s: list[float] = []
    time_quantize(cpu_s)
    scores: dict[str, Any] = {}
    capture_scores(scores)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "versions": {"torch": torch.__version__, "llmcompressor": llmcompressor.__version__},
        "load_avg_start": os.getloadavg(), "rows": []}
    for name in args.names:
        if name == args.record_search:
            record_search(records)
        result["rows"].append(run_variant(name, args.out, scores))
        result["rows"][-1]["quantize_cpu_s"] = round(cpu_s.pop(), 1) if cpu_s else None
        result["cpu_awq_vs_gptq"] = summary(result["rows"])
        (args.out / "awq_cpu.json").write_text(json.dumps(result, indent=1))
        if records:
            (args.out / "search.json").write_text(json.dumps(records))
        r = result["rows"][-1]
        print(f"{r['variant']}: quantize {r['quantize_stage_s']} s, wiki_ppl "
              f"{r['wiki_ppl']:.4f}", flush=True)
    print(json.dumps(result.get("cpu_awq_vs_gptq"), indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
