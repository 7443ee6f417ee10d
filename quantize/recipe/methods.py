"""The method table: every quantization algorithm a recipe's `method:` names, described once.

Recipe validation, the resource check (what calibration holds in memory), the planner's prior
recovery and the model card read it; adding a method is one `Method` entry, its modifier list
in quantize/backends/llmcompressor.py `MODIFIERS`, and its tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from quantize.recipe.yamlio import one_of

# weight observers a recipe may pick (llm-compressor 0.14's registry, llmcompressor/observers):
# minmax is the library default; mse searches a shrunk range that minimises the weight's
# squared error; imatrix_mse weights that error by each input channel's E[x^2] on the
# calibration data (llama.cpp's importance matrix)
ObserverName = Literal["minmax", "mse", "imatrix_mse"]


@dataclass(frozen=True)
class Method:
    name: str
    label: str  # how cards and messages name it
    calibrated: bool  # uses the calibration data to choose the weights (not just ranges)
    hessian: bool  # accumulates a Hessian per Linear (GPTQ): in_features^2 fp32 each
    caches_inputs: bool  # keeps each smoothed layer's inputs for a search (AWQ, AutoRound)
    weight_only: bool  # cannot quantize activations
    options: tuple[str, ...]  # the recipe option blocks it takes
    source: str  # where the algorithm comes from
    # (module, pip requirement) of a package the method needs beyond the engine's own
    requires: tuple[str, str] | None = None
    # why the method cannot take an asymmetric grid through its engine (None: it can)
    symmetric_only: str | None = None
    # also solves NVFP4's FP4 grid (groups of 16 under a global scale: llm-compressor's
    # tensor-group strategy); every other float scheme is round-to-nearest only
    nvfp4: bool = False


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("gptq", "GPTQ", True, True, False, False, ("gptq",),
           "Frantar et al., arXiv:2210.17323; llm-compressor GPTQModifier", nvfp4=True),
    Method("awq", "AWQ", True, False, True, True, ("awq",),
           "Lin et al., arXiv:2306.00978; llm-compressor AWQModifier"),
    Method("rtn", "RTN", False, False, False, False, (),
           "round to nearest; llm-compressor QuantizationModifier"),
    Method("autoround", "AutoRound", True, False, True, True, ("autoround",),
           "Cheng et al., arXiv:2309.05516; llm-compressor AutoRoundModifier (auto-round)",
           requires=("auto_round", "auto-round==0.15.1"),
           symmetric_only="llm-compressor 0.14's AutoRoundModifier writes back AutoRound's "
           "scales but not its zero points (modifiers/autoround/base.py _postprocess_qparams), "
           "so an asymmetric export keeps untuned zero points (41.6% perplexity recovery "
           "measured on the default model)"),
    Method("awq+gptq", "AWQ+GPTQ", True, True, True, True, ("awq", "gptq"),
           "AWQ smoothing, then GPTQ on the smoothed weights (llm-compressor composes them)"),
)}
OPTION_BLOCKS = ("gptq", "awq", "autoround")
# the names a recipe's `method:` takes: the table's keys, looked up at validation
MethodName = one_of(METHODS)
