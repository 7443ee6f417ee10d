"""compressed-tensors (pack-quantized, int-quantized, float-quantized, naive-quantized) ->
bf16/fp16 safetensors, one module at a time through compressed-tensors' own model-free
CompressedTensorsDequantizer (each scheme's compressor `decompress`), never a model load.

The check decompresses the same module again in float32: the difference to the written
tensor is the target dtype's rounding only. KV-cache and activation scales have no place in
a dense checkpoint and are listed as dropped with that reason."""

from __future__ import annotations

import math

import torch

from quantize.convert.base import Converted, DenseTarget, compare, passthrough
from quantize.convert.shards import TensorGroup
from quantize.errors import ModelError, first_line
from quantize.model.formats import Detected

# side tensors a dense model has no use for (the reason goes into the report)
ACTIVATION_SCALES = ("input_scale", "input_global_scale", "input_zero_point", "output_scale",
                     "output_zero_point", "k_scale", "v_scale", "q_scale")
DROPPED_REASON = "activation / KV-cache scale: a dense checkpoint has no use for it"


class CompressedToDense(DenseTarget):
    name = "compressed-tensors -> dense"

    def __init__(self, detected: Detected, dtype: str) -> None:
        from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
            CompressedTensorsDequantizer,
        )

        super().__init__(detected, dtype)
        try:
            self.lib = CompressedTensorsDequantizer(detected.path, dtype=self.dtype)
            self.ref = CompressedTensorsDequantizer(detected.path, dtype=torch.float32)
        except ValueError as exc:
            raise ModelError(problem=f"compressed-tensors cannot read its quantization_config "
                             f"({first_line(exc)})", path=detected.path / "config.json",
                             hint="only compressed-tensors quantization configs convert "
                                  "this way") from None
        self.names = set(detected.tensors)

    def deps(self, name: str) -> set[str]:
        return {d for d in self.lib.get_dependencies(name) if d in self.names} | \
            self._activation_scales(name)

    def _activation_scales(self, name: str) -> set[str]:
        module, _, param = name.rpartition(".")
        if param not in ("weight", "weight_packed"):
            return set()
        return {f"{module}.{s}" for s in ACTIVATION_SCALES if f"{module}.{s}" in self.names}

    def estimate(self, group: TensorGroup) -> int:
        info = self.detected.tensors[group.names[0]]
        shape_name = group.names[0].rpartition(".")[0] + ".weight_shape"
        if info.name.endswith("weight_packed") and shape_name in self.detected.tensors:
            # the packed width is 32/bits x smaller than the weight
            return math.prod(info.shape) * 8 * self.dtype.itemsize
        return math.prod(info.shape) * self.dtype.itemsize

    def convert(self, tensors: dict[str, torch.Tensor]) -> Converted:
        primary = next(iter(tensors))
        module = primary.rpartition(".")[0]
        dropped = {n: DROPPED_REASON for n in tensors
                   if n.rpartition(".")[2] in ACTIVATION_SCALES and n != primary}
        if primary.rpartition(".")[2] in ACTIVATION_SCALES:  # a KV-cache scale alone
            return Converted(dropped={primary: DROPPED_REASON})
        # scales in float32 so each weight is rounded once, to the target dtype (the
        # decompressor computes in the scale's dtype, fp16 for most checkpoints)
        kept = {n: (t.to(torch.float32) if n.endswith(".weight_scale") else t)
                for n, t in tensors.items() if n not in dropped}
        if len(kept) == 1 and primary.endswith(".weight") and \
                not any(n.endswith("weight_scale") for n in kept):
            done = passthrough(primary, kept[primary], self.dtype)
            done.mapped.update({n: primary for n in dropped})
            done.dropped.update(dropped)
            return done
        try:
            out = self.lib.process(dict(kept))
            ref = self.ref.process(dict(kept))
        except (KeyError, ValueError, RuntimeError) as exc:
            raise ModelError(problem=f"cannot decompress {module} ({first_line(exc)})",
                             path=self.detected.path,
                             hint="the tensors do not match the quantization_config") from None
        weight = f"{module}.weight"
        leftover = sorted(set(out) - {weight})
        if weight not in out or leftover:
            raise ModelError(problem=f"{module} did not decompress to one weight (left: "
                             f"{leftover[:3]})", path=self.detected.path,
                             hint="the module's scheme is not one compressed-tensors "
                                  "decompresses")
        mapped = {n: weight for n in tensors}
        return Converted({weight: out[weight]}, mapped,
                         [compare(primary, weight, ref[weight], out[weight])], dropped)

    def notes(self) -> list[str]:
        return [f"compressed-tensors ({self.detected.detail}) decompressed module by module "
                f"(CompressedTensorsDequantizer) -> {self.dtype_name}; quantization_config "
                "removed"]
