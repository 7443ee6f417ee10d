"""What every safetensors-to-safetensors converter gives the streaming runner: the tensors a
weight depends on, an output size estimate, the conversion of one group, and the new
config.json. The runner (quantize.convert.stream) owns reading, sharding, resume and checks;
a converter never sees more than one group."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from quantize.convert.produced import TensorCheck
from quantize.convert.shards import TensorGroup

FLOAT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16,
                "float32": torch.float32}


@dataclass
class Converted:
    """One group's output: tensors by output name, source name -> output name for every
    source tensor (side tensors map to their weight's output), the round-trip checks, and
    source tensors deliberately not carried over with why."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    mapped: dict[str, str] = field(default_factory=dict)
    checks: list[TensorCheck] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)


class GroupConverter(Protocol):
    name: str

    def deps(self, name: str) -> set[str]: ...

    def estimate(self, group: TensorGroup) -> int: ...

    def convert(self, tensors: dict[str, torch.Tensor]) -> Converted: ...

    def config(self, config: dict[str, Any]) -> dict[str, Any]: ...

    def notes(self) -> list[str]: ...


def compare(source: str, target: str, ref: torch.Tensor, out: torch.Tensor) -> TensorCheck:
    """Max-abs difference and cosine of two tensors, in float32 (ref is the source's own
    dequantized value; out the converted tensor dequantized)."""
    a = ref.detach().reshape(-1).to(torch.float32)
    b = out.detach().reshape(-1).to(torch.float32)
    if a.numel() == 0:
        return TensorCheck(source, target, 0.0, 1.0)
    diff = float((a - b).abs().max())
    if diff == 0.0:
        return TensorCheck(source, target, 0.0, 1.0)  # float32 norms would round
    na, nb = float(a.norm()), float(b.norm())
    if na == 0.0 and nb == 0.0:
        cos = 1.0
    elif na == 0.0 or nb == 0.0:
        cos = 0.0
    else:
        cos = float(torch.dot(a, b) / (na * nb))
    return TensorCheck(source, target, diff, cos)


class RunningCompare:
    """`compare` accumulated over chunks (row blocks of one tensor), so a check of a large
    weight never holds a second float32 copy of it whole."""

    def __init__(self, source: str, target: str) -> None:
        self.source, self.target = source, target
        self.max_abs = 0.0
        self.dot = self.na = self.nb = 0.0

    def add(self, ref: torch.Tensor, out: torch.Tensor) -> None:
        a = ref.reshape(-1).to(torch.float64)
        b = out.reshape(-1).to(torch.float64)
        if a.numel():
            self.max_abs = max(self.max_abs, float((a - b).abs().max()))
            self.dot += float(torch.dot(a, b))
            self.na += float(torch.dot(a, a))
            self.nb += float(torch.dot(b, b))

    def result(self) -> TensorCheck:
        if self.max_abs == 0.0 or (self.na == 0.0 and self.nb == 0.0):
            return TensorCheck(self.source, self.target, self.max_abs, 1.0)
        if self.na == 0.0 or self.nb == 0.0:
            return TensorCheck(self.source, self.target, self.max_abs, 0.0)
        return TensorCheck(self.source, self.target, self.max_abs,
                           self.dot / (self.na ** 0.5 * self.nb ** 0.5))


def passthrough(name: str, tensor: torch.Tensor, dtype: torch.dtype | None) -> Converted:
    """A tensor the conversion does not touch: floats cast to the target dtype (when one is
    set), anything else as stored."""
    out = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
    check = compare(name, name, tensor, out) if tensor.is_floating_point() else \
        TensorCheck(name, name, float((tensor != out).sum()), 1.0)
    return Converted({name: out}, {name: name}, [check])


class DenseTarget:
    """What the converters to plain float weights share: the source they read, the output
    dtype (its name for the config, its torch dtype for the tensors) and the config.json a
    dense checkpoint gets (`dense_config`)."""

    def __init__(self, detected: Any, dtype: str) -> None:
        self.detected = detected
        self.dtype_name = dtype
        self.dtype = FLOAT_DTYPES[dtype]

    def config(self, config: dict[str, Any]) -> dict[str, Any]:
        return dense_config(config, self.dtype_name)


def dense_config(config: dict[str, Any], dtype: str) -> dict[str, Any]:
    """config.json of a dense output: the quantization block removed, the dtype set (both
    spellings, as transformers 4.x and 5.x write it)."""
    out = {k: v for k, v in config.items() if k != "quantization_config"}
    out["torch_dtype"] = dtype
    if "dtype" in out or "torch_dtype" in config:
        out["dtype"] = dtype
    return out
