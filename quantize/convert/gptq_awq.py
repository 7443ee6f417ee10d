"""AutoGPTQ / GPTQModel and AutoAWQ GEMM checkpoints -> compressed-tensors W4A16
pack-quantized (what llm-compressor writes for W4A16 / W4A16_ASYM and vLLM's
compressed-tensors WNA16 path loads): `weight_packed` int32 [out, in/8], `weight_scale`
[out, groups], `weight_zero_point` int32 [out/8, groups] when asymmetric, and `weight_shape`.
compressed-tensors 0.19 has no `weight_g_idx` / actorder=group any more, so a GPTQ act-order
checkpoint with a permuted g_idx is refused before any work (it converts to bf16 instead).

AWQ is compressed-tensors' own AutoAWQConverter (it undoes AWQ's [0,2,4,6,1,3,5,7] column
interleave); its check dequantizes the source with AutoAWQ's own `dequantize_gemm`. GPTQ has no
library converter, so it is written here from GPTQModel's layout (gptqmodel/nn_modules/
qlinear/__init__.py `dequantize_weight`): qweight int32 [in/8, out] packs 8 input rows per word
(row k*8+j at bits 4j), qzeros int32 [groups, out/8] packs 8 output columns, scales
[groups, out], g_idx [in]; checkpoint_format `gptq` (v1) stores each zero minus one, which
is undone at the word level as GPTQModel's convert_gptq_v1_to_v2 does (+0x11111111). The
codes are unsigned [0, 15]; compressed-tensors stores signed [-8, 7] and `pack_to_int32`
adds 8 back, so the packed nibbles are the same codes. The check dequantizes both sides from
their own stored tensors (GPTQ's formula here, compressed-tensors' decompress there)."""

from __future__ import annotations

import math
from typing import Any

import torch

from quantize.convert.base import Converted, DenseTarget, compare, passthrough
from quantize.convert.shards import TensorGroup
from quantize.errors import ModelError
from quantize.model.formats import CT_PACKED, Detected, Format

_V1_OFFSET = 0x11111111  # +1 in each of a word's eight 4-bit zero codes


def _unpack_rows(q: torch.Tensor) -> torch.Tensor:
    """GPTQ qweight [in/8, out] -> codes [in, out] (row k*8+j at bits 4j of word k)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    codes = (q.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF
    return codes.reshape(q.shape[0] * 8, q.shape[1])


def _unpack_cols(q: torch.Tensor) -> torch.Tensor:
    """GPTQ qzeros [groups, out/8] -> codes [groups, out] (column k*8+j at bits 4j)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    codes = (q.unsqueeze(2) >> shifts.view(1, 1, 8)) & 0xF
    return codes.reshape(q.shape[0], q.shape[1] * 8)


def gptq_dequant(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                 g_idx: torch.Tensor, v1: bool) -> torch.Tensor:
    """The float32 weight [out, in] a GPTQ module computes with."""
    codes = _unpack_rows(qweight).to(torch.float32)
    zeros = _unpack_cols(_v2_zeros(qzeros) if v1 else qzeros).to(torch.float32)
    g = g_idx.long()
    w = (codes - zeros[g]) * scales.to(torch.float32)[g]
    return w.T.contiguous()


def _v2_zeros(qzeros: torch.Tensor) -> torch.Tensor:
    """v1 zeros (stored minus one) as v2 words, in int64 so the carry cannot overflow."""
    return (qzeros.to(torch.int64) + _V1_OFFSET) & 0xFFFFFFFF


def ct_dequant(tensors: dict[str, torch.Tensor], module: str, group_size: int,
               symmetric: bool) -> torch.Tensor:
    """compressed-tensors' own decompress of `module` as we wrote it, in float32."""
    from compressed_tensors.compressors.pack_quantized.base import (
        PackedQuantizationCompressor,
    )

    state = {k.removeprefix(module + "."): v for k, v in tensors.items()
             if k.startswith(module + ".")}
    state["weight_scale"] = state["weight_scale"].to(torch.float32)  # exact products
    return PackedQuantizationCompressor.decompress(state, _scheme(group_size, symmetric))[
        "weight"].to(torch.float32)


def _scheme(group_size: int, symmetric: bool) -> Any:
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationScheme,
        QuantizationStrategy,
        QuantizationType,
    )

    strategy = QuantizationStrategy.GROUP if group_size > 0 else QuantizationStrategy.CHANNEL
    weights = QuantizationArgs(num_bits=4, type=QuantizationType.INT, symmetric=symmetric,
                               group_size=group_size if group_size > 0 else None,
                               strategy=strategy, dynamic=False)
    return QuantizationScheme(targets=["Linear"], weights=weights, format=CT_PACKED)


def ct_quant_config(group_size: int, symmetric: bool, ignore: list[str]) -> dict[str, Any]:
    """The compressed-tensors block llm-compressor writes for W4A16 (symmetric) or
    W4A16_ASYM, built with compressed-tensors' own classes."""
    from compressed_tensors import __version__
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    cfg = QuantizationConfig(config_groups={"group_0": _scheme(group_size, symmetric)},
                             ignore=ignore, format=CT_PACKED,
                             quantization_status=QuantizationStatus.COMPRESSED.value)
    data = cfg.model_dump()
    data["version"] = __version__
    return data


def _unquantized_linears(detected: Detected, quantized: set[str]) -> list[str]:
    """2-D weights of modules that were not quantized (lm_head, anything the source left
    dense): compressed-tensors' ignore list must name them or vLLM expects packed weights."""
    out = ["lm_head"]  # llm-compressor always ignores it (stored or tied)
    for name, info in detected.tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and len(info.shape) == 2 and module not in quantized \
                and "embed" not in module and module not in out:
            out.append(module)
    return out


class _NativeToCT:
    """Shared parts: grouping by module, the ignore list, the config rewrite."""

    name = "native -> compressed-tensors"
    side = ("qzeros", "scales", "g_idx")

    def __init__(self, detected: Detected) -> None:
        qc = detected.quant_config or {}
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        if bits != 4:
            raise ModelError(problem=f"{detected.format.value} with {bits}-bit weights",
                             path=detected.path / "config.json",
                             hint="only 4-bit GPTQ/AWQ converts to compressed-tensors W4A16")
        self.detected = detected
        self.group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
        self.names = set(detected.tensors)
        self.modules = {n.removesuffix(".qweight") for n in self.names
                        if n.endswith(".qweight")}
        self.symmetric = False

    def deps(self, name: str) -> set[str]:
        if not name.endswith(".qweight"):
            return set()
        module = name.removesuffix(".qweight")
        return {f"{module}.{s}" for s in self.side if f"{module}.{s}" in self.names}

    def estimate(self, group: TensorGroup) -> int:
        return sum(math.prod(self.detected.tensors[n].shape) *
                   (2 if self.detected.tensors[n].dtype in ("F16", "BF16") else 4)
                   for n in group.names)

    def config(self, config: dict[str, Any]) -> dict[str, Any]:
        out = dict(config)
        ignore = _unquantized_linears(self.detected, self.modules)
        out["quantization_config"] = ct_quant_config(self.group_size, self.symmetric, ignore)
        return out


class GptqToCT(_NativeToCT):
    name = "gptq -> compressed-tensors"

    def __init__(self, detected: Detected) -> None:
        super().__init__(detected)
        qc = detected.quant_config or {}
        fmt = str(qc.get("checkpoint_format") or "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ModelError(problem=f"GPTQ checkpoint_format {fmt!r}",
                             path=detected.path / "config.json",
                             hint="supported: gptq (v1) and gptq_v2")
        self.v1 = fmt == "gptq"
        # a symmetric config is trusted and checked per module (zeros must all be 8)
        self.symmetric = bool(qc.get("sym", True))
        self._refuse_act_order()

    def _refuse_act_order(self) -> None:
        """compressed-tensors 0.19 removed actorder=group and `weight_g_idx`: a GPTQ module
        whose g_idx is not the plain column // group_size has no lossless W4A16 form, so it
        is refused here (g_idx tensors are small) before any work."""
        from quantize.convert.shards import SourceShards

        src = SourceShards(self.detected.path, self.detected.tensors)
        for name in sorted(n for n in self.names if n.endswith(".g_idx")):
            g = src.load([name])[name].to(torch.int32)
            gs = self.group_size if self.group_size > 0 else g.numel()
            if not torch.equal(g, torch.arange(g.numel(), dtype=torch.int32) // gs):
                raise ModelError(problem=f"GPTQ act-order (desc_act) with a permuted g_idx "
                                 f"({name}): compressed-tensors has no actorder=group "
                                 "anymore, so W4A16 cannot hold it losslessly",
                                 path=self.detected.path,
                                 hint="convert it with --to hf-bf16 and re-quantize, or serve "
                                      "the GPTQ checkpoint in vLLM as it is")

    def convert(self, tensors: dict[str, torch.Tensor]) -> Converted:
        primary = next(iter(tensors))
        if not primary.endswith(".qweight"):
            return passthrough(primary, tensors[primary], None)
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

        m = primary.removesuffix(".qweight")
        qweight, qzeros, scales = tensors[primary], tensors[f"{m}.qzeros"], tensors[f"{m}.scales"]
        n_in, n_out = qweight.shape[0] * 8, qweight.shape[1]
        gs = self.group_size if self.group_size > 0 else n_in
        trivial = torch.arange(n_in, dtype=torch.int32) // gs
        g_idx = tensors.get(f"{m}.g_idx", trivial).to(torch.int32)
        codes = _unpack_rows(qweight)  # [in, out], unsigned
        zeros = _unpack_cols(_v2_zeros(qzeros) if self.v1 else qzeros)  # [groups, out]
        out: dict[str, torch.Tensor] = {
            f"{m}.weight_packed": pack_to_int32((codes.T - 8).to(torch.int8).contiguous(), 4),
            f"{m}.weight_scale": scales.T.contiguous(),
            f"{m}.weight_shape": torch.tensor([n_out, n_in], dtype=torch.int64)}
        if self.symmetric:
            if not bool((zeros == 8).all()):
                raise ModelError(problem=f"{m} has zero points other than 8 but the config "
                                 "says sym: true", path=self.detected.path / "config.json",
                                 hint="set quantization_config.sym to false")
        else:
            out[f"{m}.weight_zero_point"] = pack_to_int32(
                (zeros.T - 8).to(torch.int8).contiguous(), 4, packed_dim=0).contiguous()
        ref = gptq_dequant(qweight, qzeros, scales, g_idx, self.v1)
        got = ct_dequant(out, m, gs, self.symmetric)
        mapped = {n: f"{m}.weight_packed" for n in tensors}
        return Converted(out, mapped, [compare(f"{m}.qweight", f"{m}.weight_packed", ref, got)])

    def notes(self) -> list[str]:
        return [f"GPTQ ({'v1, zeros +1' if self.v1 else 'v2'}, group {self.group_size}, "
                f"{'sym' if self.symmetric else 'asym'}) repacked as compressed-tensors "
                "W4A16 pack-quantized (lossless: same codes, scales, zeros)"]


class AwqToCT(_NativeToCT):
    name = "awq -> compressed-tensors"

    def __init__(self, detected: Detected) -> None:
        super().__init__(detected)
        from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

        qc = detected.quant_config or {}
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ModelError(problem=f"AutoAWQ version {version!r}",
                             path=detected.path / "config.json",
                             hint="only AutoAWQ GEMM checkpoints convert")
        self.symmetric = not bool(qc.get("zero_point", True))
        self.lib = AutoAWQConverter(bits=4, group_size=self.group_size,
                                    zero_point=not self.symmetric, ignore=[])

    def convert(self, tensors: dict[str, torch.Tensor]) -> Converted:
        primary = next(iter(tensors))
        if not primary.endswith(".qweight"):
            return passthrough(primary, tensors[primary], None)
        from awq.utils.packing_utils import dequantize_gemm

        m = primary.removesuffix(".qweight")
        out = self.lib.process(dict(tensors))
        qz = tensors.get(f"{m}.qzeros")
        if qz is None:  # symmetric AWQ: zero 8 in every code
            qz = torch.full((tensors[f"{m}.scales"].shape[0], tensors[primary].shape[1]),
                            0x88888888 - (1 << 32), dtype=torch.int32)
        ref = dequantize_gemm(tensors[primary], qz, tensors[f"{m}.scales"].to(torch.float32),
                              4, self.group_size).T
        got = ct_dequant(out, m, self.group_size, self.symmetric)
        mapped = {n: f"{m}.weight_packed" for n in tensors}
        return Converted(out, mapped, [compare(primary, f"{m}.weight_packed", ref, got)])

    def notes(self) -> list[str]:
        return [f"AutoAWQ GEMM (group {self.group_size}) repacked as compressed-tensors W4A16"
                f"{'' if self.symmetric else '_ASYM'} pack-quantized (compressed-tensors "
                "AutoAWQConverter; lossless)"]


def make(detected: Detected) -> GptqToCT | AwqToCT:
    return GptqToCT(detected) if detected.format is Format.GPTQ else AwqToCT(detected)


class NativeToDense(DenseTarget):
    """GPTQ / AWQ -> dense float weights, each module dequantized by the source format's own
    formula (GPTQ: (code - zero[g_idx]) * scale[g_idx], act-order included; AWQ: AutoAWQ's
    `dequantize_gemm`). The check compares against the float32 value before the cast."""

    name = "native -> dense"

    def __init__(self, detected: Detected, dtype: str) -> None:
        super().__init__(detected, dtype)
        self.shared = _NativeToCT(detected)
        qc = detected.quant_config or {}
        self.v1 = str(qc.get("checkpoint_format") or "gptq") == "gptq"

    def deps(self, name: str) -> set[str]:
        return self.shared.deps(name)

    def estimate(self, group: TensorGroup) -> int:
        info = self.detected.tensors[group.names[0]]
        return math.prod(info.shape) * (8 if info.name.endswith(".qweight") else 1) * \
            self.dtype.itemsize

    def dequant(self, tensors: dict[str, torch.Tensor], m: str) -> torch.Tensor:
        qweight, scales = tensors[f"{m}.qweight"], tensors[f"{m}.scales"]
        gs = self.shared.group_size
        if self.detected.format is Format.AWQ:
            from awq.utils.packing_utils import dequantize_gemm

            qz = tensors.get(f"{m}.qzeros")
            if qz is None:
                qz = torch.full((scales.shape[0], qweight.shape[1]), 0x88888888 - (1 << 32),
                                dtype=torch.int32)
            return dequantize_gemm(qweight, qz, scales.to(torch.float32), 4,
                                   gs if gs > 0 else qweight.shape[0]).T.contiguous()
        n_in = qweight.shape[0] * 8
        trivial = torch.arange(n_in, dtype=torch.int32) // (gs if gs > 0 else n_in)
        g_idx = tensors.get(f"{m}.g_idx", trivial)
        return gptq_dequant(qweight, tensors[f"{m}.qzeros"], scales, g_idx, self.v1)

    def convert(self, tensors: dict[str, torch.Tensor]) -> Converted:
        primary = next(iter(tensors))
        if not primary.endswith(".qweight"):
            return passthrough(primary, tensors[primary], self.dtype)
        m = primary.removesuffix(".qweight")
        ref = self.dequant(tensors, m)
        out = ref.to(self.dtype)
        return Converted({f"{m}.weight": out}, {n: f"{m}.weight" for n in tensors},
                         [compare(primary, f"{m}.weight", ref, out)])

    def notes(self) -> list[str]:
        return [f"{self.detected.format.value} modules dequantized to {self.dtype_name}; "
                "quantization_config removed"]
