"""The vLLM environment of this host: where its python is, what a probe run inside it finds
(vLLM version, the CPU ISA torch sees, the custom ops the build registered, GPU compute
capabilities; cached per vLLM install and CPU), and the worker protocol every vLLM run uses
(request and result as JSON files, output to a log, a timeout that kills the process group).

vLLM lives in its own environment (`make vllm-env`): its torch and transformers pins differ
from the main environment's, so it is only ever run as a subprocess (quantize/vllm/worker.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from quantize.errors import VerifyError

WORKER = Path(__file__).resolve().parent / "worker.py"
DEFAULT_VLLM_VENV = ".venv-vllm"
PROBE_TIMEOUT_S = 180
PROBE_VERSION = 2  # 2: the CPU's FP8 GEMM time


@dataclass
class Host:
    """What the probe found. `vllm_python` is None when there is no vLLM environment."""

    vllm_python: str | None
    vllm_version: str | None = None
    device: str = "cpu"
    isa: dict[str, bool] = field(default_factory=dict)
    ops: dict[str, bool] = field(default_factory=dict)
    gpus: list[int] = field(default_factory=list)
    cpu_flags: list[str] = field(default_factory=list)
    problem: str | None = None  # why vLLM cannot be used at all
    # CPU: ms for one 128x512x512 product in FP8 (torch._scaled_mm, vLLM's CPU FP8 W8A8
    # kernel) and in bf16; empty when not measured (GPU, or a torch without FP8)
    fp8_gemm_ms: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        if self.vllm_python is None or self.problem:
            return f"no usable vLLM ({self.problem})"
        if self.device == "cuda":
            caps = ", ".join(f"sm_{c}" for c in self.gpus)
            return f"vLLM {self.vllm_version} on GPU ({caps})"
        return f"vLLM {self.vllm_version} on CPU ({cpu_isa_name(self.isa)})"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cpu_isa_name(isa: dict[str, bool]) -> str:
    if isa.get("amx_tile"):
        return "AMX"
    if isa.get("avx512"):
        return "AVX-512" + (" + BF16" if isa.get("avx512_bf16") else "")
    if isa.get("avx2"):
        return "AVX2, no AVX-512/AMX"
    return "no AVX2"


def cpu_flags() -> list[str]:
    """The kernel's CPU flags (Linux); empty elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(f for f in line.split(":", 1)[1].split()
                              if f.startswith(("avx", "amx", "fma")))
    except OSError:
        pass
    return []


def find_vllm_python(explicit: str | Path | None = None) -> Path | None:
    """--vllm-python, else $QUANTIZE_VLLM_PYTHON, else .venv-vllm/ in the project checkout or
    the current folder."""
    from quantize.recipe.recipe import PROJECT_ROOT

    given = explicit or os.environ.get("QUANTIZE_VLLM_PYTHON")
    if given:
        p = Path(given).expanduser()
        if not p.is_file():
            raise VerifyError(problem=f"--vllm-python {p} does not exist",
                              hint="give the python of an environment with vLLM, or run "
                                   "`make vllm-env`")
        return p
    for root in (PROJECT_ROOT, Path.cwd()):
        p = root / DEFAULT_VLLM_VENV / "bin" / "python"
        if p.is_file():
            return p
    return None


def run_worker(python: Path, request: dict[str, Any], workdir: Path, name: str,
               timeout_s: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one worker process: request and result as JSON files, its output to a log file.

    A timeout kills the whole process group. When the worker died without writing a result,
    the last error-looking line of its log is quoted.
    """
    workdir = workdir.resolve()  # the worker runs in workdir: a relative path would double
    workdir.mkdir(parents=True, exist_ok=True)
    req_path, res_path = workdir / f"{name}.request.json", workdir / f"{name}.result.json"
    log_path = workdir / f"{name}.log"
    req_path.write_text(json.dumps(request, indent=1))
    res_path.unlink(missing_ok=True)
    full_env = {**os.environ, **(env or {})}
    full_env.pop("PYTHONPATH", None)  # keep the main environment's packages out
    cmd = [str(python), str(WORKER), "--request", str(req_path), "--result", str(res_path)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=full_env, cwd=workdir,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return {"ok": False, "error": f"timed out after {timeout_s:.0f}s (log: {log_path})",
                    "error_type": "Timeout", "log": str(log_path)}
    if res_path.is_file():
        try:
            result: dict[str, Any] = json.loads(res_path.read_text())
            result["log"] = str(log_path)
            return result
        except json.JSONDecodeError:
            pass
    return {"ok": False, "error_type": "Crash", "log": str(log_path),
            "error": f"the vLLM process exited with status {proc.returncode} without a "
                     f"result: {last_error_line(log_path)}"}


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    import contextlib
    import signal

    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def last_error_line(log_path: Path) -> str:
    """The last line of a log that looks like an error (vLLM's own words), else the last."""
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines()
                 if ln.strip()]
    except OSError:
        return "no log"
    for ln in reversed(lines):
        if any(k in ln for k in ("Error", "error:", "Exception", "Killed", "Segmentation")):
            return ln[-400:]
    return lines[-1][-400:] if lines else "no output"


def _probe_cache_path(python: Path) -> Path:
    from quantize.model.source import cache_root

    st = python.resolve().stat()
    site = sorted(python.resolve().parent.parent.glob("lib/python*/site-packages/vllm*"))
    stamp = "|".join([str(python.resolve()), str(st.st_mtime_ns)]
                     + [f"{p.name}:{p.stat().st_mtime_ns}" for p in site])
    # PROBE_VERSION: a probe that learnt something new is not answered from an older cache
    key = hashlib.sha256((f"{PROBE_VERSION}|{stamp}|" + " ".join(cpu_flags())).encode()
                         ).hexdigest()[:16]
    return cache_root() / "vllm-probe" / f"{key}.json"


def detect(vllm_python: str | Path | None = None, *, workdir: Path | None = None,
           use_cache: bool = True) -> Host:
    """Probe the vLLM environment (cached per vLLM install and CPU)."""
    python = find_vllm_python(vllm_python)
    flags = cpu_flags()
    if python is None:
        return Host(None, cpu_flags=flags,
                    problem="no vLLM environment: run `make vllm-env`, or pass --vllm-python")
    cache = _probe_cache_path(python)
    if use_cache and cache.is_file():
        try:
            return Host(**json.loads(cache.read_text()))
        except (json.JSONDecodeError, TypeError):
            pass
    import tempfile

    with tempfile.TemporaryDirectory(prefix="quantize-probe-") as tmp:
        res = run_worker(python, {"op": "probe"}, workdir or Path(tmp), "probe", PROBE_TIMEOUT_S)
    if not res.get("ok"):
        return Host(str(python), cpu_flags=flags,
                    problem=f"vLLM does not import in {python}: {res.get('error')}")
    host = Host(str(python), res.get("vllm_version"),
                "cuda" if res.get("gpus") else "cpu", res.get("isa", {}), res.get("ops", {}),
                [g["capability"] for g in res.get("gpus", [])], flags,
                fp8_gemm_ms=res.get("fp8_gemm_ms") or {})
    from quantize.run.files import atomic_write_json

    atomic_write_json(cache, host.to_dict())
    return host

