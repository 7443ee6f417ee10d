"""`quantize fit`: the per-layer precision assignment that fits a GPU, context and users,
run through the normal pipeline. The logic is quantize.fit's; this command only orders the
steps (budget -> calibrate -> sensitivity -> knapsack -> recipe -> pipeline -> verify)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click

from quantize.cli.app import handle_errors, main
from quantize.cli.plan_cmd import GPUS, SEQS, TOKENS
from quantize.recipe.recipe import DEFAULT_RECIPE

if TYPE_CHECKING:
    from quantize.pipeline import RunOptions


def _bits(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        raise click.BadParameter(
            f"{text!r}: give comma-separated bit widths, e.g. 4,8,16") from None


@main.command("fit")
@click.argument("model", default="default")
@click.option("--gpu", "gpu_name", default=None, help="GPU from the catalog (quantize/data/"
              "gpus.yaml), e.g. rtx5090, l4, h100")
@click.option("--gpus", default=1, show_default=True, type=GPUS, help="GPUs (tensor parallel)")
@click.option("--max-model-len", "context", default=32768, show_default=True, type=TOKENS)
@click.option("--concurrency", default=16, show_default=True, type=SEQS,
              help="sequences that must fit at once at --max-model-len")
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8"]), default="auto",
              show_default=True)
@click.option("--min-recovery", type=float, default=None,
              help="smallest assignment whose predicted perplexity recovery reaches this")
@click.option("--max-weights", default=None,
              help="the weight budget directly (e.g. 120MB, 0.5GiB); with --gpu, the smaller")
@click.option("--bits", "bits_text", default="4,8,16", show_default=True,
              help="candidate precisions (the base recipe's bits, 8, 16)")
@click.option("--recipe", "base_name", default=DEFAULT_RECIPE, show_default=True,
              help="the base (lowest-precision) recipe")
@click.option("--sensitivity-tokens", default=512, show_default=True,
              type=click.IntRange(16, 1_000_000),  # a recipe's mixed_precision.tokens too
              help="calibration tokens each sensitivity forward pass scores, rounded up to whole "
                   "calibration samples")
@click.option("--out", "-o", type=click.Path(path_type=Path), default=None,
              help="run folder (default runs/<model>-fit-<budget>)")
@click.option("--runs", "runs_dirs", multiple=True, type=click.Path(path_type=Path),
              help="folders of runs to plot against (default: runs)")
@click.option("--gpu-file", type=click.Path(path_type=Path), default=None)
@click.option("--dataset", "-d", default=None, help="calibration data (as quantize run)")
@click.option("--suite", default=None, help="eval suite (default: the base recipe's)")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto")
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="load the export in vLLM (quantize verify) after the gate")
@click.option("--dry-run", is_flag=True,
              help="print the budget and the assignment (and write the recipe) without "
                   "quantizing")
@handle_errors
def fit_cmd(model: str, gpu_name: str | None, gpus: int, context: int, concurrency: int,
            kv_cache_dtype: str, min_recovery: float | None, max_weights: str | None,
            bits_text: str, base_name: str, sensitivity_tokens: int, out: Path | None,
            runs_dirs: tuple[Path, ...], gpu_file: Path | None, dataset: str | None,
            suite: str | None, device: str, verify: bool, dry_run: bool) -> None:
    """Choose 4, 8 or 16 bits per layer so that MODEL serves --max-model-len tokens to
    --concurrency users on --gpus x --gpu (or fits --max-weights) with the least measured
    loss; write the recipe and run it through calibrate -> ... -> gate -> verify."""
    from quantize.fit.assign import setup
    from quantize.fit.budget import Serving
    from quantize.planner.gpus import find
    from quantize.progress import info
    from quantize.recipe.recipe import load_recipe, suite_for

    base = load_recipe(base_name)
    if not dry_run:
        suite_for(base, suite)  # a bad suite fails now, not after calibration
    serving = (Serving(find(gpu_name, gpu_file), gpus, context, concurrency,
                       kv_cache_dtype == "fp8") if gpu_name else None)
    weights = _size(max_weights) if max_weights else None
    p = setup(model, base, serving, weights, _bits(bits_text), min_recovery)
    for line in p.budget.lines():
        info(line)
    tag = _tag(gpu_name, gpus, context, concurrency, kv_cache_dtype, weights)
    run_dir = out or Path("runs") / f"{p.source.name}-fit-{tag}"
    measured = not (dry_run and p.source.origin.startswith(("builtin:", "hub:")))
    opts = FitRun(model=model, out=run_dir, dataset=dataset, suite=suite, device=device)
    costs = _costs(p, base_name, opts, sensitivity_tokens) if measured else _prior(p)
    _assign_and_run(p, costs, measured, opts, f"fit-{tag}", dry_run, verify,
                    [*runs_dirs] or [Path("runs")])


def _size(text: str) -> int:
    """--max-weights in bytes; a number too large for a float (400 digits) is refused as
    a bad size (--min-recovery, --bits and the size's own form are refused by quantize.fit)."""
    from quantize.errors import FitError
    from quantize.fit.budget import parse_size

    try:
        return parse_size(text)
    except OverflowError:
        raise FitError(problem=f"--max-weights {text[:40]!r} is not a positive size",
                       hint="write e.g. 120MB, 0.5GiB or a byte count") from None


def _tag(gpu: str | None, gpus: int, context: int, users: int, kv: str,
         weights: int | None) -> str:
    parts = [f"{re.sub(r'[^a-z0-9]+', '', gpu.lower())}x{gpus}-{context // 1024}k-{users}u"
             + ("-kvfp8" if kv == "fp8" else "")] if gpu else []
    if weights:
        parts.append(f"{weights / 1e6:.0f}MB")
    return "-".join(parts)[:56]


def _prior(p: object) -> dict[str, dict[int, float]]:
    from quantize.fit.assign import Problem
    from quantize.fit.sensitivity import prior
    from quantize.progress import info

    assert isinstance(p, Problem)
    info("sensitivity: no weights for a built-in config; ranking by a prior (llama.cpp's "
         "k-quant emphasis), no recovery predicted")
    return prior(p.units, p.shape.layers)


@dataclass(frozen=True)
class FitRun:
    """Where and on what the fit's pipeline runs (calibrate, then the fitted recipe)."""

    model: str
    out: Path
    dataset: str | None
    suite: str | None
    device: str

    def options(self, recipe: str, until: str) -> RunOptions:
        from quantize.pipeline import RunOptions

        return RunOptions(recipe=recipe, until=until, model=self.model, out=self.out,
                          dataset=self.dataset, suite=self.suite, device=self.device,
                          shared_folder=True)


def _costs(p: object, base_name: str, opts: FitRun,
           n_tokens: int) -> dict[str, dict[int, float]]:
    """Calibrate (the pipeline's own stage, into the run folder), then measure."""
    from quantize.fit.assign import Problem
    from quantize.fit.sensitivity import VERSION, SensitivityKey, measure
    from quantize.pipeline import run
    from quantize.stages import calibrate

    assert isinstance(p, Problem)
    run_dir = opts.out
    pipe = run(opts.options(base_name, "calibrate"))
    from quantize.run.results import CalibrationSummary

    calib = pipe.manifest.result("calibrate", CalibrationSummary).fingerprint
    key = SensitivityKey(calib, pipe.fingerprint(), p.base.scheme, p.units.group,
                         sorted({c.bits for u in p.units.units for c in u.choices}), n_tokens,
                         VERSION)
    return measure(pipe.model.path, p.units, calibrate.load(run_dir / "calibrate"), n_tokens,
                   run_dir / "fit" / "sensitivity.json", key)


def _assign_and_run(p: object, costs: dict[str, dict[int, float]], measured: bool,
                    opts: FitRun, name: str, dry_run: bool, verify: bool,
                    roots: list[Path]) -> None:
    from quantize.errors import GateFailed
    from quantize.fit import report
    from quantize.fit.assign import Problem, solve
    from quantize.fit.recipe_writer import fit_recipe, write_recipe
    from quantize.progress import info

    assert isinstance(p, Problem)
    run_dir, model = opts.out, opts.model
    a = solve(p, costs, measured)
    path = write_recipe(fit_recipe(p, a, name), run_dir)
    for line in report.assignment_lines(p, a) + report.unit_table(p, a, costs):
        info(line)
    fits, lines = report.planner_lines(p, a, str(run_dir / "export"))
    for line in lines:
        info(line)
    extra: dict[str, object] = {"recipe": str(path), "fits": fits}
    if dry_run:
        report.record(run_dir / "fit", p, a, extra)
        info(f"dry run: recipe {path}; build it with: quantize run {path} --model {model} "
             f"--out {run_dir}")
        return
    from quantize.cli.summary import print_summary
    from quantize.pipeline import run

    pipe = run(opts.options(str(path), "gate"))
    print_summary(pipe)
    extra["measured_recovery"] = measured_rec = report.ppl_recovery(run_dir)
    extra["export_bytes"] = report.export_size(run_dir)
    if verify:
        from quantize.stages.verify import verify as verify_run

        v = verify_run(run_dir)
        extra["verify"] = {"verdict": v.verdict, "level": v.level, "result": v.result}
        info(f"verify: {v.result or v.verdict}")
    report.record(run_dir / "fit", p, a, extra)
    pred = a.predicted_recovery
    info(f"recovery: predicted {pred:.1%}, measured {measured_rec:.1%} (gate, perplexity)"
         if pred is not None and measured_rec is not None else f"recovery: measured "
         f"{measured_rec}")
    plot = report.pareto_plot(report.collect([*roots, run_dir.parent]),
                              run_dir / "fit" / "pareto.png", f"{p.source.name}: size vs "
                              "recovery")
    if plot:
        info(f"Pareto plot: {plot}")
    if pipe.manifest.releasable is False:
        raise GateFailed(problem="gate failed, so the run is marked not releasable",
                         hint=f"see {run_dir}/gate")
