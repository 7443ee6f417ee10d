"""The one reader and writer of a checkpoint's `quantization_config` (config.json).

Three families reach this project: compressed-tensors (llm-compressor's exports: config
groups of weight / input-activation arguments, an ignore list, an optional
`kv_cache_scheme`), native GPTQ / AWQ (GPTQModel's and AutoAWQ's keys: bits, group_size,
sym / zero_point, checkpoint_format) and block FP8 (`quant_method: fp8`, published
DeepSeek-style checkpoints the planner sizes). `read_quant_config` turns any of them into
one typed `QuantConfig`; verify, eval, export, the planner, the support check and the card
read that, never the raw keys. `with_quant_config` is the one writer (the native engines'
exports), `raw_quant_config` hands the block as written to compressed-tensors' own loader, and
the messages that name the block are built here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from quantize.errors import ModelError
from quantize.model.config import ModelConfig
from quantize.model.formats import KNOWN_QUANT_METHODS, NATIVE_METHODS, Format
from quantize.recipe.schemes import SCHEMES, Scheme, kernel_family

# the method names are format facts (quantize.model.formats); re-exported for the readers here
KNOWN_METHODS = KNOWN_QUANT_METHODS


# --- the block as written (third-party JSON): only the keys read here are typed -----------
class _Written(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    def has(self, key: str) -> bool:
        return key in self.model_fields_set


class ArgsJSON(_Written):
    """compressed-tensors' QuantizationArgs as stored."""

    num_bits: int | None = None
    type: str | None = None
    symmetric: bool | None = None
    strategy: str | None = None
    group_size: int | None = None
    dynamic: bool | str | None = None  # "local": NVFP4's per-group activation scales
    actorder: str | None = None
    block_structure: list[int] | None = None


class GroupJSON(_Written):
    targets: list[str] | None = None
    weights: ArgsJSON | None = None
    input_activations: ArgsJSON | None = None
    format: str | None = None


class NativeMetaJSON(_Written):
    quantizer: list[str] | str | None = None  # GPTQModel's stamps


class TransformApplyJSON(_Written):
    location: str  # weight_input / weight_output (fused into the stored weight), input /
    # output (applied online, at run time, by whoever loads the checkpoint)


class TransformSchemeJSON(_Written):
    type: str  # hadamard, random-hadamard, random-matrix
    apply: list[TransformApplyJSON] = []
    head_dim: int | None = None  # the block size


class TransformsJSON(_Written):
    config_groups: dict[str, TransformSchemeJSON] = {}


ONLINE = ("input", "output")  # the transform locations a loader must apply


class QuantizationJSON(_Written):
    """A checkpoint's quantization_config: compressed-tensors, GPTQModel / AutoAWQ or block
    FP8 keys."""

    quant_method: str | None = None
    format: str | None = None
    version: str | None = None  # compressed-tensors' version; AutoAWQ's kernel (gemm)
    # compressed-tensors
    config_groups: dict[str, GroupJSON] | None = None
    ignore: list[str] | None = None
    kv_cache_scheme: ArgsJSON | None = None
    transform_config: TransformsJSON | None = None  # compressed-tensors' rotations (QuIP)
    # GPTQModel / AutoAWQ
    bits: int | None = None
    w_bit: int | None = None
    group_size: int | None = None
    q_group_size: int | None = None
    sym: bool | None = None
    zero_point: bool | None = None
    desc_act: bool | None = None
    checkpoint_format: str | None = None
    meta: NativeMetaJSON | None = None
    modules_to_not_convert: list[str] | None = None
    # block FP8 (DeepSeek-style)
    weight_block_size: list[int] | None = None
    activation_scheme: str | None = None


@dataclass(frozen=True)
class Args:
    """Quantization arguments of weights or input activations (compressed-tensors names)."""

    num_bits: int
    type: str = "int"  # int | float
    symmetric: bool = True
    strategy: str | None = None  # channel | group | tensor | token | block
    group_size: int | None = None
    dynamic: bool = False
    actorder: str | None = None
    block_structure: tuple[int, ...] | None = None

    @classmethod
    def read(cls, d: ArgsJSON | None) -> Args | None:
        if d is None or not (d.model_fields_set or d.model_extra):
            return None
        block = d.block_structure
        return cls(int(d.num_bits or 0), str(d.type or "int"),
                   bool(d.symmetric) if d.has("symmetric") else True, d.strategy,
                   d.group_size, bool(d.dynamic), d.actorder,
                   tuple(int(x) for x in block) if block else None)

    def where(self) -> str:
        if self.strategy == "tensor_group":
            return f"groups of {self.group_size} under a per-tensor global scale"
        if self.strategy == "group":
            return f"groups of {self.group_size} along the input dimension"
        return {"channel": "per output channel", "tensor": "per tensor", "token": "per token",
                "block": f"blocks of {list(self.block_structure or ())}"}.get(
                    str(self.strategy), str(self.strategy))


@dataclass(frozen=True)
class Group:
    """One config group: the layers it targets and how their weights/activations are held."""

    name: str
    targets: tuple[str, ...]
    weights: Args | None
    activations: Args | None
    format: str | None  # pack-quantized | int-quantized | float-quantized | ...

    @property
    def kernel(self) -> str:
        """The vLLM kernel family (quantize.recipe.schemes.KERNELS) these layers need."""
        w, a = self.weights, self.activations
        if w is None:
            return "dense"
        return kernel_family(w.type, w.num_bits, None if a is None else (a.type, a.num_bits),
                             nv_groups=w.strategy == "tensor_group", block=w.strategy == "block")

    @property
    def scheme(self) -> Scheme | None:
        """The scheme-table entry this group is, when it is one of ours."""
        w, a = self.weights, self.activations
        if w is None:
            return None
        for s in SCHEMES.values():  # the microscaling and block formats, by their kernel
            if (s.fixed_group or s.block) and s.kernel == self.kernel and \
                    (s.fixed_group in (None, w.group_size)):
                return s
        for s in SCHEMES.values():
            if s.fixed_group or s.block:
                continue
            act = "none" if a is None else (
                f"{a.type}{a.num_bits}-{'dynamic' if a.dynamic else 'static'}"
                .replace("float8", "fp8"))
            if (s.weight_bits == w.num_bits and s.weight_type == w.type
                    and s.symmetric == w.symmetric and s.group == (w.strategy == "group")
                    and s.activations == act):
                return s
        return None

    def describe(self) -> str:
        """One sentence from what the checkpoint holds."""
        w, a = self.weights, self.activations
        if w is None:
            return "unquantized"
        kind = "integer" if w.type == "int" else "float"
        sym = "symmetric" if w.symmetric else "asymmetric"
        text = f"{w.num_bits}-bit {kind} weights ({sym}, {w.where()})"
        if a is None:
            return text + ", 16-bit activations"
        akind = "integer" if a.type == "int" else "float"
        how = "dynamic, computed at run time" if a.dynamic else "static, calibrated scales"
        return text + f", {a.num_bits}-bit {akind} activations ({a.where()}, {how})"


@dataclass(frozen=True)
class QuantConfig:
    method: str  # compressed-tensors | gptq | awq | fp8
    groups: tuple[Group, ...]
    ignore: tuple[str, ...] = ()
    kv_cache: Args | None = None
    format: str | None = None
    native_version: str | None = None  # gptq checkpoint_format / awq version
    quantizer: tuple[str, ...] = ()  # meta.quantizer stamps ("gptqmodel:7.6.0", ...)
    version: str | None = None  # the `version` key as written
    # the types of the transforms applied online at run time (("hadamard",) for a rotated
    # export): a loader that does not apply them computes another model
    online_transforms: tuple[str, ...] = ()

    @property
    def native(self) -> bool:
        return self.method in NATIVE_METHODS

    @property
    def kv_cache_fp8(self) -> bool:
        return self.kv_cache is not None and self.kv_cache.type == "float"

    @property
    def weight_bits(self) -> int | None:
        bits = [g.weights.num_bits for g in self.groups if g.weights]
        return min(bits) if bits else None

    @property
    def format_name(self) -> str:
        if self.native:
            return f"native {self.method.upper()} ({self.native_version or self.format})"
        return self.method

    def describe(self) -> list[str]:
        return [g.describe() for g in self.groups]

    @property
    def ct_version(self) -> str | None:
        """The compressed-tensors version stamped in a compressed-tensors config (`version`);
        None for other methods or when absent (the model card shows it)."""
        version = self.version if self.method == Format.COMPRESSED_TENSORS else None
        return str(version) if version else None


def _native(qc: QuantizationJSON) -> QuantConfig:
    """GPTQModel's and AutoAWQ's keys: bits / w_bit, group_size / q_group_size, sym for GPTQ,
    zero_point for AWQ (a zero point = asymmetric)."""
    method = str(qc.quant_method)
    bits = int(qc.bits or qc.w_bit or 0)
    gs = int(qc.group_size or qc.q_group_size or -1)
    if method == "gptq":
        sym = bool(qc.sym) if qc.has("sym") else True
    else:
        sym = not (qc.zero_point if qc.has("zero_point") else True)
    w = Args(bits, "int", sym, "group" if gs > 0 else "channel", gs if gs > 0 else None,
             actorder="static" if qc.desc_act else None)
    version = qc.checkpoint_format or qc.format or qc.version
    stamps = qc.meta.quantizer if qc.meta else None
    stamp = (stamps,) if isinstance(stamps, str) else tuple(str(q) for q in stamps or [])
    return QuantConfig(method, (Group("native", ("Linear",), w, None, None),),
                       tuple(qc.modules_to_not_convert or ()), None,
                       qc.format, str(version) if version else None, stamp, qc.version)


def _fp8_block(qc: QuantizationJSON) -> QuantConfig:
    block = tuple(int(x) for x in (qc.weight_block_size or (128, 128)))
    w = Args(8, "float", True, "block", None, block_structure=block)
    a = Args(8, "float", True, "group", 128, dynamic=qc.activation_scheme == "dynamic")
    return QuantConfig("fp8", (Group("fp8", ("Linear",), w, a, "float-quantized"),),
                       ("lm_head", *(qc.modules_to_not_convert or ())), version=qc.version)


def parse(raw: dict[str, Any]) -> QuantConfig:
    """A quantization_config as written (JSON) as a QuantConfig; ModelError for an unknown
    method or a key of the wrong type."""
    method = raw.get("quant_method")
    if method not in KNOWN_METHODS:
        raise ModelError(problem=method_is(method),
                         hint="this project reads compressed-tensors, native gptq/awq and fp8 "
                              "checkpoints")
    try:
        qc = QuantizationJSON.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise ModelError(problem=f"config.json quantization_config.{where}: {err['msg']}",
                         hint="this project reads compressed-tensors, native gptq/awq and fp8 "
                              "checkpoints") from None
    if method in NATIVE_METHODS:
        return _native(qc)
    if method == "fp8":
        return _fp8_block(qc)
    groups = tuple(
        Group(name, tuple(g.targets or ["Linear"]), Args.read(g.weights),
              Args.read(g.input_activations), g.format or qc.format)
        for name, g in (qc.config_groups or {}).items())
    online = sorted({t.type for t in (qc.transform_config.config_groups.values()
                                      if qc.transform_config else ())
                     if any(a.location in ONLINE for a in t.apply)})
    return QuantConfig(Format.COMPRESSED_TENSORS.value, groups, tuple(qc.ignore or ()),
                       Args.read(qc.kv_cache_scheme), qc.format, version=qc.version,
                       online_transforms=tuple(online))


def read_quant_config(config: ModelConfig) -> QuantConfig | None:
    """The checkpoint's quantization_config, typed; None for an unquantized model."""
    qc = config.quantization_config
    return parse(qc) if qc else None


def require_quant_config(config: ModelConfig, folder: Path, consequence: str) -> QuantConfig:
    """The checkpoint's quantization_config, typed; ModelError naming the config.json in
    `folder` and `consequence` when the config has none."""
    qc = read_quant_config(config)
    if qc is None:
        raise ModelError(path=folder / "config.json", path_sep=" ",
                         problem=f"has no quantization_config, so {consequence}")
    return qc


def quant_method(config: ModelConfig) -> str | None:
    """`quantization_config.quant_method`, or None (without parsing the rest)."""
    method = (config.quantization_config or {}).get("quant_method")
    return str(method) if method is not None else None


def method_is(method: object) -> str:
    """How a message names a checkpoint's quantization method."""
    return f"quantization_config.quant_method is {method!r}"


def raw_quant_config(config: ModelConfig) -> dict[str, Any] | None:
    """The quantization_config as written (third-party JSON), for compressed-tensors' and
    the native engines' own readers."""
    return config.quantization_config


def compress_as_stored(model: Any, config: ModelConfig) -> Any:
    """compressed-tensors' own reading of the checkpoint's quantization_config, applied to
    `model` (built from config, unquantized) and its parameters compressed into the layout the
    checkpoint stores; returns the ModelCompressor that decompresses them again."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    qc = QuantizationConfig.model_validate(config.quantization_config)
    apply_quantization_config(model, qc)
    compressor = ModelCompressor(quantization_config=qc)
    compressor.compress_model(model)
    return compressor


def without_quant_config(config: ModelConfig) -> ModelConfig:
    """The config as the unquantized architecture (the planner's baseline of an export)."""
    return config.without("quantization_config")


def with_quant_config(config: ModelConfig, qc: dict[str, Any], dtype: str) -> ModelConfig:
    """The one writer: `config` as an export declares itself, its weights' dtype (`dtype`, the
    transformers 5 key, replacing an older `torch_dtype`) and the engine's quantization_config
    as the engine wrote it."""
    return config.without("torch_dtype").updated(dtype=dtype, quantization_config=qc)
