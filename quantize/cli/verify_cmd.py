"""`quantize verify RUN_OR_CHECKPOINT`: load an export in vLLM and compare with transformers."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from quantize.cli.app import handle_errors, main
from quantize.errors import VerifyError

if TYPE_CHECKING:
    from quantize.stages.verify.result import VerifySummary


@main.command("verify")
@click.argument("target", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
              help="tensor-parallel size to load with (needs as many GPUs)")
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8", "bfloat16"]),
              default="auto", show_default=True,
              help="auto: the checkpoint's (fp8 if it has a kv_cache_scheme)")
@click.option("--vllm-python", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="python of an existing vLLM environment (default .venv-vllm/bin/python, "
                   "or $QUANTIZE_VLLM_PYTHON)")
@click.option("--level", type=click.Choice(["auto", "vllm", "decode"]), default="auto",
              show_default=True,
              help="auto: vLLM where this host can run the format, else the decode check; "
                   "vllm: try vLLM even where the capability rules say it cannot")
@click.option("--timeout", "timeout_s", type=click.IntRange(min=10), default=900,
              show_default=True, help="seconds before the vLLM process is killed")
@click.option("--out", "-o", type=click.Path(path_type=Path), default=None,
              help="where verify.json goes (default <run>/verify)")
@click.option("--rerun", is_flag=True, default=False,
              help="verify again even when the run's recorded result is up to date")
@handle_errors
def verify_cmd(target: Path, tp: int, kv_cache_dtype: str, vllm_python: Path | None,
               level: str, timeout_s: int, out: Path | None, rerun: bool) -> None:
    """Load TARGET (a run folder or an export folder) in vLLM in its own environment,
    decode greedily from fixed prompts and compare token choices and log-probabilities with
    transformers. Where this host's vLLM cannot run the format, a decode check runs instead
    and the report says so. On a run folder the result is recorded in its manifest and reused
    while the export and these options are unchanged (--rerun verifies again). Exit status 0
    only on a pass."""
    from quantize.progress import step
    from quantize.stages.verify import verify

    with step(f"verifying {target}"):
        s = verify(target, tp=tp, kv_cache_dtype=kv_cache_dtype, vllm_python=vllm_python,
                   level=level, timeout_s=timeout_s, out=out, rerun=rerun)
    _print(s)
    if s.verdict != "pass":
        raise VerifyError(problem=s.error or "verification failed",
                          hint=f"see the report {s.out}/verify.json")


def _print(s: VerifySummary) -> None:
    from quantize.progress import console
    from quantize.stages.verify import dtype_note

    ok = s.verdict == "pass"
    color = "green" if ok else "red"
    level = {"vllm": "full vLLM check", "decode": "decode check (fallback)"}[s.level]
    console.print(f"[{color}]{s.verdict.upper()}[/{color}] - {level}: {s.format}")
    console.print(f"host: {s.host}")
    if s.why_not_vllm:
        console.print(f"[yellow]{s.why_not_vllm}[/yellow]")
    v = s.vllm
    if v is not None:
        console.print(f"vLLM {v.vllm_version}: quantization method "
                      f"{v.quantization}, dtype {v.dtype}, load {v.load_s}"
                      f" s, generate {v.generate_s} s")
        for kind in ("linear", "attention"):
            kernels = (v.layers or {}).get(kind)
            for key, e in (kernels.items() if isinstance(kernels, dict) else ()):
                console.print(f"  {kind}: {key} × {e.count}")
    if s.metrics is not None:
        m = s.metrics.to_json()
        keys = ("agreement", "mean_abs_dlogprob", "max_abs_dlogprob", "greedy_prefix_match",
                "worst_weight_rel_diff", "source_cosine_min")
        console.print("  " + ", ".join(f"{k} {m[k]}" for k in keys if m.get(k) is not None))
    if note := dtype_note(s):
        console.print(f"[yellow]{note}[/yellow]")
    if s.serve_command:
        console.print(f"reproduce: {s.serve_command}")
    console.print(f"report: {s.out}/verify.json ({s.duration_s} s)")
