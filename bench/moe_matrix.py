"""Every shipped recipe on every tiny MoE architecture (tests/fixtures/moe.py): export, the
export's weight bytes vs the planner's estimate, the exported experts' scales (NaN/Inf, all
zero) and routed-token coverage, then `quantize verify` (vLLM where the host can run the MoE
layers, else the exact decode fallback), with times. One JSON line per cell into --out;
docs/moe.md holds the table it gave.

    PYTHONPATH=$PWD:$PWD/tests .venv/bin/python bench/moe_matrix.py --work /tmp/moe \
        --out /tmp/moe/matrix.jsonl [--archs qwen3_moe,mixtral] [--recipes gptq-int4] \
        [--jobs 8 --threads 2] [--tokenizer DIR] [--no-verify]
    .venv/bin/python bench/moe_matrix.py --table ROWS.jsonl [MORE.jsonl]   # the markdown

Each export and each verify runs in a subprocess of its own (`quantize export`, `quantize
verify`), as a user would run them; `--jobs` runs that many cells at once, each subprocess
with `--threads` torch threads (on a many-core machine: the lent GPU machine's 16 cores).
`--tokenizer` names a folder with the default model's tokenizer files (where the default
model itself is not installed); the tiny models borrow it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

# legacy engine, refused by the recipe validation on transformers 5 (docs/engines.md)
SKIP = {"awq-int4-autoawq": "AutoAWQ is refused on transformers 5 (docs/engines.md)"}
CALIB = "name: moe-small\nbuiltin: wiki\nnum_samples: 8\nseq_len: 128\n"
_WRITE = threading.Lock()


def planned_bytes(model_dir: Path, recipe_name: str, export: Path) -> int | None:
    """The planner's estimate of the export's weights (quantize plan's number), with the group
    size the export used."""
    from quantize.model.config import model_shape, read_config
    from quantize.planner.weights import estimate_weights, meta, recipe_layers
    from quantize.recipe.recipe import load_recipe

    config = read_config(model_dir)
    recipe = load_recipe(recipe_name)
    qc = json.loads((export / "config.json").read_text())["quantization_config"]
    group = None
    for g in (qc.get("config_groups") or {}).values():
        group = (g.get("weights") or {}).get("group_size") or group
    group = group or qc.get("group_size")
    model = meta(config)
    est = estimate_weights(model, model_shape(config).dtype_bytes,
                           recipe_layers(model, recipe, group if recipe.group_size else None))
    return est.total


def tensor_bytes(export: Path) -> int:
    """The bytes of every stored tensor (the files less their safetensors headers)."""
    import struct

    total = 0
    for f in export.glob("*.safetensors"):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
        total += f.stat().st_size - 8 - n
    return total


def quantized_experts(export: Path) -> dict[str, int]:
    """Expert projections stored quantized (a packed/quantized weight or qweight) vs left in
    16 bits, and routers stored dense, read from the export's tensor names."""
    import re

    from safetensors import safe_open

    names: set[str] = set()
    for f in export.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            names.update(fh.keys())
    proj = re.compile(r"(.*\.experts\.\d+\.[a-z_]+)\.(weight|weight_packed|qweight)$")
    kinds: dict[str, str] = {}
    for n in names:
        m = proj.match(n)
        if m:
            q = m[2] != "weight" or f"{m[1]}.weight_scale" in names
            kinds[m[1]] = "q" if q or kinds.get(m[1]) == "q" else "dense"
    routers = [n for n in names if re.search(r"\.(gate|router)\.weight$", n)]
    return {"experts_quantized": sum(v == "q" for v in kinds.values()),
            "experts_dense": sum(v == "dense" for v in kinds.values()),
            "routers_dense": len(routers)}


# The two CPU hosts these tables were made for (quantize.vllm.host probes): the CI host of
# 2026-12-04 (AMD EPYC, AVX2 only: vLLM's AVX2 build, no cpu_gemm_wna16) and the AMX host of
# 2026-12-03 (Intel, AVX-512 + AMX, every CPU op).
_ALL_OPS = ("cpu_gemm_wna16", "onednn_scaled_mm", "static_scaled_fp8_quant",
            "dynamic_scaled_fp8_quant", "dynamic_scaled_int8_quant",
            "cpu_attention_with_kv_cache")
HOSTS: dict[str, dict[str, Any]] = {
    "avx2": {"isa": {"avx2": True, "avx512": False, "avx512_bf16": False, "amx_tile": False},
             "ops": {**dict.fromkeys(_ALL_OPS, True), "cpu_gemm_wna16": False}},
    "amx": {"isa": {"avx2": True, "avx512": True, "avx512_bf16": True, "amx_tile": True},
            "ops": dict.fromkeys(_ALL_OPS, True)},
}


def vllm_rules(export: Path) -> dict[str, str | None]:
    """Per host of HOSTS: why its vLLM cannot run the export (dense layers or MoE experts),
    or None: the same rules `quantize verify` applies before it loads anything."""
    from quantize.model.config import read_config
    from quantize.vllm import support
    from quantize.vllm.host import Host
    from quantize.vllm.moe_support import moe_problem

    config = read_config(export)
    fmt = support.checkpoint_format(config)
    out: dict[str, str | None] = {}
    for name, h in HOSTS.items():
        host = Host("python", "0.32.0", "cpu", h["isa"], h["ops"])
        ok = support.supported(fmt, host)
        out[name] = ok.reason if not ok.ok else moe_problem(fmt, config, host)
    return out


def one_line(log: Path) -> str:
    """The error line a user saw (the CLI's `error: ...`), else the log's last line."""
    if not log.is_file():
        return "no log"
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errs = [ln for ln in lines if ln.startswith("error:")]
    return (errs or lines or ["(empty log)"])[-1][:400]


def cli(args: list[str], log: Path, threads: int, timeout: float | None = None
        ) -> tuple[int, float]:
    pp = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": pp}
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        try:
            rc = subprocess.call([sys.executable, "-m", "quantize.cli", *args], stdout=fh,
                                 stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=timeout)
        except subprocess.TimeoutExpired:  # the child was killed; the row says so
            fh.write(f"error: bench timeout: still running after {timeout:.0f} s\n")
            rc = 124
    return rc, round(time.perf_counter() - t0, 1)


def cell(a: argparse.Namespace, arch: str, recipe: str, model: Path, calib: Path
         ) -> dict[str, Any]:
    from quantize.model.moe import check_expert_scales, read_coverage

    row: dict[str, Any] = {"arch": arch, "recipe": recipe}
    if recipe in SKIP:
        row["skipped"] = SKIP[recipe]
        return row
    run = a.work / "runs" / f"{arch}-{recipe}"
    run.mkdir(parents=True, exist_ok=True)
    if not a.no_export:
        rc, secs = cli(["export", recipe, "--model", str(model), "-d", str(calib),
                        "-o", str(run), "--device", "cpu"], run / "export.log", a.threads,
                        a.cell_timeout)
        row.update({"export_rc": rc, "export_s": secs})
    export = run / "export"
    if not (export / "config.json").is_file():
        row["error"] = one_line(run / "export.log")
        return row
    row["export_bytes"] = sum(p.stat().st_size for p in export.glob("*.safetensors"))
    row["tensor_bytes"] = tensor_bytes(export)  # what the planner estimates
    try:
        row["plan_bytes"] = planned_bytes(model, recipe, export)
    except Exception as exc:  # the table says why
        row["plan_error"] = f"{type(exc).__name__}: {exc}"
    row.update(quantized_experts(export))
    scales = check_expert_scales(export)
    row["scales"] = {"experts": scales.experts, "tensors": scales.tensors,
                     "nonfinite": len(scales.nonfinite), "all_zero": len(scales.all_zero)}
    cov = read_coverage(export)
    row["coverage"] = cov.summary() if cov else None
    try:
        row["vllm_rules"] = vllm_rules(export)
    except Exception as exc:  # the table says why
        row["vllm_rules_error"] = f"{type(exc).__name__}: {exc}"
    if not a.no_verify:
        rc, secs = cli(["verify", str(run)], run / "verify.log", a.threads,
                       a.cell_timeout)
        row.update({"verify_rc": rc, "verify_s": secs})
        vj = run / "verify" / "verify.json"
        if vj.is_file():
            v = json.loads(vj.read_text())
            row.update({k: v.get(k) for k in ("level", "verdict", "why_not_vllm", "error")})
            m = v.get("metrics") or {}
            row["verify_metrics"] = {k: m.get(k) for k in (
                "worst_weight_rel_diff", "max_abs_dlogprob", "source_cosine_min",
                "layers_decoded", "agreement", "mean_abs_dlogprob")}
        else:
            row["verify_error"] = one_line(run / "verify.log")
    return row


def _esc(text: str, most: int = 140) -> str:
    """Table-safe, and short: the row keeps the start of a long message (the JSON keeps it
    whole)."""
    text = text.removeprefix("error: ").replace("not verifiable on this host: ", "")
    text = text if len(text) <= most else text[: most - 1].rstrip() + "…"
    return text.replace("|", "\\|")


def _cell_verify(r: dict[str, Any]) -> str:
    if r.get("verdict"):
        m = r.get("verify_metrics") or {}
        how = f"{r['level']} {r['verdict'].upper()} ({r.get('verify_s')} s"
        if r["level"] == "decode":
            how += f", cosine {m.get('source_cosine_min')}"
            if r["verdict"] != "pass":
                how += f"; {r.get('error')}"
        return _esc(how + ")")
    return _esc(r.get("verify_error") or r.get("error") or "")


def _cell_vllm(r: dict[str, Any], host: str) -> str:
    rules = r.get("vllm_rules")
    if rules is None:
        return ""
    why = rules.get(host)
    return "loads (rules)" if why is None else _esc("no: " + why.split(" (vLLM ")[0], 90)


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of docs/moe.md from the matrix's rows."""
    head = ("| architecture | recipe | export s | tensor bytes | planner | diff | experts "
            "quantized / dense, routers dense | scales NaN-Inf / zero | routed per expert "
            "min / median / max (unrouted) | verify | vLLM CPU, AVX2 host | vLLM CPU, AMX host |")
    out = [head, "|" + "---|" * 12]
    for r in sorted(rows, key=lambda r: (r["arch"], r["recipe"])):
        if r.get("skipped") or "tensor_bytes" not in r:
            why = r.get("skipped") or r.get("error") or ""
            what = "skipped" if r.get("skipped") else "refused"
            out.append(f"| {r['arch']} | {r['recipe']} | {r.get('export_s', '')} | "
                       f"{what}: {_esc(why, 200)} |" + " |" * 8)
            continue
        tb, pb = r["tensor_bytes"], r.get("plan_bytes")
        diff = f"{(tb - pb) / pb * 100:+.3f} %" if pb else r.get("plan_error", "")
        sc, cov = r.get("scales") or {}, r.get("coverage")
        routed = "data-free" if cov and not cov["calibrated"] else (
            f"{cov['min']} / {cov['median']:g} / {cov['max']} ({cov['unrouted']})"
            if cov and cov["experts"] else "not counted")
        out.append(
            f"| {r['arch']} | {r['recipe']} | {r.get('export_s')} | {tb:,} | "
            f"{pb:,} | {diff} | {r.get('experts_quantized')} / {r.get('experts_dense')}, "
            f"{r.get('routers_dense')} | {sc.get('nonfinite')} / {sc.get('all_zero')} | "
            f"{routed} | {_cell_verify(r)} | {_cell_vllm(r, 'avx2')} | "
            f"{_cell_vllm(r, 'amx')} |")
    return "\n".join(out)


def main() -> None:
    if sys.argv[1:2] == ["--table"]:  # render: bench/moe_matrix.py --table ROWS.jsonl...
        rows = [json.loads(ln) for f in sys.argv[2:] for ln in Path(f).read_text().splitlines()
                if ln.strip()]
        print(table(rows))
        return

    from fixtures.moe import ARCHS, build_moe

    from quantize.recipe.recipe import available

    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--recipes", default=",".join(available("recipes")))
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per subprocess")
    ap.add_argument("--tokenizer", type=Path, default=None)
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--cell-timeout", type=float, default=None, help="s per subprocess")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="cells not started by then are left out (a row says so)")
    ap.add_argument("--no-export", action="store_true", help="verify existing exports only")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    calib = a.work / "moe-small.yaml"
    calib.write_text(CALIB)
    if a.tokenizer is None:
        from quantize.model.source import default_model_dir
        a.tokenizer = default_model_dir()
    models = {}
    for arch in a.archs.split(","):
        models[arch] = a.work / "models" / arch
        if not (models[arch] / "config.json").is_file():
            build_moe(arch, models[arch], a.tokenizer)

    start = time.perf_counter()

    def one(arch: str, recipe: str) -> None:
        t0 = time.perf_counter()
        try:
            if a.deadline_s is not None and t0 - start > a.deadline_s:
                row = {"arch": arch, "recipe": recipe, "skipped": "not started: deadline"}
            else:
                row = cell(a, arch, recipe, models[arch], calib)
        except Exception as exc:  # one cell's failure is a row, not the end of the table
            row = {"arch": arch, "recipe": recipe, "error": f"{type(exc).__name__}: {exc}"}
        row["cell_s"] = round(time.perf_counter() - t0, 1)
        with _WRITE:
            print(json.dumps(row), flush=True)
            with open(a.out, "a") as fh:
                fh.write(json.dumps(row) + "\n")

    cells = [(arch, r) for arch in models for r in a.recipes.split(",")]
    with ThreadPoolExecutor(max(a.jobs, 1)) as pool:
        list(pool.map(lambda c: one(*c), cells))


if __name__ == "__main__":
    main()
