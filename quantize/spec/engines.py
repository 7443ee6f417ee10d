"""Which engine does what: one entry per engine (registered here, imported lazily by
quantize.backends.get_backend), with the methods and schemes it makes that vLLM then loads.

What each engine makes that vLLM then loads, per method. vLLM 0.32 loads native GPTQ only
symmetric, 4 or 8 bits (layers/quantization/auto_gptq.py TYPE_MAP), and native AWQ only
4-bit (auto_awq.py TYPE_MAP), with Marlin on a GPU only when it has zero points
(utils/marlin_utils.py: AWQ-style uint4 needs a runtime zero point): so AWQ is asymmetric.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quantize.spec.methods import METHODS
from quantize.spec.schemes import SCHEMES


@dataclass(frozen=True)
class Engine:
    name: str
    module: str  # imported only when a recipe uses the engine
    label: str  # how cards and docs name it
    extra: str  # the pip extra that installs it
    methods: dict[str, tuple[str, ...]]  # method -> schemes it makes


ENGINES: dict[str, Engine] = {e.name: e for e in (
    Engine("llmcompressor", "quantize.backends.llmcompressor", "llm-compressor", "",
           {m: tuple(SCHEMES) for m in METHODS}),
    Engine("gptqmodel", "quantize.backends.gptqmodel", "GPTQModel", "gptqmodel",
           {"gptq": ("W4A16", "W8A16"), "awq": ("W4A16_ASYM",)}),
    Engine("autoawq", "quantize.backends.autoawq", "AutoAWQ", "autoawq",
           {"awq": ("W4A16_ASYM",)}),
)}
# the engines that write native GPTQ/AWQ checkpoints, by method
ENGINE_SCHEMES: dict[str, dict[str, tuple[str, ...]]] = {
    name: e.methods for name, e in ENGINES.items() if name != "llmcompressor"}

_WHY_SCHEME = {"gptq": "vLLM loads native GPTQ only symmetric with 4 or 8 bits",
               "awq": "vLLM's AWQ Marlin kernel needs 4-bit weights with zero points"}


def check_recipe(r: Any) -> None:
    """The recipe (a quantize.spec.recipe.Recipe, which calls this from its validator) asks
    only for what the chosen engine does (and vLLM then loads)."""
    methods = ENGINES[r.backend].methods
    fix = "or set backend: llmcompressor"
    if r.method not in methods:
        raise ValueError(f"backend {r.backend} runs method {'/'.join(methods)} only, not "
                         f"{r.method}; change the method {fix}")
    schemes = methods[r.method]
    if r.scheme not in schemes:
        raise ValueError(f"backend {r.backend}: {_WHY_SCHEME[r.method]}; use scheme "
                         f"{' or '.join(schemes)} for method {r.method} {fix}")
    for name in ("overrides", "smoothquant", "kv_cache", "observer"):
        if getattr(r, name):
            raise ValueError(f"`{name}` is supported on backend llmcompressor only; remove "
                             f"it {fix}")
    if r.targets != ["Linear"] or r.ignore != ["lm_head"]:
        raise ValueError(f"backend {r.backend} quantizes every Linear of the decoder layers "
                         f"and never lm_head; use targets: [Linear] and ignore: [lm_head] {fix}")
    if r.gptq is not None and r.gptq.block_size != 128:
        raise ValueError("gptqmodel's GPTQ block size is fixed at 128; remove gptq.block_size "
                         f"{fix}")
    if r.awq is not None and r.awq.n_grid != 20:
        raise ValueError(f"{r.backend}'s AWQ scale search uses a fixed grid of 20; remove "
                         f"awq.n_grid {fix}")
    if r.awq is not None and r.awq.search_samples is not None:
        raise ValueError(f"{r.backend}'s AWQ searches on every calibration sample; remove "
                         f"awq.search_samples {fix}")
    if r.awq is not None and r.awq.duo_scaling is not True and r.backend == "gptqmodel":
        raise ValueError(f"gptqmodel's AWQ always uses duo scaling; set awq.duo_scaling: true "
                         f"{fix}")
    if r.awq is not None and r.awq.duo_scaling == "both":
        raise ValueError(f"{r.backend} cannot search both scalings; set awq.duo_scaling to true "
                         f"or false {fix}")


