"""Which engine does what: one entry per engine (registered here, imported lazily by
quantize.backends.get_backend), with the methods and schemes it makes that vLLM then loads.

What each engine makes that vLLM then loads, per method. vLLM 0.32 loads native GPTQ only
symmetric, 4 or 8 bits (layers/quantization/auto_gptq.py TYPE_MAP), and native AWQ only
4-bit (auto_awq.py TYPE_MAP), with Marlin on a GPU only when it has zero points
(utils/marlin_utils.py: AWQ-style uint4 needs a runtime zero point): so AWQ is asymmetric.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from quantize.recipe.methods import METHODS
from quantize.recipe.schemes import SCHEMES
from quantize.recipe.yamlio import one_of


def _native_rules(r: Any) -> str | None:
    """What the native-format engines (GPTQModel, AutoAWQ) take of a recipe: their own fixed
    layer selection and algorithm settings; None when the recipe asks for nothing else."""
    for name in ("overrides", "smoothquant", "kv_cache", "observer"):
        if getattr(r, name):
            return f"`{name}` is supported on backend llmcompressor only; remove it"
    if r.targets != ["Linear"] or r.ignore != ["lm_head"]:
        return (f"backend {r.backend} quantizes every Linear of the decoder layers and never "
                "lm_head; use targets: [Linear] and ignore: [lm_head]")
    if r.gptq is not None and r.gptq.block_size != 128:
        return "gptqmodel's GPTQ block size is fixed at 128; remove gptq.block_size"
    if r.awq is not None and r.awq.n_grid != 20:
        return f"{r.backend}'s AWQ scale search uses a fixed grid of 20; remove awq.n_grid"
    if r.awq is not None and r.awq.search_samples is not None:
        return (f"{r.backend}'s AWQ searches on every calibration sample; remove "
                "awq.search_samples")
    if r.awq is not None and r.awq.duo_scaling == "both":
        return f"{r.backend} cannot search both scalings; set awq.duo_scaling to true or false"
    return None


def _gptqmodel_rules(r: Any) -> str | None:
    if (why := _native_rules(r)) is not None:
        return why
    if r.awq is not None and r.awq.duo_scaling is not True:
        return "gptqmodel's AWQ always uses duo scaling; set awq.duo_scaling: true"
    return None


@dataclass(frozen=True)
class Engine:
    name: str
    module: str  # imported only when a recipe uses the engine
    label: str  # how cards and docs name it
    extra: str  # the pip extra that installs it
    # method -> schemes it makes; None: every method and scheme of the tables (read when a
    # recipe is checked, so a new table entry is taken at once)
    methods: dict[str, tuple[str, ...]] | None
    # the engine's own recipe rules beyond its methods and schemes: why not, or None
    rules: Callable[[Any], str | None] | None = None


ENGINES: dict[str, Engine] = {e.name: e for e in (
    Engine("llmcompressor", "quantize.backends.llmcompressor", "llm-compressor", "", None),
    Engine("gptqmodel", "quantize.backends.gptqmodel", "GPTQModel", "gptqmodel",
           {"gptq": ("W4A16", "W8A16"), "awq": ("W4A16_ASYM",)}, _gptqmodel_rules),
    Engine("autoawq", "quantize.backends.autoawq", "AutoAWQ", "autoawq",
           {"awq": ("W4A16_ASYM",)}, _native_rules),
)}
# the names a recipe's `backend:` takes: the table's keys, looked up at validation
BackendName = one_of(ENGINES)
# the engines that write native GPTQ/AWQ checkpoints, by method
ENGINE_SCHEMES: dict[str, dict[str, tuple[str, ...]]] = {
    name: e.methods for name, e in ENGINES.items() if e.methods is not None}

_WHY_SCHEME = {"gptq": "vLLM loads native GPTQ only symmetric with 4 or 8 bits",
               "awq": "vLLM's AWQ Marlin kernel needs 4-bit weights with zero points"}


def check_recipe(r: Any) -> None:
    """The recipe (a quantize.recipe.recipe.Recipe, which calls this from its validator) asks
    only for what the chosen engine does (and vLLM then loads): its methods and schemes,
    then its own rules."""
    engine = ENGINES[r.backend]
    methods = engine.methods if engine.methods is not None else \
        {m: tuple(SCHEMES) for m in METHODS}
    fix = "or set backend: llmcompressor"
    if r.method not in methods:
        raise ValueError(f"backend {r.backend} runs method {'/'.join(methods)} only, not "
                         f"{r.method}; change the method {fix}")
    schemes = methods[r.method]
    if r.scheme not in schemes:
        raise ValueError(f"backend {r.backend}: {_WHY_SCHEME[r.method]}; use scheme "
                         f"{' or '.join(schemes)} for method {r.method} {fix}")
    if engine.rules is not None and (why := engine.rules(r)) is not None:
        raise ValueError(f"{why} {fix}")
