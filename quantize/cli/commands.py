"""The commands. Each is a few lines over a library function."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from quantize.cli.app import handle_errors, main
from quantize.pipeline.stages import PIPELINE, names
from quantize.recipe.consumers import CONSUMERS
from quantize.recipe.recipe import DEFAULT_RECIPE

# Only checked, never used to quantize: the export is the same for every tp, but vLLM shards
# it, so a tp the model's shapes cannot take is caught before calibration.
_tp_option = click.option(
    "--tp", type=click.IntRange(min=1), default=1, show_default=True,
    help="tensor-parallel size the export will be served with in vLLM: pre-flight checks that "
         "heads, sharded layers and group size split over this many GPUs")

# Only checked, never used to quantize: pre-flight says, before calibration, whether vLLM runs
# the recipe's format natively on this GPU, through a weight-only fallback, or not at all.
_gpu_option = click.option(
    "--gpu", "gpu", default=None,
    help="GPU the export is for (catalog name, e.g. rtx5090, h100, a100-80gb): pre-flight "
         "warns when vLLM cannot run the format natively there and says what would")


def _run_options(fn: Any) -> Any:
    opts = [
        click.argument("recipe", default=DEFAULT_RECIPE),
        click.option("--model", "-m", default=None,
                     help="local folder, Hugging Face Hub id, or `default` (SmolLM2-135M)"),
        click.option("--dataset", "-d", default=None,
                     help="calibration spec name/YAML, a .txt/.jsonl/.parquet file or folder, "
                          "or hf:<dataset id>"),
        click.option("--out", "-o", type=click.Path(path_type=Path), default=None,
                     help="run folder (default runs/<model>-<recipe>)"),
        click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto"),
        click.option("--rerun", multiple=True, type=click.Choice([*names(), "all"]),
                     help="re-run this stage even if its inputs are unchanged (repeatable)"),
        click.option("--allow-pickle", is_flag=True,
                     help="accept .bin/.pt weights (pickle can run code: trusted sources only)"),
        click.option("--suite", default=None, help="eval suite (default: the recipe's)"),
        _tp_option,
        _gpu_option,
        click.option("--gpus", type=click.IntRange(min=1), default=1, show_default=True,
                     help="calibrate data-parallel on this many GPUs (torchrun, llm-compressor's "
                          "DDP; with --device cpu: processes, gloo); other stages run once"),
        click.option("--no-disk-check", is_flag=True,
                     help="skip the check, before calibration, that the disk holds what the "
                          "remaining stages write"),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _run(until: str, **kw: Any) -> None:
    from quantize.cli.app import openmp_waits_passively

    openmp_waits_passively()
    from quantize.pipeline import RunOptions, run

    opts = RunOptions(recipe=kw["recipe"], model=kw["model"], dataset=kw["dataset"],
                      out=kw["out"], device=kw["device"], until=until, rerun=kw["rerun"],
                      allow_pickle=kw["allow_pickle"], suite=kw["suite"], tp=kw["tp"],
                      gpus=kw["gpus"], no_disk_check=kw["no_disk_check"], gpu=kw["gpu"])
    _finish(run(opts))


def _finish(pipe: Any) -> None:
    """Print the summary; a failed gate exits non-zero with every failure named."""
    from quantize.cli.summary import print_summary
    from quantize.errors import GateFailed
    from quantize.run.results import GateSummary

    print_summary(pipe)
    if "gate" in pipe.keys and pipe.manifest.releasable is False:
        from quantize.stages.gate import read_failures

        gate = pipe.manifest.result("gate", GateSummary)
        lines = read_failures(pipe.run_dir / "gate") or gate.failures
        raise GateFailed(problem=f"gate failed on {', '.join(gate.failures)}, so the run is "
                                 f"marked not releasable: {'; '.join(lines)}",
                         hint=f"see {pipe.run_dir / 'gate' / 'gate.md'} for details")


def _run_folder(run_dir: Path, until: str, suite: str | None, rerun: tuple[str, ...],
                eval_engine: Any = None, consumers: tuple[str, ...] | None = None) -> None:
    """Continue an existing run folder up to `until`, with the recipe and model it used."""
    from quantize.cli.app import openmp_waits_passively

    openmp_waits_passively()
    from quantize.errors import QuantizeError
    from quantize.pipeline import RunOptions, run
    from quantize.run.manifest import RunFolder

    m = RunFolder(run_dir).require()
    if m.recipe is None or m.model is None:
        raise QuantizeError(path=run_dir / "manifest.json", path_sep=" ",
                            problem="names no recipe or model",
                            hint="re-run the pipeline with `quantize run RECIPE --model M "
                                 "--out DIR`")
    opts = RunOptions(recipe=m.recipe.ref or m.recipe.name, model=m.model.source,
                      dataset=m.dataset, out=run_dir, device=m.device or "auto", until=until,
                      suite=suite, rerun=rerun,
                      tp=m.preflight.tp if m.preflight else 1,  # the tp the run was checked for
                      eval_engine=eval_engine, consumers=consumers)
    _finish(run(opts))


@main.command("run")
@_run_options
@handle_errors
def run_cmd(**kw: Any) -> None:
    """Run the whole pipeline for RECIPE (default: the best measured 4-bit recipe); finished
    stages are skipped."""
    _run("gate", **kw)


def _stage_command(stage: str, doc: str) -> None:
    @main.command(stage, help=doc)
    @_run_options
    @handle_errors
    def cmd(**kw: Any) -> None:
        _run(stage, **kw)


for _st in PIPELINE:  # the stages that take a RECIPE; eval and gate take a RUN (below)
    if _st.takes == "recipe":
        _stage_command(_st.name, _st.help)


def _help(name: str) -> str:
    return next(st.help for st in PIPELINE if st.name == name)


@main.command("eval", help=_help("eval"))
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--suite", default=None, help="eval suite name or YAML (default: the recipe's)")
@click.option("--rerun", is_flag=True, help="measure again even if nothing changed")
@click.option("--engine", type=click.Choice(["hf", "vllm", "auto", "transformers"]),
              default=None, help="what scores the suite: hf (transformers + lm-eval), vllm "
              "(the vLLM environment, one process per model) or auto (vLLM when the recipe "
              "quantizes the KV cache or the dense model does not fit in memory) [default: the "
              "recipe's or suite's eval.engine, else auto]")
@click.option("--tp", "eval_tp", type=click.IntRange(min=1), default=1, show_default=True,
              help="tensor-parallel size for --engine vllm (refused when larger than the "
                   "devices vLLM sees)")
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8", "bfloat16", "float16"]),
              default="auto", show_default=True,
              help="vLLM KV-cache dtype for the candidate (auto: the checkpoint's, fp8 when "
                   "it declares a kv_cache_scheme); the baseline always runs with its own")
@click.option("--vllm-python", default=None,
              help="python of the vLLM environment (default .venv-vllm/bin/python)")
@click.option("--out", "out", type=click.Path(path_type=Path), default=None,
              help="for a checkpoint folder: where eval/gate reports go (default: "
                   "<checkpoint>-eval)")
@handle_errors
def eval_cmd(run_dir: Path, suite: str | None, rerun: bool, engine: str | None, eval_tp: int,
             kv_cache_dtype: str, vllm_python: str | None, out: Path | None) -> None:
    # help: quantize.pipeline.stages (the stage's one declaration)
    from quantize.stages.eval.engine import EvalEngineRequest

    req = EvalEngineRequest("hf" if engine == "transformers" else engine, eval_tp, kv_cache_dtype,
                        vllm_python)
    req.check()
    from quantize.pipeline.checkpoint import is_checkpoint

    if is_checkpoint(run_dir):  # an export folder, not a run folder
        _checkpoint_eval(run_dir, suite, out, req)
        return
    _run_folder(run_dir, "eval", suite, ("eval",) if rerun else (), req)


def _checkpoint_eval(folder: Path, suite: str | None, out: Path | None, req: Any) -> None:
    from quantize.cli.app import openmp_waits_passively

    openmp_waits_passively()
    from quantize.errors import GateFailed
    from quantize.pipeline import pick_device
    from quantize.pipeline.checkpoint import evaluate

    dest = out or folder.with_name(folder.name + "-eval")
    s = evaluate(folder, suite, dest, pick_device("auto"), req)
    click.echo((dest / "gate.md").read_text())
    click.echo(f"reports: {dest}")
    if s.gate.verdict != "pass":
        from quantize.stages.gate import read_failures

        raise GateFailed(problem=f"gate failed: {', '.join(s.gate.failures)}: "
                                 f"{'; '.join(read_failures(dest) or s.gate.failures)}",
                         hint=f"see {dest}/gate.md")


@main.command("gate", help=_help("gate"))
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--suite", default=None, help="eval suite name or YAML (default: the recipe's)")
@click.option("--consumer", "consumers", multiple=True, type=click.Choice(sorted(CONSUMERS)),
              help="judge the export for this consumer (repeatable; default: the consumers "
                   "the recipe advertises): the gate fails when one loads it wrong")
@handle_errors
def gate_cmd(run_dir: Path, suite: str | None, consumers: tuple[str, ...]) -> None:
    # help: quantize.pipeline.stages
    _run_folder(run_dir, "gate", suite, (), consumers=consumers or None)


@main.command("recipes")
@handle_errors
def recipes_cmd() -> None:
    """List the shipped recipes with one-line descriptions."""
    from quantize.recipe.recipe import available, load_recipe

    names = available("recipes")
    width = max((len(n) for n in names), default=0)
    for name in names:
        r = load_recipe(name)
        group = " g auto" if r.group_size == "auto" else f" g{r.group_size}"
        fmt = r.scheme + (group if r.group_size else "") + (
            " +kv-fp8" if r.kv_cache else "") + (" +8-bit" if r.mixed_precision else "")
        click.echo(f"{name:<{width}} {r.method:<9} {fmt:<21} {r.backend:<13} {r.description}")


@main.command("validate")
@click.argument("recipe")
@click.option("--model", "-m", default=None, help="also run the pre-flight checks on this model")
@click.option("--no-model", is_flag=True, help="check the recipe file only")
@_tp_option
@_gpu_option
@handle_errors
def validate_cmd(recipe: str, model: str | None, no_model: bool, tp: int,
                 gpu: str | None) -> None:
    """Check RECIPE (a name or YAML path): schema, calibration spec, eval suite, and the
    pre-flight checks against the model (default model unless --no-model)."""
    from quantize.checks import preflight
    from quantize.model.source import check_architecture, resolve_model
    from quantize.recipe.recipe import apply_thresholds, load_recipe, load_suite
    from quantize.stages.calibrate import resolve_spec

    r = load_recipe(recipe)
    spec, _ = resolve_spec(r, None)
    apply_thresholds(load_suite(r.eval.suite), r.eval)
    click.echo(f"{r.name}: recipe ok (calibration {spec.name}, eval suite {r.eval.suite})")
    if no_model:
        return
    ref = resolve_model(model)
    check_architecture(ref.config, trust_remote_code=r.trust_remote_code)
    from quantize import backends
    from quantize.pipeline import target_gpu

    backends.check_model(r, ref.config)
    facts = preflight.check(r, ref.config, tp=tp, gpu=target_gpu(gpu), weights=ref.path)
    click.echo(f"{r.name} on {ref.name}: pre-flight ok ({facts.layers} layers to quantize"
               + (f", group size {facts.group_size}" if facts.group_size else "")
               + (f", tp {tp})" if tp > 1 else ")"))


@main.command("compare")
@click.argument("runs", nargs=-1, type=click.Path(path_type=Path))
@click.option("--out", "-o", type=click.Path(path_type=Path), default=Path("compare"),
              help="folder for compare.md and compare.png")
@click.option("--questions", is_flag=True,
              help="also ask each export (and its 16-bit model) the simple factual questions "
              "of eval/questions/factual.yaml through vLLM, and count the right answers (needs "
              "`make vllm-env`; about a minute per checkpoint on CPU, cached in OUT/answers)")
@handle_errors
def compare_cmd(runs: tuple[Path, ...], out: Path, questions: bool) -> None:
    """One table (compare.md) and one plot (compare.png) across RUNS: size on disk vs
    perplexity and accuracy recovery, with each gate verdict."""
    from quantize.report.compare import compare

    compare(list(runs), out, questions=questions)
    click.echo((out / "compare.md").read_text())
    click.echo(str(out / "compare.png"))
