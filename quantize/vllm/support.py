"""Which quantized formats this host's vLLM can load, and why not when it cannot.

A checkpoint's format comes from its config.json (compressed-tensors `quantization_config`).
The host's abilities come from a probe run inside the vLLM environment (vLLM version, the CPU
ISA torch sees, the custom kernels the build registered, GPU compute capabilities), cached per
vLLM install. The rules below restate vLLM 0.32's own kernel checks; each names its file under
`vllm/model_executor/` so it can be re-checked when vLLM changes:

- Native GPTQ / AWQ checkpoints (backend gptqmodel/autoawq): layers/quantization/
  auto_gptq.py takes symmetric 4/8-bit GPTQ only, auto_awq.py 4-bit AWQ only; both then run
  the same WNA16 kernels as below (CPU: CPUWNA16, checked here on an AVX-512 host).
- INT weight-only (W4A16, AWQ, GPTQ): CPU kernel `CPUWNA16LinearKernel`
  (kernels/linear/mixed_precision/cpu.py) takes 4-bit only, needs the `cpu_gemm_wna16` op
  (absent from the AVX2 build), and in/out sizes per shard divisible by 32. GPU:
  `CompressedTensorsWNA16.get_min_capability` = 75; built-in CUDA kernels (Marlin, Machete,
  Exllama: kernels/linear/mixed_precision/) take 4- and 8-bit only.
- INT8 W8A8: CPU via oneDNN (`onednn_scaled_mm`); GPU capability >= 75
  (layers/quantization/compressed_tensors/schemes/compressed_tensors_w8a8_int8.py).
- FP8 W8A8: CPU per-channel/tensor weights with dynamic activations run on a torch kernel;
  static activation scales need the `static_scaled_fp8_quant` op (absent from the AVX2 build);
  block-scaled FP8 and FP8 weight-only need AMX (kernels/linear/scaled_mm/cpu.py). GPU:
  capability >= 89 natively, >= 80 through Marlin's weight-only fallback
  (compressed_tensors_w8a8_fp8.py).
- FP8 KV cache: CPU needs AVX-512 or AMX and head_size divisible by 32
  (v1/attention/backends/cpu_attn.py `_get_attn_isa`); GPU >= 80.

Whatever these rules say, the load itself is the proof: a format they admit still fails the
verify stage if vLLM refuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from quantize.errors import VerifyError

WORKER = Path(__file__).resolve().parent / "worker.py"
DEFAULT_VLLM_VENV = ".venv-vllm"
PROBE_TIMEOUT_S = 180


# --- the checkpoint's format -----------------------------------------------------------
@dataclass(frozen=True)
class Format:
    """One config group of a compressed-tensors checkpoint, reduced to what kernels care for."""

    kind: str  # dense | int-weight-only | int8-w8a8 | fp8-w8a8 | fp8-weight-only | other
    weight_bits: int | None = None
    strategy: str | None = None  # weight strategy: channel | group | tensor | block
    group_size: int | None = None
    act_dynamic: bool | None = None
    label: str = ""
    native: str | None = None  # "gptq" / "awq" for a native checkpoint (not compressed-tensors)
    symmetric: bool = True


@dataclass(frozen=True)
class CheckpointFormat:
    groups: tuple[Format, ...]
    kv_cache_fp8: bool
    head_dim: int | None

    @property
    def label(self) -> str:
        parts = sorted({g.label for g in self.groups}) or ["dense"]
        return " + ".join(parts) + (" + fp8 KV cache" if self.kv_cache_fp8 else "")


def _group_format(group: dict[str, Any]) -> Format:
    w = group.get("weights") or {}
    a: dict[str, Any] | None = group.get("input_activations") or None
    bits, wtype = w.get("num_bits"), w.get("type", "int")
    strategy, gs = w.get("strategy"), w.get("group_size")
    if wtype == "float" and bits == 8:
        if a is None:
            return Format("fp8-weight-only", 8, strategy, gs, None, f"FP8 {strategy} weight-only")
        dyn = bool(a.get("dynamic"))
        return Format("fp8-w8a8", 8, strategy, gs, dyn,
                      f"FP8 {strategy} weights, {'dynamic' if dyn else 'static'} FP8 activations")
    if a is None:
        if wtype != "int":
            return Format("other", bits, strategy, gs, None, f"{wtype}{bits} weight-only")
        sym = "" if w.get("symmetric", True) else " asymmetric"
        where = f"group {gs}" if strategy == "group" else str(strategy)
        return Format("int-weight-only", bits, strategy, gs, None,
                      f"INT{bits}{sym} weight-only ({where})")
    if wtype == "int" and bits == 8 and a.get("num_bits") == 8 and a.get("type") == "int":
        dyn = bool(a.get("dynamic"))
        return Format("int8-w8a8", 8, strategy, gs, dyn,
                      f"INT8 {strategy} weights, {'dynamic' if dyn else 'static'} INT8 "
                      "activations")
    return Format("other", bits, strategy, gs, None, f"{wtype}{bits} weights + {a} activations")


def _native_format(qc: dict[str, Any]) -> Format:
    """A native GPTQ/AWQ checkpoint (GPTQModel's and AutoAWQ's quantization_config keys)."""
    method = qc["quant_method"]
    bits = int(qc.get("bits") or qc.get("w_bit") or 0)
    gs = int(qc.get("group_size") or qc.get("q_group_size") or -1)
    sym = bool(qc.get("sym", True)) if method == "gptq" else not qc.get("zero_point", True)
    where = f"group {gs}" if gs > 0 else "channel"
    label = f"native {method.upper()} INT{bits}{'' if sym else ' asymmetric'} weight-only " \
        f"({where})"
    return Format("int-weight-only", bits, "group" if gs > 0 else "channel",
                  gs if gs > 0 else None, None, label, native=method, symmetric=sym)


def checkpoint_format(config: dict[str, Any]) -> CheckpointFormat:
    qc = config.get("quantization_config") or {}
    method = qc.get("quant_method")
    if qc and method not in ("compressed-tensors", "gptq", "awq"):
        raise VerifyError(f"quantization_config.quant_method is {method!r}; verify handles "
                          "compressed-tensors and native gptq/awq checkpoints (the export "
                          "formats)")
    if method in ("gptq", "awq"):
        groups: tuple[Format, ...] = (_native_format(qc),)
    else:
        groups = tuple(_group_format(g) for g in (qc.get("config_groups") or {}).values())
    kv = qc.get("kv_cache_scheme") or None
    head_dim = config.get("head_dim") or (
        config["hidden_size"] // config["num_attention_heads"]
        if config.get("hidden_size") and config.get("num_attention_heads") else None)
    return CheckpointFormat(groups, bool(kv and kv.get("type") == "float"), head_dim)


# --- the host ---------------------------------------------------------------------------
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
    from quantize.spec.recipe import PROJECT_ROOT

    given = explicit or os.environ.get("QUANTIZE_VLLM_PYTHON")
    if given:
        p = Path(given).expanduser()
        if not p.is_file():
            raise VerifyError(f"--vllm-python {p} does not exist; give the python of an "
                              "environment with vLLM, or run `make vllm-env`")
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
    key = hashlib.sha256((stamp + "|" + " ".join(cpu_flags())).encode()).hexdigest()[:16]
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
                [g["capability"] for g in res.get("gpus", [])], flags)
    from quantize.run.files import atomic_write_json

    atomic_write_json(cache, host.to_dict())
    return host


# --- the verdict ------------------------------------------------------------------------
@dataclass(frozen=True)
class Support:
    ok: bool
    reason: str  # empty when ok


def _native_rule(fmt: Format) -> str | None:
    """What vLLM 0.32's native loaders refuse on any device: GPTQ other than symmetric 4/8-bit
    (layers/quantization/auto_gptq.py TYPE_MAP), AWQ other than 4-bit (auto_awq.py)."""
    if fmt.native == "gptq" and (fmt.weight_bits not in (4, 8) or not fmt.symmetric):
        return "vLLM loads native GPTQ only symmetric with 4 or 8 bits (auto_gptq.py)"
    if fmt.native == "awq" and fmt.weight_bits != 4:
        return "vLLM loads native AWQ only with 4 bits (auto_awq.py)"
    return None


def _cpu_group(fmt: Format, host: Host) -> str | None:
    """Why vLLM's CPU backend cannot run this group on this host, or None."""
    isa, ops = host.isa, host.ops
    if _native_rule(fmt):
        return _native_rule(fmt)
    need_avx512 = "needs AVX-512 or a GPU"
    if fmt.kind == "dense":
        return None
    if fmt.kind == "int-weight-only":
        if fmt.weight_bits != 4:
            where = "needs a GPU" if fmt.weight_bits == 8 else \
                "vLLM's built-in GPU kernels take only 4 and 8 bits too"
            return (f"vLLM's CPU kernel takes 4-bit integer weights only (this is "
                    f"{fmt.weight_bits}-bit); {where}")
        if not ops.get("cpu_gemm_wna16"):
            return f"{need_avx512} (the CPU build lacks cpu_gemm_wna16)"
        return None
    if fmt.kind == "int8-w8a8":
        return None if ops.get("onednn_scaled_mm") else "the CPU build lacks onednn_scaled_mm"
    if fmt.kind == "fp8-w8a8":
        if fmt.strategy == "block":
            return None if isa.get("amx_tile") else "block FP8 needs AMX or a GPU"
        if not fmt.act_dynamic and not ops.get("static_scaled_fp8_quant"):
            return f"static FP8 activations {need_avx512} (no static_scaled_fp8_quant)"
        return None
    if fmt.kind == "fp8-weight-only":
        return None if isa.get("amx_tile") else "FP8 weight-only needs AMX or a GPU"
    return f"format {fmt.label} has no vLLM CPU kernel"


def _gpu_group(fmt: Format, cap: int) -> str | None:
    sm = f"sm_{cap}"
    if _native_rule(fmt):
        return _native_rule(fmt)
    if fmt.kind == "dense":
        return None
    if fmt.kind == "int-weight-only":
        if fmt.weight_bits not in (4, 8):
            return (f"{fmt.weight_bits}-bit weights have no built-in vLLM CUDA kernel "
                    "(Marlin/Machete/Exllama take 4 and 8 bits)")
        return None if cap >= 75 else f"needs compute capability >= 7.5 (GPU is {sm})"
    if fmt.kind == "int8-w8a8":
        return None if cap >= 75 else f"needs compute capability >= 7.5 (GPU is {sm})"
    if fmt.kind in ("fp8-w8a8", "fp8-weight-only"):
        return None if cap >= 80 else f"FP8 needs compute capability >= 8.0 (GPU is {sm})"
    return f"format {fmt.label} is not known to run in vLLM"


def supported(ckpt: CheckpointFormat, host: Host, kv_cache_dtype: str = "auto") -> Support:
    """Can this host's vLLM load and run the checkpoint with this KV-cache dtype?"""
    if host.vllm_python is None or host.problem:
        return Support(False, f"not verifiable on this host: {host.problem}")
    kv_fp8 = kv_cache_dtype.startswith("fp8") or (kv_cache_dtype == "auto" and ckpt.kv_cache_fp8)
    reasons: list[str] = []
    if host.device == "cuda":
        cap = min(host.gpus)
        reasons += [r for g in ckpt.groups if (r := _gpu_group(g, cap))]
        if kv_fp8 and cap < 80:
            reasons.append(f"FP8 KV cache needs compute capability >= 8.0 (GPU is sm_{cap})")
    else:
        reasons += [r for g in ckpt.groups if (r := _cpu_group(g, host))]
        if kv_fp8:
            if not (host.isa.get("avx512") or host.isa.get("amx_tile")):
                reasons.append("FP8 KV cache needs AVX-512 or AMX or a GPU (load with "
                               "--kv-cache-dtype bfloat16 to verify the weights alone)")
            elif ckpt.head_dim and ckpt.head_dim % 32:
                reasons.append(f"FP8 KV cache on CPU needs head_dim divisible by 32 "
                               f"(model has {ckpt.head_dim})")
    if reasons:
        uniq = list(dict.fromkeys(reasons))
        return Support(False, "not verifiable on this host: " + "; ".join(uniq))
    return Support(True, "")


def host_summary(host: Host) -> str:
    """One line for logs: what the probe saw."""
    return f"{host.describe()}; python {host.vllm_python or '-'}; {sys.platform}"
