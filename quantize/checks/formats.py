"""Pre-flight for the microscaling and block formats (NVFP4, MXFP4, block FP8) and for the
target GPU: shapes vLLM refuses at load, and formats the GPU named with `--gpu` runs only
through a fallback or not at all. From config.json alone (the meta model), before any
calibration. The capability rules are the scheme table's (quantize.recipe.schemes.KERNELS)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quantize.errors import PreflightError
from quantize.recipe.schemes import (
    KERNELS,
    SCHEMES,
    gpu_problem,
    gpu_support_level,
    native_schemes,
)


@dataclass(frozen=True)
class GpuTarget:
    """The GPU an export is meant for (`--gpu`): its catalog name and compute capability x10
    (quantize.planner.gpus resolves the name; this layer only needs the numbers)."""

    name: str
    cc: int

    @property
    def sm(self) -> str:
        return f"sm_{self.cc}"


def _shards(name: str, groups: tuple[tuple[str, ...], ...]) -> tuple[str, ...] | None:
    leaf = name.rpartition(".")[2]
    return next((g for g in groups if leaf in g), None)


def check_shapes(schemes: list[Any], tp: int, fused: tuple[tuple[str, ...], ...],
                 row_parallel: tuple[str, ...]) -> None:
    """`schemes`: pre-flight's LayerScheme list. NVFP4/MXFP4: each layer's input (per
    tensor-parallel rank for row-parallel layers) must be a whole number of groups (vLLM
    allocates input_size_per_partition // group scales: compressed_tensors_w4a4_nvfp4.py /
    _mxfp4.py create_weights). Block FP8: vLLM's validate_fp8_block_shape
    (quantization/utils/fp8_utils.py): row-parallel inputs per rank and column-parallel
    outputs per rank divisible by the block when tp > 1, and every shard of a fused layer
    but the last divisible by the block's rows even at tp 1; and every input a whole number
    of the dynamic activation groups (128), which compressed-tensors cannot split otherwise
    (the default model's o_proj, 576 wide, failed at eval: bench/RESULTS.md)."""
    for ls in schemes:
        info = SCHEMES.get(ls.scheme) if ls.scheme else None
        if info is None or not (info.fixed_group or info.block):
            continue
        lay = ls.layer
        leaf = lay.name.rpartition(".")[2]
        row = leaf in row_parallel
        k = lay.in_features // tp if row else lay.in_features
        n = lay.out_features if row else lay.out_features // tp
        if info.fixed_group and k % info.fixed_group:
            where = f"{k} per rank at --tp {tp}" if row and tp > 1 else str(lay.in_features)
            raise PreflightError(
                problem=f"{info.name} quantizes in groups of {info.fixed_group}, which do not "
                        f"divide {lay.name}'s input ({where})",
                hint=f"add {leaf} to `ignore` or use a --tp whose shards keep "
                     f"{info.fixed_group} | input")
        if not info.block:
            continue
        bn, bk = info.block
        if tp > 1 and row and k % bk:
            raise PreflightError(
                problem=f"--tp {tp}: {lay.name} has in_features {lay.in_features}, {k} per "
                        f"rank, not a multiple of the {bk}-column FP8 block (vLLM refuses it, "
                        "fp8_utils.py validate_fp8_block_shape)",
                hint=f"use a tp with ({lay.in_features} / tp) % {bk} == 0, or add {leaf} to "
                     "`ignore`")
        group = _shards(lay.name, fused)
        last = group is not None and leaf == group[-1]
        if n % bn and ((tp > 1 and not row) or (group is not None and not last)):
            why = f"{lay.out_features} ({n} per rank at --tp {tp})" if tp > 1 else \
                f"{lay.out_features} (a shard of the fused {'/'.join(group or ())})"
            raise PreflightError(
                problem=f"{lay.name}: out_features {why} is not a multiple of the {bn}-row FP8 "
                        "block, which vLLM refuses (fp8_utils.py validate_fp8_block_shape)",
                hint=f"add {'/'.join(group or (leaf,))} to `ignore`, or use fp8-dynamic (per "
                     "channel)")
        if k % bk:  # tp 1, or a column-parallel layer: the activation groups
            raise PreflightError(
                problem=f"{lay.name}: in_features {lay.in_features} is not a multiple of {bk}: "
                        f"block FP8 quantizes activations dynamically in groups of {bk} along the "
                        "input, which compressed-tensors cannot split "
                        "(compute_dynamic_scales_and_zp; the export would fail at eval)",
                hint=f"add {leaf} to `ignore`, or use fp8-dynamic (per channel)")


def gpu_notes(schemes: list[Any], gpu: GpuTarget, experts: bool) -> list[str]:
    """Warnings for formats `gpu` runs only through a weight-only fallback; raises for a
    format vLLM has no path for on that GPU. Each names what runs natively there."""
    notes: list[str] = []
    native = native_schemes(gpu.cc)
    for name in sorted({ls.scheme for ls in schemes if ls.scheme}):
        instead = alternatives(name, native)
        family = SCHEMES[name].kernel
        rule = KERNELS[family]
        level = gpu_support_level(family, gpu.cc, moe=experts)
        label = rule.label or family
        bits = SCHEMES[name].weight_bits
        if rule.gpu_bits and bits not in rule.gpu_bits:
            raise PreflightError(
                problem=f"{name} has no vLLM kernel on {gpu.name}: "
                        f"{gpu_problem(family, bits, gpu.cc)}",
                hint=f"formats native on {gpu.name}: {instead}")
        if level == "unsupported":
            raise PreflightError(
                problem=f"{name} ({label}) has no vLLM kernel on {gpu.name} ({gpu.sm}): it "
                        f"needs compute capability >= {rule.gpu_min_cc / 10:.1f} "
                        f"({rule.gpu_source})",
                hint=f"formats native on {gpu.name}: {instead}")
        if level == "fallback":
            notes.append(
                f"{name} ({label}) is not native on {gpu.name} ({gpu.sm}, native from "
                f"sm_{rule.gpu_native_cc}): vLLM runs it through {rule.fallback or 'a fallback'}"
                f"; native there: {instead}")
    return notes


def alternatives(scheme: str, native: list[str]) -> str:
    """What runs natively instead, in words: the same weight bits first, then the formats
    that also quantize activations."""
    bits = SCHEMES[scheme].weight_bits
    same = [n for n in native if SCHEMES[n].weight_bits == bits]
    act = [n for n in native if SCHEMES[n].activations != "none" and n not in same]
    parts = []
    if same:
        parts.append(f"{bits}-bit weights: {', '.join(same)}")
    if act:
        parts.append(f"quantized activations: {', '.join(act)}")
    return "; ".join(parts) or "none of this project's schemes"
