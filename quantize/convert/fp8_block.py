"""FP8-block (DeepSeek/Kimi style: an fp8 `weight` and a float32 `weight_scale_inv` per
block, 128x128 in published checkpoints) -> bf16/fp16 safetensors.

The multiply is compressed-tensors' own FP8BlockDequantizer (padding of partial edge blocks
included); the check recomputes it here independently (scales broadcast by
repeat_interleave, in float32), so a library change that altered values would show as a
max-abs above the target dtype's rounding. MTP / nextn layers are ordinary tensors here and
are carried like every other one."""

from __future__ import annotations

import math

import torch

from quantize.convert.base import Converted, DenseTarget, RunningCompare, compare, passthrough
from quantize.convert.produced import TensorCheck
from quantize.convert.shards import TensorGroup
from quantize.errors import ModelError
from quantize.model.formats import FP8_SCALE, Detected

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_ROW_BLOCKS = 16  # rows of blocks dequantized per library call


def block_size(detected: Detected) -> tuple[int, int]:
    """The block from the config's weight_block_size, checked against every stored scale's
    shape (a partial edge block rounds up)."""
    qc = detected.quant_config or {}
    raw = qc.get("weight_block_size") or [128, 128]
    if not (isinstance(raw, list) and len(raw) == 2 and all(isinstance(x, int) and x > 0
                                                            for x in raw)):
        raise ModelError(problem=f"weight_block_size {raw!r} is not two positive integers",
                         path=detected.path / "config.json", hint="fix config.json")
    bh, bw = int(raw[0]), int(raw[1])
    for name, info in detected.tensors.items():
        if not name.endswith("." + FP8_SCALE):
            continue
        weight = detected.tensors.get(name.removesuffix(FP8_SCALE) + "weight")
        if weight is None or len(weight.shape) != 2:
            continue
        want = (math.ceil(weight.shape[0] / bh), math.ceil(weight.shape[1] / bw))
        if tuple(info.shape) != want:
            raise ModelError(problem=f"{name} has shape {list(info.shape)}, blocks of "
                             f"{bh}x{bw} over {list(weight.shape)} need {list(want)}",
                             path=detected.path,
                             hint="set quantization_config.weight_block_size to the block "
                                  "the checkpoint was quantized with")
    return bh, bw


def reference(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
              ) -> torch.Tensor:
    """w * scale_inv with each scale repeated over its block, in float32."""
    bh, bw = block
    rows, cols = weight.shape
    s = scale_inv.to(torch.float32).repeat_interleave(bh, 0).repeat_interleave(bw, 1)
    return weight.to(torch.float32) * s[:rows, :cols]


class Fp8BlockToDense(DenseTarget):
    name = "fp8-block -> dense"

    def __init__(self, detected: Detected, dtype: str) -> None:
        from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import (
            FP8BlockDequantizer,
        )

        super().__init__(detected, dtype)
        self.block = block_size(detected)
        # targets "re:.*": every module whose weight has a scale (it only sees such groups)
        self.lib = FP8BlockDequantizer(targets=["re:.*"], weight_block_size=self.block,
                                       dtype=self.dtype)
        self.names = set(detected.tensors)

    def deps(self, name: str) -> set[str]:
        if name.endswith(".weight"):
            scale = name.removesuffix("weight") + FP8_SCALE
            if scale in self.names:
                return {scale}
        return set()

    def estimate(self, group: TensorGroup) -> int:
        info = self.detected.tensors[group.names[0]]
        return math.prod(info.shape) * self.dtype.itemsize

    def convert(self, tensors: dict[str, torch.Tensor]) -> Converted:
        (name, *rest) = tensors
        if not rest:
            if tensors[name].dtype in _FP8:
                raise ModelError(problem=f"{name} is fp8 but has no {FP8_SCALE}",
                                 path=self.detected.path,
                                 hint="the checkpoint is incomplete; re-download it")
            return passthrough(name, tensors[name], self.dtype)
        scale = rest[0]
        weight, scale_inv = tensors[name], tensors[scale]
        out = self._dequantize(name, scale, weight, scale_inv)
        return Converted({name: out}, {name: name, scale: name},
                         [self._check(name, weight, scale_inv, out)])

    def _dequantize(self, name: str, scale: str, weight: torch.Tensor,
                    scale_inv: torch.Tensor) -> torch.Tensor:
        """The library's multiply, 16 rows of blocks at a time into the output tensor: blocks
        are independent, and the library's float32 intermediates of a whole 28672x8192
        weight would be ~2 GB of the peak."""
        if weight.dim() != 2:
            return self.lib.process({name: weight, scale: scale_inv})[name]
        out = torch.empty(weight.shape, dtype=self.dtype)
        step = self.block[0] * _ROW_BLOCKS
        for i, r0 in enumerate(range(0, weight.shape[0], step)):
            part = {name: weight[r0:r0 + step],
                    scale: scale_inv[i * _ROW_BLOCKS:(i + 1) * _ROW_BLOCKS]}
            out[r0:r0 + step] = self.lib.process(part)[name]
        return out

    def _check(self, name: str, weight: torch.Tensor, scale_inv: torch.Tensor,
               out: torch.Tensor) -> TensorCheck:
        """The independent reference, one row of blocks at a time (a whole-tensor float32
        copy would triple the peak memory of the largest weight)."""
        bh = self.block[0]
        if weight.dim() != 2:
            return compare(name, name, reference(weight, scale_inv, self.block), out)
        running = RunningCompare(name, name)
        for i, r0 in enumerate(range(0, weight.shape[0], bh)):
            rows = slice(r0, r0 + bh)
            running.add(reference(weight[rows], scale_inv[i:i + 1], self.block), out[rows])
        return running.result()

    def notes(self) -> list[str]:
        return [f"fp8 weights x weight_scale_inv over {self.block[0]}x{self.block[1]} blocks "
                f"(compressed-tensors FP8BlockDequantizer) -> {self.dtype_name}; "
                "quantization_config removed"]
