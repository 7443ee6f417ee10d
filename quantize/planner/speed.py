"""Measured serving speed: output tokens/s of a format's kernel in vLLM's CUDA build against
bf16 on the same GPU (quantize/data/vllm_speed.yaml, each row measured; bench/vllm_gpu.py).
`quantize plan` prints the measured row for the recommendation and the kernel choice that
serves a request best, from the planned GPU itself when it has rows, else from another GPU of
the same compute capability (each row names its GPU); formats or GPUs without a row say "not
measured". A rotated recipe (`rotation:`) has its own rows: its online Hadamard costs time."""

from __future__ import annotations

import functools

from pydantic import BaseModel, ConfigDict

from quantize.recipe.paths import DATA_DIR
from quantize.recipe.recipe import Recipe
from quantize.recipe.schemes import SCHEMES
from quantize.recipe.yamlio import parse_model, read_text

DATA = DATA_DIR / "vllm_speed.yaml"


class SpeedRow(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    gpu: str  # the GPU catalog's name (quantize/data/gpus.yaml) of the card it was measured on
    gpu_cc: int
    family: str
    bits: int
    zero_points: bool
    group: int | None
    linear_backend: str | None
    kernel: str
    one_request: float  # x bf16's output tokens/s
    sixty_four_requests: float
    rotation: int | None = None  # the Hadamard block of a rotated export (None: not rotated)


class SpeedTable(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    source: str
    rows: list[SpeedRow]


@functools.lru_cache(maxsize=1)
def table() -> SpeedTable:
    loaded: SpeedTable = parse_model(SpeedTable, read_text(DATA), str(DATA))
    return loaded


def measured(recipe: Recipe | None, cc: int, group: int | None,
             gpu: str | None = None) -> list[SpeedRow]:
    """The rows for this recipe's format (and rotation) on a GPU of capability `cc` (x10),
    from one GPU: `gpu` when it has rows, else the first of that capability in the table;
    vLLM's own kernel choice first; an exact group size before another one of the format."""
    if recipe is None:
        return []
    scheme = SCHEMES[recipe.scheme]
    block = recipe.rotation.block if recipe.rotation is not None else None
    rows = [r for r in table().rows if r.gpu_cc == cc and r.family == scheme.kernel
            and r.bits == scheme.weight_bits and r.zero_points == (not scheme.symmetric)
            and r.rotation == block]
    names = [r.gpu for r in rows]
    if not names:
        return []
    card = gpu if gpu in names else names[0]
    rows = [r for r in rows if r.gpu == card]
    exact = [r for r in rows if r.group == group] or rows
    return sorted(exact, key=lambda r: r.linear_backend is not None)


def describe(rows: list[SpeedRow]) -> list[str]:
    """One line per measured kernel choice, with the flag that picks it."""
    src = table().source
    out = []
    for r in rows:
        flag = f"with --linear-backend {r.linear_backend}" if r.linear_backend else \
            "vLLM's own choice"
        rotated = f", the online Hadamard in blocks of {r.rotation} included" if r.rotation else ""
        out.append(f"{r.kernel} ({flag}{rotated}): {r.one_request:.2f}x bf16 output tokens/s at "
                   f"one request, {r.sixty_four_requests:.2f}x at 64 (one {r.gpu.upper()}, "
                   f"{src})")
    return out
