"""The one home for checkpoint format facts: which formats the product reads or writes, and
`detect(path)`, which names the format of a folder or file from config.json, the safetensors
headers (no tensor is read) or the GGUF header.

Detection looks at both the config's `quantization_config` and the tensor names, because
either alone lies: a config that says gptq over plain tensors, an FP8 checkpoint whose
config lost its block, a `.bin`-only folder. A contradiction or an unknown input is refused
in one line naming what was found and what is supported, before any work starts.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from quantize.errors import ModelError


class Format(StrEnum):
    """Every checkpoint format quantize reads or writes (the value is the CLI name)."""

    HF_BF16 = "hf-bf16"  # plain safetensors, 16/32-bit floats
    HF_FP16 = "hf-fp16"
    HF_FP32 = "hf-fp32"
    COMPRESSED_TENSORS = "compressed-tensors"  # llm-compressor / vLLM (detail: its format)
    GPTQ = "gptq"  # AutoGPTQ / GPTQModel native (`quant_method: gptq`)
    AWQ = "awq"  # AutoAWQ GEMM (`quant_method: awq`)
    FP8_BLOCK = "fp8-block"  # DeepSeek/Kimi style: fp8 weight + `weight_scale_inv` blocks
    MODELOPT = "modelopt"  # NVIDIA ModelOpt (detected, refused)
    GGUF = "gguf"  # llama.cpp (detail: its file type)


DENSE = (Format.HF_BF16, Format.HF_FP16, Format.HF_FP32)
QUANTIZED_HF = (Format.COMPRESSED_TENSORS, Format.GPTQ, Format.AWQ, Format.FP8_BLOCK)
DENSE_DTYPE = {Format.HF_BF16: "bfloat16", Format.HF_FP16: "float16",
               Format.HF_FP32: "float32"}

# `quantization_config.quant_method` values and the format each names
METHOD_FORMAT = {Format.COMPRESSED_TENSORS.value: Format.COMPRESSED_TENSORS, "gptq": Format.GPTQ,
                 "awq": Format.AWQ, "fp8": Format.FP8_BLOCK, "modelopt": Format.MODELOPT}
NATIVE_METHODS = ("gptq", "awq")
# the methods the pipeline's readers (quantize.model.qconfig) parse; modelopt is only refused
KNOWN_QUANT_METHODS = (Format.COMPRESSED_TENSORS.value, *NATIVE_METHODS, "fp8")

# compressed-tensors' per-group format strings (compressed_tensors.config.CompressionFormat)
CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized",
              "nvfp4-pack-quantized", "mxfp4-pack-quantized", "dense")
CT_PACKED = "pack-quantized"

# tensor-name suffixes that are quantization side tensors, per family
FP8_SCALE = "weight_scale_inv"
NATIVE_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
CT_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
               "weight_g_idx", "weight_global_scale", "input_scale", "input_global_scale",
               "input_zero_point", "output_scale", "k_scale", "v_scale")
SIDE_SUFFIXES = (FP8_SCALE, *NATIVE_SUFFIXES, *CT_SUFFIXES)

# safetensors header dtype -> bytes per element
ST_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                  "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2,
                  "U32": 4, "U64": 8, "F8_E8M0": 1, "F4": 1}
_DENSE_OF = {"BF16": Format.HF_BF16, "F16": Format.HF_FP16, "F32": Format.HF_FP32}
_PICKLE = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
SUPPORTED_LINE = ("supported: " + ", ".join(f.value for f in Format if f is not Format.MODELOPT)
                  + " (safetensors folders with config.json, or a .gguf file)")
MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header states it (never read)."""

    name: str
    file: str  # file name inside the folder
    dtype: str  # safetensors dtype, e.g. BF16, F8_E4M3, I32
    shape: tuple[int, ...]
    start: int  # byte offsets inside the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class Detected:
    """What `detect` found: the format, its detail (compressed-tensors' format string, the
    GGUF file type, GPTQ's checkpoint_format, AWQ's version), the config's quantization
    block as written, and every tensor from the headers (safetensors inputs)."""

    format: Format
    path: Path
    detail: str | None = None
    quant_config: dict[str, Any] | None = None
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    largest_tensor_bytes: int = 0  # GGUF inputs (safetensors ones read it from `tensors`)

    @property
    def total_bytes(self) -> int:
        if self.tensors:
            return sum(t.nbytes for t in self.tensors.values())
        return self.path.stat().st_size if self.path.is_file() else 0

    def describe(self) -> str:
        return f"{self.format.value} ({self.detail})" if self.detail else self.format.value


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header and the offset its data section starts at. Refuses
    a file too short for its header (a truncated download) in one line."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelError(problem="is not a safetensors file (shorter than its 8-byte "
                             "header length)", path=path, hint="re-download the file")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise ModelError(problem=f"is truncated or not safetensors (header of {n} bytes, "
                             f"file of {size})", path=path, hint="re-download the file")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ModelError(problem=f"has an unreadable safetensors header ({exc})",
                             path=path, hint="re-download the file") from None
    if not isinstance(header, dict):
        raise ModelError(problem="has a safetensors header that is not a table", path=path,
                         hint="re-download the file")
    return header, 8 + n


def header_tensors(path: Path) -> dict[str, TensorInfo]:
    """Every tensor a safetensors file's header names, checked against the file's size and
    the dtype table, so a truncated shard is refused here, before any conversion work."""
    header, data_start = read_header(path)
    data_len = path.stat().st_size - data_start
    out: dict[str, TensorInfo] = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
        if dtype not in ST_DTYPE_BYTES or not isinstance(shape, list) or \
                not isinstance(offsets, list) or len(offsets) != 2:
            raise ModelError(problem=f"tensor {name!r} has an unknown dtype or bad header "
                             f"entry ({dtype})", path=path, hint="re-download the file")
        start, end = int(offsets[0]), int(offsets[1])
        count = 1
        for d in shape:
            count *= int(d)
        expected = count * ST_DTYPE_BYTES[dtype]
        if dtype == "F4":
            expected = (count + 1) // 2
        if end > data_len or end - start != expected:
            raise ModelError(problem=f"is truncated: tensor {name!r} ends at byte {end} of "
                             f"{data_len}, its shape needs {expected} bytes", path=path,
                             hint="re-download the file (the shard is incomplete)")
        out[name] = TensorInfo(name, path.name, dtype, tuple(int(d) for d in shape), start, end)
    return out


def shard_files(folder: Path) -> list[str]:
    """The safetensors files of a folder: the index's (each must exist) or all of them."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelError(problem=f"has an unreadable index ({exc})", path=index,
                             hint="re-download model.safetensors.index.json") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise ModelError(problem=f"names {len(missing)} shard(s) that are missing "
                             f"({missing[0]})", path=index,
                             hint="download every shard the index lists")
        return files
    return sorted(p.name for p in folder.glob("*.safetensors"))


def folder_tensors(folder: Path) -> dict[str, TensorInfo]:
    """Every tensor of a safetensors folder from its headers; with an index, the index and
    the headers must agree (same names, each in the file the index says)."""
    files = shard_files(folder)
    tensors: dict[str, TensorInfo] = {}
    for name in files:
        for tname, info in header_tensors(folder / name).items():
            if tname in tensors:
                first = tensors[tname].file
                raise ModelError(problem=f"tensor {tname!r} is stored twice ({first} and "
                                 f"{name})", path=folder,
                                 hint="remove the stray shard")
            tensors[tname] = info
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        wrong = [n for n, f in weight_map.items() if n not in tensors or tensors[n].file != f]
        extra = [n for n in tensors if n not in weight_map]
        if wrong or extra:
            what = wrong[0] if wrong else extra[0]
            raise ModelError(problem=f"index and shard headers disagree ({len(wrong)} listed "
                             f"tensors not where the index says, {len(extra)} unlisted; "
                             f"first: {what!r})", path=index,
                             hint="re-download the checkpoint")
    return tensors


def _suffixes(tensors: dict[str, TensorInfo]) -> Counter[str]:
    return Counter(n.rpartition(".")[2] for n in tensors)


def _refuse(path: Path, found: str, why: str) -> ModelError:
    return ModelError(problem=f"format found: {found}; {why}", path=path,
                      hint=SUPPORTED_LINE)


def _gguf(path: Path) -> Detected:
    from gguf import GGUFReader
    from gguf.constants import GGMLQuantizationType, LlamaFileType

    try:
        reader = GGUFReader(path)
    except Exception as exc:
        raise _refuse(path, "a .gguf file that gguf cannot read",
                      str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
    field_ = reader.get_field("general.file_type")
    detail = None
    if field_ is not None:
        value = int(field_.parts[field_.data[0]][0])
        try:
            detail = LlamaFileType(value).name.removeprefix("MOSTLY_")
        except ValueError:
            detail = f"file_type {value}"
    types = Counter(GGMLQuantizationType(t.tensor_type).name for t in reader.tensors)
    return Detected(Format.GGUF, path, detail,
                    largest_tensor_bytes=max((int(t.n_bytes) for t in reader.tensors), default=0),
                    notes=["tensor types: " + ", ".join(f"{k} x{v}" for k, v in
                                                        sorted(types.items()))])


def _config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise _refuse(folder, "a safetensors folder without config.json",
                      "the architecture cannot be known")
    try:
        cfg = json.loads(path.read_text())
    except ValueError as exc:
        raise ModelError(problem=f"is not valid JSON ({exc})", path=path,
                         hint="fix or re-download config.json") from None
    if not isinstance(cfg, dict):
        raise ModelError(problem="is not a JSON object", path=path, hint="fix config.json")
    return cfg


def _from_tensors(folder: Path, qc: dict[str, Any] | None,
                  tensors: dict[str, TensorInfo]) -> Detected:
    suffix = _suffixes(tensors)
    method = str(qc.get("quant_method")) if qc else None
    has_fp8 = suffix[FP8_SCALE] > 0
    has_native = suffix["qweight"] > 0
    has_ct = any(suffix[s] for s in ("weight_packed", "weight_scale", "weight_global_scale"))
    found = ("fp8 weights with weight_scale_inv" if has_fp8 else
             "GPTQ/AWQ qweight tensors" if has_native else
             "compressed-tensors weight_packed/weight_scale tensors" if has_ct else
             "plain float tensors")
    if method is not None and method not in METHOD_FORMAT:
        raise _refuse(folder, f"quant_method {method!r}", "this method is not supported")
    fmt = METHOD_FORMAT.get(method) if method else None
    if fmt is Format.MODELOPT:
        raise _refuse(folder, "ModelOpt (quant_method: modelopt)",
                      "ModelOpt's NVFP4 weight_scale_2 is amax/(6*448), the reciprocal of "
                      "compressed-tensors' weight_global_scale: convert with compressed-"
                      "tensors' ModelOptNvfp4Converter first")
    expected = {Format.FP8_BLOCK: has_fp8, Format.GPTQ: has_native, Format.AWQ: has_native,
                Format.COMPRESSED_TENSORS: has_ct or _ct_dense(qc)}
    if fmt is not None and not expected[fmt]:
        raise _refuse(folder, f"config says quant_method {method!r} but the tensors are "
                      f"{found}", "the config and the weights contradict each other")
    if fmt is None and (has_native or has_ct):
        raise _refuse(folder, f"{found} without a quantization_config",
                      "the quantization parameters cannot be known")
    if fmt is None and has_fp8:
        fmt = Format.FP8_BLOCK
    if fmt is None:
        dtypes = Counter(t.dtype for n, t in tensors.items() if t.dtype in _DENSE_OF)
        if not dtypes:
            raise _refuse(folder, "no 16/32-bit float tensors", "nothing to convert")
        dense = _DENSE_OF[dtypes.most_common(1)[0][0]]
        return Detected(dense, folder, None, None, tensors)
    return Detected(fmt, folder, _detail(fmt, qc or {}), qc, tensors)


def _ct_dense(qc: dict[str, Any] | None) -> bool:
    return bool(qc) and qc.get("format") == "dense"  # type: ignore[union-attr]


def _detail(fmt: Format, qc: dict[str, Any]) -> str | None:
    if fmt is Format.COMPRESSED_TENSORS:
        groups = qc.get("config_groups") or {}
        names = {str(g.get("format") or qc.get("format")) for g in groups.values()
                 if isinstance(g, dict)} or {str(qc.get("format"))}
        return ",".join(sorted(names))
    if fmt is Format.GPTQ:
        return str(qc.get("checkpoint_format") or qc.get("format") or "gptq")
    if fmt is Format.AWQ:
        return str(qc.get("version") or "gemm").lower()
    if fmt is Format.FP8_BLOCK:
        block = qc.get("weight_block_size")
        return f"block {block[0]}x{block[1]}" if isinstance(block, list) and block else None
    return None


def detect(path: Path) -> Detected:
    """The format of `path` (a folder or a .gguf file), from headers only."""
    path = Path(path)
    if not path.exists():
        raise ModelError(problem="does not exist", path=path, path_sep=" ",
                         hint="pass a model folder or a .gguf file")
    if path.is_file():
        if path.suffix == ".gguf":
            return _gguf(path)
        if path.suffix in _PICKLE:
            raise _refuse(path, f"a pickle file ({path.suffix})",
                          "pickle can run code when loaded; convert it to safetensors")
        if path.suffix == ".safetensors":
            raise _refuse(path, "a lone .safetensors file",
                          "pass the folder that holds it and its config.json")
        raise _refuse(path, f"an unknown file type ({path.suffix or 'no suffix'})",
                      "nothing this tool reads")
    ggufs = sorted(path.glob("*.gguf"))
    safetensors = shard_files(path)
    if not safetensors:
        if len(ggufs) == 1:
            return _gguf(ggufs[0])
        pickles = [p.name for s in _PICKLE for p in path.glob(f"*{s}")]
        if pickles:
            raise _refuse(path, f"pickle weights only ({pickles[0]})",
                          "pickle can run code when loaded; convert it to safetensors")
        if len(ggufs) > 1:
            raise _refuse(path, f"{len(ggufs)} .gguf files", "pass one of them")
        raise _refuse(path, "no weights", "the folder holds no safetensors or .gguf file")
    cfg = _config(path)
    qc = cfg.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise ModelError(problem="quantization_config is not a JSON object",
                         path=path / "config.json", hint="fix config.json")
    return _from_tensors(path, qc, folder_tensors(path))


def mtp_layer_names(names: set[str], num_hidden_layers: int | None) -> set[str]:
    """Tensor names of layers at or beyond num_hidden_layers (DeepSeek-style MTP / nextn
    layers stored as `model.layers.<N>.`), or of explicit `mtp.`/`nextn` modules: found from
    the weights, so a config that lacks `num_nextn_predict_layers` cannot hide them."""
    out = set()
    for n in names:
        parts = n.split(".")
        if "mtp" in parts or any("nextn" in p for p in parts):
            out.add(n)
            continue
        if num_hidden_layers is not None and "layers" in parts:
            i = parts.index("layers")
            if i + 1 < len(parts) and parts[i + 1].isdigit() and \
                    int(parts[i + 1]) >= num_hidden_layers:
                out.add(n)
    return out
