"""The verify stage: pick the level this host can run, run it, write verify.json/verify.md.

On a run folder, verify is a recorded stage (quantize.run.stage.record_stage): its manifest
entry's inputs name the export it checked (`inputs.export` is the export stage's key, which
publish compares), the level, tensor parallelism, KV-cache dtype, the vLLM version and host
it ran on, and the thresholds; a re-run with the same inputs and intact files reuses the
recorded result. A bare checkpoint folder gets its report written where asked, no manifest.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from quantize.errors import VerifyError
from quantize.run.files import atomic_dir, atomic_write_json, atomic_write_text, sha256_file
from quantize.run.manifest import MANIFEST, RunFolder
from quantize.run.stage import Inputs, record_stage
from quantize.stages.verify.decode_check import DecodeTolerance, verify_decode
from quantize.stages.verify.report import one_line, render
from quantize.stages.verify.result import ServeDtype, VerifySummary
from quantize.stages.verify.scoring import Thresholds
from quantize.stages.verify.target import NAME, checkpoint_config, resolve_target
from quantize.stages.verify.vllm_run import verify_vllm
from quantize.vllm import host as vhost
from quantize.vllm import support
from quantize.vllm.moe_support import moe_problem

LEVELS = ("auto", "vllm", "decode")


@dataclass(frozen=True)
class VerifyOptions:
    """How to verify (the `quantize verify` options)."""

    tp: int = 1
    kv_cache_dtype: str = "auto"
    vllm_python: str | Path | None = None
    level: str = "auto"
    timeout_s: float = 900
    thresholds: Thresholds = field(default_factory=Thresholds)
    tolerance: DecodeTolerance = field(default_factory=DecodeTolerance)

    def check(self) -> None:
        if self.level not in LEVELS:
            raise VerifyError(problem=f"unknown level {self.level!r}",
                              hint="use auto, vllm or decode")
        if self.tp < 1:
            raise VerifyError(problem=f"--tp {self.tp}: tensor parallelism needs a positive "
                                      "integer")

    def host(self) -> vhost.Host:
        """The vLLM environment to verify with (probed unless the decode level was asked)."""
        if self.level == "decode":
            return vhost.Host(None, problem="the decode level was asked for (--level decode)")
        return vhost.detect(self.vllm_python)


def run(checkpoint: Path, out: Path, opts: VerifyOptions, host: vhost.Host | None = None
        ) -> VerifySummary:
    """Verify `checkpoint` (an export folder), writing verify.json/verify.md and logs into
    `out`. Returns the summary; `verdict` is pass or fail, `level` vllm or decode."""
    opts.check()
    t0 = time.perf_counter()
    config = checkpoint_config(checkpoint)
    fmt = support.checkpoint_format(config)
    host = host or opts.host()
    tp, kv = opts.tp, opts.kv_cache_dtype
    ok = support.supported(fmt, host, kv)
    if host.device == "cpu" and tp > 1 and ok.ok:
        ok = support.Support(False, f"not verifiable on this host: --tp {tp} on the CPU "
                             "backend needs a core set per rank; use a GPU host or --level "
                             "vllm to try anyway")
    moe_limit = moe_problem(fmt, config, host) if ok.ok else None
    if moe_limit:  # a limit of this host, not of the checkpoint: the exact decode decides
        ok = support.Support(False, f"not verifiable in vLLM on this host ({moe_limit})")
    if opts.level == "vllm" and (host.vllm_python is None or host.problem):
        raise VerifyError(problem=f"--level vllm: {host.problem}")
    summary = VerifySummary(
        checkpoint=str(checkpoint.resolve()), format=fmt.label,
        host=host.describe(), tp=tp, kv_cache_dtype=kv,
        # which export this is about: its manifest lists the sha256 of every file
        export_manifest_sha256=sha256_file(checkpoint / MANIFEST)
        if (checkpoint / MANIFEST).is_file() else None,
    )
    if ok.ok or opts.level == "vllm":
        summary.level = "vllm"
        if not ok.ok:  # --level vllm: the rules may be stale, the load is the proof
            summary.rules_said = ok.reason
        need = support.serving_dtype(fmt, host.device)
        if need is not None:  # the checkpoint's own dtype would not run here
            summary.serve_dtype = ServeDtype(flag=need.flag, dtype=need.dtype,
                                             declared=fmt.dtype, why=need.reason)
        summary.add(verify_vllm(checkpoint, out, host, tp=tp, kv_cache_dtype=kv,
                                timeout_s=opts.timeout_s, th=opts.thresholds,
                                dtype=need.dtype if need else None))
    else:
        summary.level = "decode"
        summary.why_not_vllm = ok.reason
        if moe_limit:
            summary.host_limit = moe_limit
        summary.add(verify_decode(checkpoint, config, opts.tolerance))
    summary.passed = summary.verdict == "pass"  # what publish and the model card read
    summary.result = one_line(summary)
    summary.duration_s = round(time.perf_counter() - t0, 2)
    atomic_write_json(out / "verify.json", summary.to_json())
    atomic_write_text(out / "verify.md", render(summary))
    return summary


def verify(checkpoint: Path, *, out: Path | None = None, rerun: bool = False,
           **options: Any) -> VerifySummary:
    """Library entry: a run folder gets <run>/verify/ (complete or absent), recorded in its
    manifest; a bare checkpoint gets `out=` or <checkpoint>/../<name>-verify/. `options`:
    the fields of `VerifyOptions`."""
    opts = VerifyOptions(**options)
    opts.check()
    ckpt, run_dir = resolve_target(Path(checkpoint))
    if run_dir is not None and (out is None or Path(out).resolve() == (run_dir / NAME).resolve()):
        export_key = _export_key(run_dir)
        if export_key is not None:
            return _recorded(ckpt, run_dir, export_key, opts, rerun=rerun)
    final = Path(out) if out else (run_dir / NAME if run_dir else
                                   ckpt.parent / f"{ckpt.name}-verify")
    with atomic_dir(final) as tmp:
        summary = run(ckpt, tmp, opts)
    summary.out = str(final)
    return summary


def _export_key(run_dir: Path) -> str | None:
    """The key of the run's finished export stage; None for a folder without one (an export
    copied into a folder of its own: verified as before, with no manifest entry)."""
    folder = RunFolder(run_dir)
    if not folder.is_run():
        return None
    rec = folder.read().stage("export")
    return rec.key if rec is not None else None


def stage_inputs(export_key: str, opts: VerifyOptions, host: vhost.Host) -> Inputs:
    """What changes the verdict: the export, how it is checked, and where."""
    usable = host.vllm_python is not None and not host.problem
    tol = asdict(opts.tolerance)
    tol["cosine_floor"] = [list(pair) for pair in opts.tolerance.cosine_floor]
    return {"export": export_key, "level": opts.level, "tp": opts.tp,
            "kv_cache_dtype": opts.kv_cache_dtype,
            "vllm": host.vllm_version if usable else None, "host": host.describe(),
            "thresholds": {"vllm": asdict(opts.thresholds), "decode": tol}}


def _recorded(ckpt: Path, run_dir: Path, export_key: str, opts: VerifyOptions, *,
              rerun: bool) -> VerifySummary:
    host = opts.host()
    inputs = stage_inputs(export_key, opts, host)
    # the manifest records the brief (verify.json holds the rest); record_stage says whether
    # it runs and why, as every stage does
    record_stage(run_dir, NAME, inputs, lambda tmp: run(ckpt, tmp, opts, host).brief().to_json(),
                 rerun=rerun)
    out = run_dir / NAME
    summary = VerifySummary.model_validate(json.loads((out / "verify.json").read_text()))
    summary.out = str(out)
    return summary
