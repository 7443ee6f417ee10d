"""`quantize plan`: weights, KV cache and vLLM's budget for every recipe on a GPU."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import click

from quantize.cli.app import handle_errors, main

# The ranges of the numeric options (plan's and fit's): a value outside is click's usage
# error (exit 2) naming the option and the range, before anything is read. The bounds are far
# above any real setup (the planner's minimum-TP search stops at 8 GPUs; the longest context
# a model takes is 10M tokens, Llama 4 Scout's; vLLM's largest default is 1,024 sequences).
MAX_GPUS = 512
MAX_TOKENS = 1 << 24  # --max-model-len, --max-num-batched-tokens
MAX_SEQS = 65_536  # --concurrency, --max-num-seqs
MAX_OFFLOAD_GIB = 65_536.0


class Finite(click.FloatRange):
    """click's FloatRange, NaN refused too (it compares false with every bound and so passed
    FloatRange; inf passes a range without an upper bound: give one)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None
                ) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value} is not in the range {self._describe_range()}.", param, ctx)
        return number


GPUS = click.IntRange(1, MAX_GPUS)
TOKENS = click.IntRange(1, MAX_TOKENS)
SEQS = click.IntRange(1, MAX_SEQS)

_STATUS = {"fits": "yes", "partial": "fewer users", "no-kv": "no (KV)", "no-fit": "no",
           "unsupported": "unsupported", "n/a": "n/a"}


@main.command("plan")
@click.argument("model", default="default")
@click.option("--gpu", "gpu_name", required=True, help="GPU name from the catalog, e.g. rtx5090, "
              "h100, a100-80gb (see quantize/data/gpus.yaml)")
@click.option("--gpus", default=1, show_default=True, type=GPUS,
              help="GPUs per server: the tensor-parallel size planned")
@click.option("--max-model-len", "context", default=32768, show_default=True, type=TOKENS,
              help="context length every sequence may reach")
@click.option("--concurrency", default=16, show_default=True, type=SEQS,
              help="sequences that must fit at once at --max-model-len (vLLM --max-num-seqs)")
@click.option("--recipes", default="all", show_default=True,
              help="comma-separated recipe names or YAML paths, or `all`")
@click.option("--gpu-memory-utilization", "util", default=0.9, show_default=True,
              type=Finite(0.05, 1.0), help="the share of each GPU's memory vLLM may use")
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8"]), default="auto",
              show_default=True, help="auto: model dtype, fp8 for recipes with kv_cache: fp8")
@click.option("--max-num-batched-tokens", type=TOKENS, default=None,
              help="vLLM's profile-run size (default: vLLM's default for the GPU)")
@click.option("--runs", "runs_dir", type=click.Path(path_type=Path), default=Path("runs"),
              show_default=True, help="where to look for run folders with measured recoveries")
@click.option("--gpu-file", type=click.Path(path_type=Path), default=None,
              help="extra GPU catalog YAML (same format as quantize/data/gpus.yaml)")
@click.option("--max-num-seqs", type=SEQS, default=None,
              help="vLLM's sequence limit (default: --concurrency); sizes the sampler's peak")
@click.option("--cpu-offload-gb", "cpu_offload_gb", type=Finite(0.0, MAX_OFFLOAD_GIB),
              default=0.0, show_default=True,
              help="GiB of weights vLLM keeps in host memory (vllm serve --cpu-offload-gb)")
@click.option("--enforce-eager", is_flag=True,
              help="plan for vllm serve --enforce-eager (no CUDA graphs)")
@click.option("--vllm-profile", type=click.Choice(["0.26", "0.19", "0.11"]), default="0.26",
              show_default=True, help="vLLM release whose profile-run constants to use "
              "(0.26: measured on an H200, docs/plan.md)")
@click.option("--json", "as_json", is_flag=True, help="print the plan as JSON")
@handle_errors
def plan_cmd(model: str, gpu_name: str, gpus: int, context: int, concurrency: int, recipes: str,
             util: float, kv_cache_dtype: str, max_num_batched_tokens: int | None,
             max_num_seqs: int | None, cpu_offload_gb: float, enforce_eager: bool,
             runs_dir: Path, gpu_file: Path | None, vllm_profile: str, as_json: bool) -> None:
    """Which recipe lets MODEL serve --max-model-len tokens to --concurrency users on --gpus
    x --gpu, and the `vllm serve` command for it. MODEL: a built-in model (e.g.
    meta-llama/Llama-3.1-70B-Instruct), a Hub id, a local folder or a run folder; only
    config.json is read."""
    from quantize.planner.gpus import find
    from quantize.planner.plan import PlanRequest, make_plan

    req = PlanRequest(model=model, gpu=find(gpu_name, gpu_file), gpus=gpus, context=context,
                      concurrency=concurrency, recipes=[recipes], util=util,
                      kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=max_num_batched_tokens,
                      runs_dir=runs_dir, profile=vllm_profile, max_num_seqs=max_num_seqs,
                      cpu_offload_gib=cpu_offload_gb, enforce_eager=enforce_eager)
    plan = make_plan(req)
    if as_json:
        click.echo(json.dumps(plan.to_dict(), indent=2, default=str))
        return
    for line in render(plan):
        click.echo(line)


def _accuracy(value: float, source: str) -> str:
    tag = "measured" if source.startswith("measured") else source
    return f"{value:.1%} ({tag})"


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f}"


def render(plan: object) -> list[str]:
    """The plan as plain text (copy-pasteable; no terminal-width wrapping)."""
    from quantize.planner.levers import boundary, margin
    from quantize.planner.memory import GIB, PROFILES
    from quantize.planner.plan import Plan
    from quantize.planner.rows import TP_CANDIDATES
    from quantize.planner.speed import describe

    assert isinstance(plan, Plan)
    req, gpu = plan.request, plan.request.gpu
    out = [f"{plan.source.name} ({plan.source.origin}) on {req.gpus} x {gpu.label} "
           f"({gpu.memory_gib} GiB each), {req.context:,}-token context, {req.concurrency} "
           f"sequences, gpu_memory_utilization {req.util}",
           f"KV model: {plan.kv_model}",
           f"vLLM profile run: max_num_batched_tokens {plan.batched}, max_num_seqs "
           f"{req.seqs}; constants of vLLM {req.profile} ({PROFILES[req.profile].source})"
           + (f"; --cpu-offload-gb {req.cpu_offload_gib:g}" if req.cpu_offload_gib else "")
           + ("; --enforce-eager" if req.enforce_eager else ""), ""]
    head = ("recipe", "format", "weights/GPU", "KV B/tok", "KV tokens", "max seqs", "fits",
            "margin", "min TP", "accuracy", f"on {gpu.name}")
    rows = [head]
    for r in plan.rows:
        m = r.memory
        weights = (m.weights if m else r.weights_total) or 0
        mark = " (export)" if r.weights_source.startswith("exported") else ""
        rows.append((r.recipe, r.scheme, f"{_gib(weights)} GiB{mark}" if weights else "-",
                     f"{m.kv_bytes_per_token:,}" if m else "-",
                     f"{m.kv_tokens:,}" if m else "-",
                     f"{m.max_sequences}" if m else "-",
                     _STATUS.get(r.status, r.status), margin(m, req.concurrency),
                     str(r.min_tp) if r.min_tp else "-" if r.status in ("n/a", "unsupported")
                     else f">{TP_CANDIDATES[-1]}",
                     _accuracy(r.accuracy, r.accuracy_source), r.support))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    for row in rows:
        out.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    out.append("")
    for r in plan.rows:
        for text in dict.fromkeys((r.reason, r.gpu_note)):
            if text:
                out.append(f"  {r.recipe}: {text}")
    rec = plan.recommendation
    out.append("")
    if rec is None or rec.memory is None:
        out.append(f"Recommendation: nothing starts on {req.gpus} x {gpu.name} with "
                   f"--max-model-len {req.context:,}.")
    else:
        m = rec.memory
        verdict = ("serves all" if plan.recommendation_kind == "fits"
                   else f"serves only {m.max_sequences} of")
        out.append(f"Recommendation: {rec.recipe} ({rec.scheme}) with TP={req.gpus} {verdict} "
                   f"{req.concurrency} sequences of {req.context:,} tokens: {m.max_sequences} "
                   f"fit ({m.max_concurrency:.2f}x, {m.kv_tokens:,} KV tokens).")
        off = f" ({_gib(m.offloaded)} more in host memory)" if m.offloaded else ""
        out.append(f"  per GPU: {_gib(m.total)} GiB x {req.util} = {_gib(m.requested)} GiB; "
                   f"weights {_gib(m.weights)}{off}, activation peak {_gib(m.activation)} "
                   f"(forward {_gib(m.activation_forward)}, sampler {_gib(m.activation_sampler)}), "
                   f"non-torch {_gib(m.nontorch)} -> KV {_gib(m.available)} GiB")
        out.append(f"  boundary: {boundary(m, req.concurrency)}")
        out.append(f"  KV grows linearly: {m.kv_bytes_per_token:,} B/token x {req.context:,} "
                   f"tokens = {m.request_bytes / GIB:.2f} GiB per sequence per GPU, x "
                   f"{req.concurrency} sequences = {req.concurrency * m.request_bytes / GIB:.1f} "
                   "GiB")
        for line in describe(plan.speed):
            out.append(f"  measured: {line}")
        out.append("")
        out.append(rec.serve or "")
    for hint in plan.hints:
        out.append(f"hint: {hint}")
    if plan.levers and plan.lever_row is not None:
        out.append("")
        out.append(f"Levers for {plan.lever_row.recipe} (each alone, re-planned):")
        for lv in plan.levers:
            seqs = f" -> {lv.sequences} sequences" if lv.sequences is not None else ""
            out.append(f"  {lv.flag}: {lv.effect}{seqs}")
    if plan.notes:
        out.append("")
        out.extend(f"note: {n}" for n in plan.notes)
    return out
