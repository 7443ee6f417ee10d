"""Engines behind one small protocol. Each engine module is imported only when used, so a
missing optional engine costs nothing until a recipe asks for it."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from quantize.errors import BackendUnavailable
from quantize.recipe import Recipe


@dataclass(frozen=True)
class QuantizeJob:
    model_path: Path
    recipe: Recipe
    group_size: int | None  # resolved by preflight (never "auto" here)
    samples: list[list[int]]  # calibration token ids, empty when the recipe needs none
    device: str  # "cpu" or "cuda"


class Backend(Protocol):
    name: str

    def quantize(self, job: QuantizeJob, out: Path) -> dict[str, Any]:
        """Quantize and save a loadable checkpoint into `out`; return a summary."""
        ...


_MODULES = {"llmcompressor": "quantize.backends.llmcompressor"}


def get_backend(name: str) -> Backend:
    if name not in _MODULES:
        raise BackendUnavailable(f"unknown backend {name!r}; known: {sorted(_MODULES)}")
    try:
        module = importlib.import_module(_MODULES[name])
    except ImportError as exc:
        raise BackendUnavailable(f"backend {name!r} is not installed ({exc.name}); install "
                                 f"it with `pip install -e .[{name}]`") from None
    backend: Backend = module.BACKEND
    return backend
