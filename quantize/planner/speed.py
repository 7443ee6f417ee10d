"""Measured serving speed: output tokens/s of a format's kernel in vLLM's CUDA build against
bf16 on the same GPU (quantize/data/vllm_speed.yaml, each row measured; bench/vllm_gpu.py).
`quantize plan` prints the measured row for the recommendation and the kernel choice that
serves a request best; formats or GPUs without a row say "not measured"."""

from __future__ import annotations

import functools

from pydantic import BaseModel, ConfigDict

from quantize.spec.paths import DATA_DIR
from quantize.spec.recipe import Recipe
from quantize.spec.schemes import SCHEMES
from quantize.spec.yamlio import parse_model, read_text

DATA = DATA_DIR / "vllm_speed.yaml"


class SpeedRow(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    gpu_cc: int
    family: str
    bits: int
    zero_points: bool
    group: int | None
    linear_backend: str | None
    kernel: str
    one_request: float  # x bf16's output tokens/s
    sixty_four_requests: float


class SpeedTable(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    source: str
    rows: list[SpeedRow]


@functools.lru_cache(maxsize=1)
def table() -> SpeedTable:
    loaded: SpeedTable = parse_model(SpeedTable, read_text(DATA), str(DATA))
    return loaded


def measured(recipe: Recipe | None, cc: int, group: int | None) -> list[SpeedRow]:
    """The rows for this recipe's format on a GPU of capability `cc` (x10): vLLM's own
    kernel choice first; an exact group size before another one of the same format."""
    if recipe is None or recipe.rotation is not None:  # online Hadamard: its cost not measured
        return []
    scheme = SCHEMES[recipe.scheme]
    rows = [r for r in table().rows if r.gpu_cc == cc and r.family == scheme.kernel
            and r.bits == scheme.weight_bits and r.zero_points == (not scheme.symmetric)]
    exact = [r for r in rows if r.group == group] or rows
    return sorted(exact, key=lambda r: r.linear_backend is not None)


def describe(rows: list[SpeedRow]) -> list[str]:
    """One line per measured kernel choice, with the flag that picks it."""
    src = table().source
    out = []
    for r in rows:
        flag = f"with --linear-backend {r.linear_backend}" if r.linear_backend else \
            "vLLM's own choice"
        out.append(f"{r.kernel} ({flag}): {r.one_request:.2f}x bf16 output tokens/s at one "
                   f"request, {r.sixty_four_requests:.2f}x at 64 ({src})")
    return out
