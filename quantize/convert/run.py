"""The convert runner: detect the source, pick the converter for (source, target) from one
table, check disk and memory before any work, convert into a work folder that survives a
crash, prove what was kept (quantize.convert.preserve, quantize.convert.roundtrip), write the
report, and only then rename the work folder into place. A loss is a non-zero exit with the
report left in the work folder."""

from __future__ import annotations

import importlib
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantize.convert.produced import Produced
from quantize.convert.report import ConvertReport, write_report
from quantize.errors import DiskError, ExportError, ModelError
from quantize.model.formats import DENSE, DENSE_DTYPE, QUANTIZED_HF, Detected, Format, detect
from quantize.progress import step
from quantize.run.files import free_bytes

_HF_SOURCES = (*DENSE, *QUANTIZED_HF)
# (source, target) -> "module:function"; imported only when used
# the 16-bit dense targets every source converts to (hf-fp32 stays a source only)
_DENSE_TARGETS = (Format.HF_BF16, Format.HF_FP16)
_TO_DENSE = {Format.GGUF: "quantize.convert.gguf_in:gguf_to_hf",
             Format.FP8_BLOCK: "quantize.convert.run:_fp8_dense",
             Format.COMPRESSED_TENSORS: "quantize.convert.run:_ct_dense",
             Format.GPTQ: "quantize.convert.run:_native_dense",
             Format.AWQ: "quantize.convert.run:_native_dense"}
REGISTRY: dict[tuple[Format, Format], str] = {
    **{(s, t): fn for s, fn in _TO_DENSE.items() for t in _DENSE_TARGETS},
    (Format.GPTQ, Format.COMPRESSED_TENSORS): "quantize.convert.run:_native_ct",
    (Format.AWQ, Format.COMPRESSED_TENSORS): "quantize.convert.run:_native_ct",
    **{(s, Format.GGUF): "quantize.convert.run:_to_gguf" for s in _HF_SOURCES},
}
WORK_SUFFIX = ".convert-partial"


@dataclass(frozen=True)
class Options:
    dtype: str = "bfloat16"  # dense outputs
    gguf_type: str = "q8_0"  # GGUF outputs (quantize.convert.gguf_out.OUT_TYPES)
    force: bool = False
    smoke: bool = True  # the logits test (loads both models)
    max_shard_bytes: int = 4 << 30
    on_shard: Callable[[int], None] | None = None  # test hook: after each output shard


def work_dir(out: Path) -> Path:
    return out.parent / f".{out.name}{WORK_SUFFIX}"


def supported_pairs() -> str:
    return ", ".join(sorted({f"{s.value}->{t.value}" for s, t in REGISTRY}))


def _dense_target(target: Format, options: Options) -> Options:
    if target in DENSE_DTYPE and DENSE_DTYPE[target] != options.dtype:
        return Options(**{**options.__dict__, "dtype": DENSE_DTYPE[target]})
    return options


def _fp8_dense(d: Detected, work: Path, o: Options) -> Produced:
    from quantize.convert.fp8_block import Fp8BlockToDense
    from quantize.convert.stream import convert_folder

    return convert_folder(d, Fp8BlockToDense(d, o.dtype), work, options={"dtype": o.dtype},
                          max_shard_bytes=o.max_shard_bytes, on_shard=o.on_shard)


def _ct_dense(d: Detected, work: Path, o: Options) -> Produced:
    from quantize.convert.ct_bf16 import CompressedToDense
    from quantize.convert.stream import convert_folder

    return convert_folder(d, CompressedToDense(d, o.dtype), work, options={"dtype": o.dtype},
                          max_shard_bytes=o.max_shard_bytes, on_shard=o.on_shard)


def _native_ct(d: Detected, work: Path, o: Options) -> Produced:
    from quantize.convert.gptq_awq import make
    from quantize.convert.stream import convert_folder

    return convert_folder(d, make(d), work, max_shard_bytes=o.max_shard_bytes,
                          on_shard=o.on_shard)


def _native_dense(d: Detected, work: Path, o: Options) -> Produced:
    from quantize.convert.gptq_awq import NativeToDense
    from quantize.convert.stream import convert_folder

    return convert_folder(d, NativeToDense(d, o.dtype), work, options={"dtype": o.dtype},
                          max_shard_bytes=o.max_shard_bytes, on_shard=o.on_shard)


def _to_gguf(d: Detected, work: Path, o: Options) -> Produced:
    from quantize.convert.dense_iter import dense_tensors

    fn = _import("quantize.convert.gguf_out:hf_to_gguf", d, Format.GGUF)
    tensors = None if d.format in DENSE else dense_tensors(d)
    work.mkdir(parents=True, exist_ok=True)
    produced: Produced = fn(d.path, work, o.gguf_type.lower(), tensors=tensors)
    return produced


def _import(spec: str, d: Detected, target: Format) -> Any:
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise ModelError(problem=f"converting {d.describe()} to {target.value} is not built "
                         f"yet ({module} is missing)", path=d.path,
                         hint=f"supported now: {supported_pairs()}") from None


def _estimate_out(d: Detected, target: Format, o: Options) -> int:
    """Bytes the output needs: dense outputs hold every weight at the target width, other
    outputs are taken as no larger than the source dequantized to 16 bits."""
    # a packed int32 word holds eight 4-bit weights
    elems = sum(_elems(t.shape) * (8 if t.name.endswith((".qweight", ".weight_packed")) else 1)
                for t in d.tensors.values())
    if not elems:
        return 2 * d.total_bytes
    width = {"float32": 4}.get(o.dtype, 2) if target in DENSE else 2
    return elems * width


def _elems(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _largest_group(d: Detected) -> int:
    """The largest weight with its side tensors: what the streaming loop holds at once."""
    if not d.tensors:
        return d.largest_tensor_bytes or d.total_bytes
    by_module: dict[str, int] = {}
    for t in d.tensors.values():
        module = t.name.rpartition(".")[0]
        by_module[module] = by_module.get(module, 0) + t.nbytes
    return max(by_module.values())


def _partial_fp8_blocks(d: Detected) -> str | None:
    """The first FP8-block weight with a partial edge block, or None."""
    if d.format is not Format.FP8_BLOCK:
        return None
    from quantize.convert.fp8_block import block_size

    bh, bw = block_size(d)
    for name, t in d.tensors.items():
        if name.endswith(".weight") and t.dtype.startswith("F8") and len(t.shape) == 2 and \
                (t.shape[0] % bh or t.shape[1] % bw):
            return f"{name} {list(t.shape)}"
    return None


def peak_rss() -> int:
    """This process's peak resident memory in bytes (VmHWM)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _output_facts_path(target: Format, work: Path, produced: Produced) -> Path:
    if target is Format.GGUF:
        ggufs = [f for f in produced.files if f.endswith(".gguf")]
        return work / ggufs[0] if ggufs else work
    return work


def convert(src: Path, to: str, out: Path, options: Options | None = None) -> ConvertReport:
    """Convert `src` to format `to` into folder `out` (see the module docstring)."""
    from quantize.convert import preserve, roundtrip

    options = options or Options()
    t0 = time.perf_counter()
    try:
        target = Format(to)
    except ValueError:
        raise ModelError(problem=f"unknown target format {to!r}",
                         hint="--to takes one of: " + ", ".join(
                             sorted({t.value for _, t in REGISTRY}))) from None
    with step(f"detecting the format of {src}"):
        detected = detect(src)
    pair = (detected.format, target)
    if pair not in REGISTRY:
        raise ModelError(problem=f"format found: {detected.describe()}; converting it to "
                         f"{target.value} is not supported", path=src,
                         hint=f"supported: {supported_pairs()}")
    options = _dense_target(target, options)
    out = Path(out)
    if out.exists() and not options.force:
        raise ExportError(problem="already exists", path=out, path_sep=" ",
                          hint="pass --force to replace it, or another --out")
    need = _estimate_out(detected, target, options)
    free = free_bytes(out.parent)
    if free < need:
        raise DiskError(problem=f"needs about {need / 1e9:.1f} GB for the output, "
                        f"{free / 1e9:.1f} GB free", path=out.parent,
                        hint="free space or choose another --out")
    work = work_dir(out)
    fn = _import(REGISTRY[pair], detected, target)
    with step(f"converting {detected.describe()} -> {target.value}"):
        if fn.__module__ == __name__:
            produced = fn(detected, work, options)
        else:  # helper entries: gguf_to_hf(src, work, dtype)
            work.mkdir(parents=True, exist_ok=True)
            produced = fn(detected.path, work, options.dtype)
    facts_out = _output_facts_path(target, work, produced)
    with step("checking what the conversion preserved"):
        rows = preserve.compare(preserve.facts_of(detected.path), preserve.facts_of(facts_out),
                                produced, detected.path, facts_out)
    smoke = roundtrip.Smoke(skipped="disabled (--no-smoke)")
    partial = _partial_fp8_blocks(detected)
    if options.smoke and partial:
        smoke = roundtrip.Smoke(skipped=f"transformers' FP8 loader needs whole blocks and "
                                f"{partial} is not a multiple of the block")
    elif options.smoke and target is not Format.GGUF:
        with step("logits smoke test: source vs output in transformers"):
            smoke = roundtrip.logits_smoke(detected.path, work)
    elif target is Format.GGUF:
        smoke = roundtrip.Smoke(skipped="GGUF outputs are proven by the GGUF writer's own "
                                "checks (quantize.convert.gguf_out)")
    report = ConvertReport(str(src), detected.describe(), target.value, str(out),
                           roundtrip.summarise(produced.checks), smoke, rows,
                           dict(produced.dropped), list(produced.notes),
                           time.perf_counter() - t0, peak_rss(), _largest_group(detected))
    write_report(work, report)
    bad = preserve.lost(rows)
    if bad:
        raise ExportError(problem="the conversion lost " + "; ".join(
            f"{r.check} ({r.detail})" for r in bad), path=work / "convert_report.md",
            path_sep=": ", hint="the output is kept in this folder for inspection; report "
                                "the source format if this is a converter bug")
    _promote(work, out)
    report.output = str(out)
    return report


def _promote(work: Path, out: Path) -> None:
    """The finished work folder becomes `out` by one rename (an old `out` moves aside first
    and is removed after)."""
    from quantize.convert.stream import finished
    from quantize.run.files import replace_dir

    finished(work)
    replace_dir(work, out)
