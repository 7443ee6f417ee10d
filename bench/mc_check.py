"""The packed multiple-choice scorer (quantize/model/choice.py) against lm-eval's own HFLM on
the REAL default model: every request's log-likelihood, every example's accuracy, and the time
of each, for the baseline and a quantized export, on each multiple-choice metric of the suite.

  python -m bench.mc_check --export runs/SmolLM2-135M-Instruct-gptq-int4-asym/export \
      [--suite default] [--json-out r.json]

The two scorers run back to back on the same loaded model (plain HFLM first, then the packed
one), so their times compare on one machine state.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any


def run_task(lm: Any, spec: Any, workdir: Path) -> tuple[list[list[float]], list[float], float]:
    """Per example: each choice's log-likelihood, the accuracy; and the seconds taken."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from quantize.metrics import _prepare_task

    task, include = _prepare_task(spec, workdir)
    manager = TaskManager(include_path=str(include), include_defaults=False)
    t0 = time.perf_counter()
    out = simple_evaluate(model=lm, tasks=[task], task_manager=manager, num_fewshot=None,
                          log_samples=True, bootstrap_iters=0)
    seconds = time.perf_counter() - t0
    assert out is not None
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    lls = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
    return lls, [float(s["acc"]) for s in samples], seconds


def check_model(path: Path, label: str, suite: Any, workdir: Path) -> list[dict[str, Any]]:
    from lm_eval.models.huggingface import HFLM

    from quantize.metrics import hf_lm
    from quantize.model.choice import packable
    from quantize.stages.eval import load_model

    model, tok = load_model(path, "cpu")
    assert packable(model), f"{path}: not a packable model"
    rows = []
    for spec in suite.metrics:
        if spec.kind != "multiple_choice":
            continue
        plain = HFLM(pretrained=model, tokenizer=tok, batch_size=suite.batch_size)
        ll_a, acc_a, s_a = run_task(plain, spec, workdir / f"{label}-plain")
        ll_b, acc_b, s_b = run_task(hf_lm(model, tok, suite.batch_size), spec,
                                    workdir / f"{label}-packed")
        diffs = [abs(x - y) for a, b in zip(ll_a, ll_b, strict=True)
                 for x, y in zip(a, b, strict=True)]
        rels = [abs(x - y) / max(abs(x), 1e-9) for a, b in zip(ll_a, ll_b, strict=True)
                for x, y in zip(a, b, strict=True)]
        # the smallest gap between an example's best and second-best choice: how close a
        # rounding difference would have to come to flip an answer
        gaps = [sorted(a)[-1] - sorted(a)[-2] for a in ll_a if len(a) > 1]
        rows.append({
            "model": label, "metric": spec.name, "examples": len(acc_a),
            "requests": len(diffs), "acc_hflm": sum(acc_a) / len(acc_a),
            "acc_packed": sum(acc_b) / len(acc_b),
            "examples_differing": sum(a != b for a, b in zip(acc_a, acc_b, strict=True)),
            "max_abs_ll_diff": max(diffs), "max_rel_ll_diff": max(rels),
            "smallest_choice_gap": min(gaps), "hflm_s": round(s_a, 2),
            "packed_s": round(s_b, 2), "speedup": round(s_a / s_b, 2)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--export", required=True, help="a quantized export folder")
    p.add_argument("--suite", default="default")
    p.add_argument("--json-out", default=None)
    a = p.parse_args(argv)
    from quantize.model.source import resolve_model
    from quantize.recipe.recipe import load_suite

    suite = load_suite(a.suite)
    base = resolve_model("default").path
    with tempfile.TemporaryDirectory(prefix="mc-check-") as work:
        rows = check_model(base, "baseline", suite, Path(work))
        rows += check_model(Path(a.export), "candidate", suite, Path(work))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
