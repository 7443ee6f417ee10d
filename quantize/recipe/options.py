"""The option blocks a recipe may carry: each method's own (gptq, awq, autoround), SmoothQuant,
Hadamard rotations, and mixed precision by measured sensitivity."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from quantize.recipe.strict import Strict


class GPTQOptions(Strict):
    block_size: int = Field(default=128, ge=1)
    dampening_frac: float = Field(default=0.01, gt=0.0, lt=1.0)
    actorder: Literal["static", "group", "weight"] | None = "static"


class AWQOptions(Strict):
    n_grid: int = Field(default=20, ge=2, le=100, description="scale candidates per mapping")
    duo_scaling: bool | Literal["both"] = True
    search_samples: int | None = Field(
        default=None, ge=1, le=100_000, description="calibration samples the scale search "
        "runs its forwards on (spread evenly); None: all (docs/awq-cpu.md)")

    @model_validator(mode="after")
    def _grid(self) -> AWQOptions:
        least = {True: 3, False: 2, "both": 4}[self.duo_scaling]  # llm-compressor divides
        if self.n_grid < least:  # by n_grid - 2 (duo) or n_grid / 2 - 1 (both)
            raise ValueError(f"n_grid {self.n_grid} is too small for duo_scaling "
                             f"{str(self.duo_scaling).lower()}; use n_grid >= {least}")
        return self


class AutoRoundOptions(Strict):
    """AutoRound's sign-gradient tuning of rounding and ranges, block by block."""

    iters: int = Field(default=200, ge=0, le=10_000,
                       description="tuning steps per decoder layer (0: RTN with its own "
                       "optimised ranges)")
    lr: float | None = Field(default=None, gt=0.0, le=1.0,
                             description="learning rate; None: 1/iters (the library's)")
    batch_size: int = Field(default=8, ge=1, le=512)
    compile: bool = Field(default=False, description="torch.compile the block (GPU)")


class SmoothQuantOptions(Strict):
    strength: float = Field(default=0.8, gt=0.0, lt=1.0)


class Rotation(Strict):
    """Hadamard rotations of each Linear layer's input before the method runs (llm-compressor's
    QuIPModifier, input side only): the weight is stored rotated and vLLM rotates the layer's
    input back online (its Hadacore kernel on CUDA). Blocks of `block` input channels, each
    rotated on its own; a block equal to the group size mixes only the weights one scale
    covers (eval/README.md, "Hadamard rotations before GPTQ")."""

    block: int = Field(default=64, ge=2, le=65536,
                       description="input channels per Hadamard block: a power of two that "
                       "divides every rotated layer's input size (Sylvester Hadamard, which "
                       "vLLM's Hadacore kernel computes)")

    @model_validator(mode="after")
    def _power_of_two(self) -> Rotation:
        if self.block & (self.block - 1):
            raise ValueError(f"rotation.block {self.block} is not a power of two; vLLM's "
                             "Hadacore kernel takes Sylvester Hadamard blocks only (e.g. 64)")
        return self


class MixedPrecision(Strict):
    """More bits where the model feels them most, within a byte budget: before the method
    runs, each layer's cost at the recipe's scheme is measured on the calibration data (the KL
    divergence of the next-token distribution when only that layer is rounded) and the
    multiple-choice knapsack of `quantize fit` gives the costliest layers 8 bits (W8A16, the
    same group size) until the budget is spent (quantize/fit/mixed.py)."""

    budget: float = Field(
        gt=1.0, le=2.0, description="the export's weight bytes may reach this multiple of the "
        "export with every layer at the recipe's scheme (embeddings included), e.g. 1.055")
    tokens: int = Field(default=256, ge=16, le=1_000_000,
                        description="calibration tokens each sensitivity forward pass scores")
    samples: int = Field(default=1, ge=1, le=4096,
                         description="the tokens are taken from the starts of this many "
                         "calibration samples (tokens/samples each) instead of one")
    scales: Literal["minmax", "recipe"] = Field(
        default="minmax", description="the ranges each layer is rounded with while its cost is "
        "measured: min-max, or the recipe's observer (imatrix_mse, mse) as the export uses")
