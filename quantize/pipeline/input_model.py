"""The model a run reads: `--model some.gguf` or an FP8-block folder is converted to bf16
safetensors first, once (quantize.convert), into the cache keyed by the source; it is not a
stage of the run, since the cache entry is shared by runs. A second run with the same source
finds the converted folder and starts at calibration; a converter that crashed resumes.

The embedded default model keeps its own GGUF conversion (quantize.model.source), whose
output the default model's tests pin file by file."""

from __future__ import annotations

import json
from pathlib import Path

from quantize.model.formats import Format, detect
from quantize.model.source import DEFAULT_MODEL, ModelRef, cache_root, resolve_model
from quantize.run.files import sha256_file
from quantize.run.lock import entry_lock

CONVERTED = ("gguf", "fp8-block")  # what the pipeline converts first (Format values)
_MARK = ".converted-from.json"


def _needs_conversion(spec: str | None) -> Path | None:
    if spec is None or spec == DEFAULT_MODEL:
        return None
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and any(path.glob("*.safetensors")) and (path / "config.json").is_file():
        try:
            cfg = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):  # resolve_model names a bad config.json in one line
            return None
        qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
        if isinstance(qc, dict) and qc.get("quant_method") == "fp8":
            return path
    if path.is_dir() and not any(path.glob("*.safetensors")) and \
            len(list(path.glob("*.gguf"))) == 1:
        return path
    return None


def source_key(path: Path) -> str:
    """The cache key: a GGUF file's sha256; for a safetensors folder, the sha256 of its
    tensor headers and each shard's size and mtime (quantize.convert.stream.fingerprint:
    hashing hundreds of GB of shards would cost minutes on every run)."""
    from quantize.convert.stream import fingerprint

    if path.is_file():
        return sha256_file(path)
    return fingerprint(detect(path))


def converted_model(spec: str | None, *, allow_pickle: bool = False) -> ModelRef | None:
    """The bf16 folder for `spec` when it is a GGUF or FP8-block source (converted on first
    use), else None (the pipeline resolves `spec` as before)."""
    src = _needs_conversion(spec)
    if src is None:
        return None
    from quantize.convert.run import Options, convert

    detected = detect(src)
    if detected.format.value not in CONVERTED:
        return None
    key = source_key(detected.path)
    stem = detected.path.stem if detected.path.is_file() else detected.path.name
    out = cache_root() / "models" / f"{stem}-{key[:16]}-bf16"
    with entry_lock(out.parent / f".{out.name}.lock", what=f"converting {src} into {out}"):
        mark = out / _MARK
        if not (mark.is_file() and json.loads(mark.read_text()).get("key") == key):
            out.parent.mkdir(parents=True, exist_ok=True)
            convert(detected.path, Format.HF_BF16.value, out,
                    Options(force=True, smoke=False))
            mark.write_text(json.dumps({"source": str(src), "key": key,
                                        "format": detected.describe()}))
    ref = resolve_model(str(out), allow_pickle=allow_pickle)
    return ModelRef(ref.source, ref.path, stem)
