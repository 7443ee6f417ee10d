"""Every shipped recipe on every tiny MoE architecture (tests/fixtures/moe.py): export, the
export's weight bytes vs the planner's estimate, then `quantize verify` (vLLM where this host
can run the MoE layers, else the decode fallback), with times. One JSON line per cell into
--out; docs/moe.md holds the table it gave.

    PYTHONPATH=$PWD:$PWD/tests .venv/bin/python bench/moe_matrix.py --work /tmp/moe \
        --out /tmp/moe/matrix.jsonl [--archs qwen3_moe,mixtral] [--recipes gptq-int4] [--no-verify]

Each export and each verify runs in a subprocess of its own (`quantize export`, `quantize
verify`), as a user would run them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

# legacy engine, refused by the recipe validation on transformers 5 (docs/engines.md)
SKIP = {"awq-int4-autoawq": "AutoAWQ is refused on transformers 5 (docs/engines.md)"}
CALIB = "name: moe-small\nbuiltin: wiki\nnum_samples: 8\nseq_len: 128\n"


def planned_bytes(model_dir: Path, recipe_name: str, export: Path) -> int | None:
    """The planner's estimate of the export's weights (quantize plan's number), with the group
    size the export used."""
    from quantize.model.config import model_shape, read_config
    from quantize.planner.weights import estimate_weights, meta, recipe_layers
    from quantize.spec.recipe import load_recipe

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


def cli(args: list[str], log: Path) -> tuple[int, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        rc = subprocess.call([sys.executable, "-m", "quantize.cli", *args], stdout=fh,
                             stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    return rc, round(time.perf_counter() - t0, 1)


def main() -> None:
    from fixtures.moe import ARCHS, build_moe

    from quantize.model.source import default_model_dir
    from quantize.spec.recipe import available

    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--recipes", default=",".join(available("recipes")))
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--no-export", action="store_true", help="verify existing exports only")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    calib = a.work / "moe-small.yaml"
    calib.write_text(CALIB)
    for arch in a.archs.split(","):
        model = a.work / "models" / arch
        if not (model / "config.json").is_file():
            build_moe(arch, model, default_model_dir())
        for recipe in a.recipes.split(","):
            row: dict[str, object] = {"arch": arch, "recipe": recipe}
            if recipe in SKIP:
                row["skipped"] = SKIP[recipe]
            else:
                run = a.work / "runs" / f"{arch}-{recipe}"
                run.mkdir(parents=True, exist_ok=True)
                if not a.no_export:
                    rc, secs = cli(["export", recipe, "--model", str(model), "-d", str(calib),
                                    "-o", str(run), "--device", "cpu"], run / "export.log")
                    row.update({"export_rc": rc, "export_s": secs})
                export = run / "export"
                if (export / "config.json").is_file():
                    size = sum(p.stat().st_size for p in export.glob("*.safetensors"))
                    row["export_bytes"] = size  # files, with their JSON headers
                    row["tensor_bytes"] = tensor_bytes(export)  # what the planner estimates
                    try:
                        row["plan_bytes"] = planned_bytes(model, recipe, export)
                    except Exception as exc:  # the table says why
                        row["plan_error"] = f"{type(exc).__name__}: {exc}"
                    if not a.no_verify:
                        rc, secs = cli(["verify", str(run)], run / "verify.log")
                        row.update({"verify_rc": rc, "verify_s": secs})
                        vj = run / "verify" / "verify.json"
                        if vj.is_file():
                            v = json.loads(vj.read_text())
                            row.update({k: v.get(k) for k in ("level", "verdict",
                                                              "why_not_vllm", "error")})
                else:
                    row["error"] = (run / "export.log").read_text()[-600:] \
                        if (run / "export.log").is_file() else "no export"
            print(json.dumps(row), flush=True)
            with open(a.out, "a") as fh:
                fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
