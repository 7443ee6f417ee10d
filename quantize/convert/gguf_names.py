"""The one table between GGUF and Hugging Face terms, used by every GGUF converter
(gguf_in, gguf_out) and by the GGUF facts reader (gguf_facts), so the two directions cannot
drift apart: which architectures are supported, tensor names both ways, llama.cpp's q/k row
permutation, and rope scaling keys.

Tensor names come from the libraries, not from a hand table: gguf-py's TensorNameMap gives
HF -> GGUF, and the inverse is built from the state-dict keys of the transformers class itself
(instantiated on the meta device, no memory), the way transformers' own GGUF loader builds its
map (modeling_gguf_pytorch_utils.get_gguf_hf_weights_map)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from quantize.convert.produced import TensorCheck
from quantize.errors import ModelError

# GGUF `general.architecture` -> transformers model_type, for the dense llama family that
# transformers' GGUF loader and llama.cpp both read with the same tensor layout.
GGUF_TO_HF_TYPE: dict[str, str] = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# transformers model_type -> GGUF architecture (llama.cpp writes Mistral as llama).
HF_TO_GGUF_ARCH: dict[str, str] = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2",
                                   "qwen3": "qwen3"}
# GGUF archs whose attn_q/attn_k rows llama.cpp's converter permutes (its LlamaModel.permute);
# Qwen2/Qwen3 are written unpermuted (transformers' TENSOR_PROCESSORS agrees).
ROPE_PERMUTED: frozenset[str] = frozenset({"llama"})

# HF rope_type -> GGUF rope.scaling.type; "default" writes no scaling keys.
_ROPE_TYPES = {"linear": "linear", "yarn": "yarn"}
# HF rope_parameters key -> GGUF rope.scaling.<suffix>
_ROPE_KEYS = {"factor": "factor", "original_max_position_embeddings": "original_context_length",
              "attention_factor": "attn_factor", "beta_fast": "yarn_beta_fast",
              "beta_slow": "yarn_beta_slow"}


def hf_model_type(gguf_arch: str, path: Path | None = None) -> str:
    """The transformers model_type for a GGUF architecture, or one ModelError line."""
    if gguf_arch not in GGUF_TO_HF_TYPE:
        raise ModelError(problem=f"GGUF architecture {gguf_arch!r} is not supported for "
                                 "conversion", path=path,
                         hint=f"supported: {', '.join(sorted(GGUF_TO_HF_TYPE))}")
    return GGUF_TO_HF_TYPE[gguf_arch]


def gguf_arch(model_type: str, path: Path | None = None) -> str:
    """The GGUF architecture for a transformers model_type, or one ModelError line."""
    if model_type not in HF_TO_GGUF_ARCH:
        raise ModelError(problem=f"model_type {model_type!r} cannot be written as GGUF",
                         path=path, hint=f"supported: {', '.join(sorted(HF_TO_GGUF_ARCH))}")
    return HF_TO_GGUF_ARCH[model_type]


def _name_map(arch: str, n_layers: int) -> Any:
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    key = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    return get_tensor_name_map(key, n_layers)


class NameTable:
    """HF <-> GGUF tensor names of one model (architecture and layer count)."""

    def __init__(self, arch: str, n_layers: int, hf_names: list[str],
                 tied: bool = False) -> None:
        self.arch = arch
        self.tied = tied  # the output head is the embedding: no output.weight
        self._map = _name_map(arch, n_layers)
        self.to_gguf: dict[str, str] = {}
        for hf in hf_names:
            name = self.gguf_name(hf)
            if name is not None:
                self.to_gguf[hf] = name
        self.to_hf: dict[str, str] = {g: h for h, g in self.to_gguf.items()}

    def gguf_name(self, hf_name: str) -> str | None:
        """The GGUF name of an HF tensor, None when gguf-py knows no such tensor."""
        return self._map.get_name(hf_name, try_suffixes=(".weight", ".bias"))

    @classmethod
    def for_config(cls, config: Any) -> NameTable:
        """The table of a transformers config: HF names from the class's own state dict."""
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        names = list(model.state_dict().keys())
        arch = gguf_arch(config.model_type)
        return cls(arch, config.num_hidden_layers, names,
                   tied=bool(getattr(config, "tie_word_embeddings", False)))


def permute_qk(w: np.ndarray, n_head: int, n_kv_head: int | None = None) -> np.ndarray:
    """HF q/k rows -> llama.cpp's interleaved rope layout (its convert_hf_to_gguf permute).
    Written here because gguf-py does not ship it and transformers only has the inverse."""
    if n_kv_head is not None and n_head != n_kv_head:
        n_head = n_kv_head
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def unpermute_qk(w: np.ndarray, n_head: int, n_kv_head: int | None = None) -> np.ndarray:
    """The inverse of permute_qk: transformers' LlamaTensorProcessor, reused as is."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    return LlamaTensorProcessor()._reverse_permute_weights(w, n_head, n_kv_head)


def qk_heads(gguf_name: str, n_head: int, n_kv_head: int) -> tuple[int, int] | None:
    """(n_head, n_kv_head) to permute this tensor with, None when it is not a q/k weight."""
    if ".attn_q." in gguf_name:
        return n_head, n_head
    if ".attn_k." in gguf_name:
        return n_head, n_kv_head
    return None


def rope_to_gguf(rope: dict[str, Any], path: Path | None = None) -> dict[str, Any]:
    """HF rope_parameters -> GGUF `rope.scaling.*` suffixes and values (empty for default
    rope). Types llama.cpp stores otherwise (llama3's rope_freqs tensor, longrope factor
    lists) are refused rather than written wrong."""
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return {}
    if kind not in _ROPE_TYPES:
        raise ModelError(problem=f"rope_type {kind!r} is not written to GGUF yet", path=path,
                         hint=f"supported rope types: default, {', '.join(_ROPE_TYPES)}")
    out: dict[str, Any] = {"type": _ROPE_TYPES[kind]}
    for hf_key, suffix in _ROPE_KEYS.items():
        if rope.get(hf_key) is not None:
            out[suffix] = rope[hf_key]
    return out


def rope_from_gguf(fields: dict[str, Any], arch: str) -> dict[str, Any]:
    """GGUF metadata -> the HF rope_parameters entries beyond rope_theta (empty when the file
    has no scaling). transformers' GGUF config mapping drops these keys for llama/qwen."""
    prefix = f"{arch}.rope.scaling."
    kind = fields.get(prefix + "type")
    if kind in (None, "none"):
        return {}
    if kind not in _ROPE_TYPES.values():
        raise ModelError(problem=f"GGUF rope scaling type {kind!r} is not supported",
                         hint=f"supported: none, {', '.join(_ROPE_TYPES.values())}")
    out: dict[str, Any] = {"rope_type": next(k for k, v in _ROPE_TYPES.items() if v == kind)}
    for hf_key, suffix in _ROPE_KEYS.items():
        if prefix + suffix in fields:
            value = fields[prefix + suffix]
            out[hf_key] = int(value) if suffix == "original_context_length" else float(value)
    return out


def tensor_check(source: str, target: str, ref: Any, out: Any) -> TensorCheck:
    """Max-abs difference and cosine of two torch tensors of one shape: float32 products
    summed in float64 (a float32 dot drifts by 1e-4 on 10^6 values; full float64 copies
    cost seconds per tensor on CPU)."""
    import torch

    a = ref.reshape(-1).float()
    b = out.reshape(-1).float()
    if a.numel() == 0:
        return TensorCheck(source=source, target=target, max_abs=0.0, cosine=1.0)
    max_abs = float((a - b).abs().max())
    dot = float((a * b).sum(dtype=torch.float64))
    na = float((a * a).sum(dtype=torch.float64)) ** 0.5
    nb = float((b * b).sum(dtype=torch.float64)) ** 0.5
    cosine = (1.0 if na == nb else 0.0) if na == 0.0 or nb == 0.0 else dot / (na * nb)
    return TensorCheck(source=source, target=target, max_abs=max_abs, cosine=cosine)


class GgufTensor(NamedTuple):
    """One tensor of a GGUF file: `shape` in torch order (slowest dimension first), `data`
    its raw bytes as a read-only view of the file's memory map (nothing read yet)."""

    name: str
    shape: tuple[int, ...]
    qtype: Any  # gguf.GGMLQuantizationType
    data: np.ndarray


class GgufFile(NamedTuple):
    """A GGUF file's metadata (plain values; the vocabulary and merges as lists) and its
    tensors. Parsed here rather than with gguf.GGUFReader, which builds an object per array
    element: ~6 s on a 49k vocabulary, for metadata this reads in a fraction of a second."""

    path: Path
    metadata: dict[str, Any]
    tensors: list[GgufTensor]

    @property
    def arch(self) -> str:
        return str(self.metadata["general.architecture"])


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}


def read_gguf(path: Path) -> GgufFile:
    """Parse `path` (GGUF v2/v3, little-endian), or raise one ModelError line."""
    try:
        return _parse(path)
    except (OSError, ValueError, KeyError, struct.error) as e:
        raise ModelError(problem=f"cannot be read as GGUF ({e})", path=path,
                         hint="check that the file is a complete GGUF v2/v3 file") from e


def _parse(path: Path) -> GgufFile:
    import gguf

    blob = np.memmap(path, mode="r", dtype=np.uint8)
    buf = memoryview(blob)  # type: ignore[arg-type]
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("no GGUF magic bytes")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}")
    pos = 24

    def string(pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, pos)
        return bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8"), pos + 8 + n

    def value(kind: int, pos: int) -> tuple[Any, int]:
        if kind in _SCALARS:
            fmt = _SCALARS[kind]
            return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
        if kind == 8:
            return string(pos)
        if kind == 9:
            sub, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if sub in _SCALARS:
                fmt = _SCALARS[sub]
                width = struct.calcsize(fmt)
                return list(struct.unpack_from(f"<{count}{fmt[1]}", buf, pos)), pos + count * width
            items = []
            for _ in range(count):
                item, pos = value(sub, pos)
                items.append(item)
            return items, pos
        raise ValueError(f"metadata value type {kind}")

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        metadata[key], pos = value(kind, pos + 4)
    if "general.architecture" not in metadata:
        raise ValueError("no general.architecture")
    table = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        qtype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        table.append((name, tuple(int(d) for d in reversed(dims)), qtype, offset))
    align = int(metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
    start = (pos + align - 1) // align * align
    tensors = []
    for name, shape, qtype, offset in table:
        kind = gguf.GGMLQuantizationType(qtype)
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        row_bytes = shape[-1] // block * block_bytes
        data = blob[start + offset:start + offset + rows * row_bytes].reshape(rows, row_bytes)
        tensors.append(GgufTensor(name, shape, kind, data))
    return GgufFile(path, metadata, tensors)


def dequantize(t: GgufTensor) -> np.ndarray:
    """The tensor's values as float32 in its torch shape (gguf-py's dequantizers)."""
    import gguf

    return np.asarray(gguf.quants.dequantize(t.data, t.qtype), dtype=np.float32).reshape(t.shape)
