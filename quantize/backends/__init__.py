"""Engines behind one small protocol. Each engine module is imported only when used, so a
missing optional engine costs nothing until a recipe asks for it."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from quantize.errors import BackendUnavailable, RecipeError
from quantize.model.config import ModelConfig
from quantize.recipe.recipe import Recipe


@dataclass(frozen=True)
class QuantizeJob:
    model_path: Path
    recipe: Recipe
    group_size: int | None  # resolved by preflight (never "auto" here)
    samples: list[list[int]]  # calibration token ids, empty when the recipe needs none
    device: str  # "cpu" or "cuda"
    batch_size: int = 1  # calibration forward batch, resolved by resolve_batch_size
    # on a GPU, where the model lives (quantize.checks.resources.check_memory picks it): resident,
    # onload (host memory, one layer at a time on the GPU), onload+offload (activations too)
    placement: str = "resident"
    # processes calibrating data-parallel under torchrun (quantize.backends.distributed)
    world_size: int = 1
    # where the weights that are not on the GPU live (quantize.checks.placement): ram | disk, with
    # the bytes of weights to keep in RAM and the folder for the rest when on disk
    host_tier: str = "ram"
    cpu_budget: int | None = None
    offload_dir: Path | None = None


# Measured on an H200 (bench/RESULTS.md): batch 8 of equal-length windows cut GPTQ of the 8B
# architecture from 41 to 37 s with GPTQ losses within 0.02%; the CPU keeps batch 1, where
# every measured default-model number was made.
GPU_AUTO_BATCH = 8


def resolve_batch_size(wanted: int | str, device: str, samples: list[list[int]]) -> int:
    """The recipe's batch size; `auto` batches only equal-length samples on a GPU (unequal
    ones would need padding, which changes what the engine sees)."""
    equal = len({len(s) for s in samples}) <= 1
    if isinstance(wanted, int):
        if wanted > 1 and not equal:
            raise RecipeError(
                problem=f"batch_size {wanted} needs equal-length calibration samples",
                hint="turn packing on in the calibration spec or set batch_size: 1")
        return max(1, min(wanted, len(samples) or 1))
    return min(GPU_AUTO_BATCH, len(samples)) if device != "cpu" and samples and equal else 1


class Backend(Protocol):
    name: str

    def quantize(self, job: QuantizeJob, out: Path) -> dict[str, Any]:
        """Quantize and save a loadable checkpoint into `out`; return a summary."""
        ...

    def check_model(self, config: ModelConfig, recipe: Recipe) -> None:
        """Refuse, before any calibration, a model or recipe this engine is known to fail on
        (quantize.errors.PreflightError with the fix)."""
        ...


def get_backend(name: str) -> Backend:
    """The engine's module, imported now (engines are listed in quantize.recipe.engines)."""
    from quantize.recipe.engines import ENGINES

    if name not in ENGINES:
        raise BackendUnavailable(problem=f"unknown backend {name!r}",
                                 hint=f"known: {sorted(ENGINES)}")
    engine = ENGINES[name]
    try:
        module = importlib.import_module(engine.module)
    except ImportError as exc:
        raise BackendUnavailable(
            problem=f"backend {name!r} is not installed ({exc.name})",
            hint=f"install it with `pip install -e .[{engine.extra or name}]`") from None
    backend: Backend = module.BACKEND
    return backend


def check_model(recipe: Recipe, config: ModelConfig) -> None:
    """An optional engine (backend: gptqmodel/autoawq) must be installed and take this model
    before any calibration work; its module is found without importing the engine itself.
    So must a method's own package (AutoRound's `auto-round`, which llm-compressor imports
    only when the method is used)."""
    import importlib.util

    from quantize.recipe.methods import METHODS

    method = METHODS[recipe.method]
    if method.requires and importlib.util.find_spec(method.requires[0]) is None:
        raise BackendUnavailable(
            problem=f"method {recipe.method} needs the package {method.requires[1]!r}, which "
                    "is not installed",
            hint=f"install it with `pip install {method.requires[1]}` (make install does)")
    if recipe.backend == "llmcompressor":
        return
    get_backend(recipe.backend).check_model(config, recipe)  # BackendUnavailable names the extra
