"""Where do the 8-bit recipes lose perplexity on the default model? (eval/README.md)

The default suite's perplexity (16,384 tokens, 1024-token windows, fp32 on CPU) of the
baseline with the 8-bit formats simulated one part at a time: weights only, activations
only, both; FP8 (E4M3) and INT8; activations of one projection type at a time. The
simulation rounds as compressed-tensors does (symmetric, per output channel for weights,
per token for dynamic activations; scale = absmax / 448 for E4M3, absmax / 127.5 for INT8),
and the "both" row is checked against the real fp8-dynamic export when its run folder is
given, so the parts are measured with the arithmetic the recipe really uses.

    python -m bench.ablate_8bit [--export runs/<model>-fp8-dynamic/export] [--out FILE]

Writes a JSON list of {config, ppl, recovery} and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from quantize.metrics import perplexity
from quantize.model.source import resolve_model
from quantize.recipe.recipe import load_suite

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp8(x: torch.Tensor, dim: int) -> torch.Tensor:
    scale = x.abs().amax(dim=dim, keepdim=True).clamp_min(1e-12) / 448.0
    q = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype)
    return q * scale


def int8(x: torch.Tensor, dim: int) -> torch.Tensor:
    scale = x.abs().amax(dim=dim, keepdim=True).clamp_min(1e-12) / 127.5
    return (x / scale).round().clamp(-128, 127) * scale


ROUND: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {"fp8": fp8, "int8": int8}


def linears(model: Any, only: tuple[str, ...]) -> Iterator[tuple[str, torch.nn.Linear]]:
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head" and name.endswith(only):
            yield name, mod


@contextmanager
def simulated(model: Any, fmt: str | None, weights: bool, acts: bool,
              only: tuple[str, ...] = PROJ) -> Iterator[None]:
    """Weights rounded in place (restored after); activations rounded per token by a hook."""
    saved: dict[str, torch.Tensor] = {}
    hooks = []
    if fmt is not None:
        rnd = ROUND[fmt]
        for name, mod in linears(model, only):
            if weights:
                saved[name] = mod.weight.data.clone()
                mod.weight.data = rnd(mod.weight.data, 1)
            if acts:
                hooks.append(mod.register_forward_pre_hook(
                    lambda _m, args: (rnd(args[0], -1), *args[1:])))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        for name, mod in linears(model, only):
            if name in saved:
                mod.weight.data = saved[name]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--export", type=Path, help="a fp8-dynamic export to check the simulation")
    ap.add_argument("--out", type=Path, default=Path("bench/ablate_8bit.json"))
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    ref = resolve_model("default")
    tok = AutoTokenizer.from_pretrained(ref.path)
    model = AutoModelForCausalLM.from_pretrained(ref.path, dtype=torch.float32).eval()
    spec = next(m for m in load_suite("default").metrics if m.kind == "perplexity")

    configs: list[tuple[str, str | None, bool, bool, tuple[str, ...]]] = [
        ("baseline (fp32)", None, False, False, PROJ)]
    for fmt in ("fp8", "int8"):
        configs += [(f"{fmt} weights only", fmt, True, False, PROJ),
                    (f"{fmt} activations only", fmt, False, True, PROJ),
                    (f"{fmt} weights + activations", fmt, True, True, PROJ)]
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        configs.append((f"fp8 activations of {proj} only", "fp8", False, True, (proj,)))

    rows: list[dict[str, Any]] = []
    base = None
    for label, fmt, w, a, only in configs:
        t0 = time.perf_counter()
        with simulated(model, fmt, w, a, only):
            ppl = perplexity(model, tok, spec, batch_size=8)["value"]
        base = base or ppl
        rows.append({"config": label, "ppl": round(ppl, 4), "recovery": round(base / ppl, 4),
                     "seconds": round(time.perf_counter() - t0, 1)})
        print(f"{label:38s} ppl {ppl:8.4f}  recovery {base / ppl:7.2%}", flush=True)
    if args.export is not None:
        real = AutoModelForCausalLM.from_pretrained(args.export, dtype=torch.float32).eval()
        ppl = perplexity(real, AutoTokenizer.from_pretrained(args.export), spec, 8)["value"]
        rows.append({"config": f"real export {args.export}", "ppl": round(ppl, 4),
                     "recovery": round(base / ppl, 4)})
        print(f"{'real fp8-dynamic export':38s} ppl {ppl:8.4f}  recovery {base / ppl:7.2%}")
    args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
