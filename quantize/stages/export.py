"""export: the vLLM-loadable checkpoint folder, complete or absent.

It holds the engine's files: weights hard-linked from the quantize stage (copied where the
two folders are on different file systems), the small files copied, the recipe as run
(`recipe.yaml`) and `manifest.json` (model source and hash, recipe hash, calibration
fingerprint, versions, stage timings, sha256 of every other file).

Links, not copies: copying an 8B checkpoint cost 1.8-4.1 s a run on an H200 host
(bench/RESULTS.md). A user who edits a weight file of the export in place also changes the
quantize stage's file; the next run notices (stage outputs are hash-checked before reuse) and
quantizes again instead of reusing it. An edited config.json only rebuilds the export.
"""

from __future__ import annotations

from pathlib import Path

from quantize.errors import ExportError
from quantize.model.config import CONFIG, ModelConfig, read_config
from quantize.model.qconfig import read_quant_config, require_quant_config
from quantize.run.files import (
    atomic_write_json,
    atomic_write_text,
    copy_hashed,
    hash_tree,
    link_or_copy,
    pause_point,
)
from quantize.run.manifest import ExportManifest
from quantize.run.results import ExportSummary

NAME = "export"
REQUIRED = (CONFIG, "tokenizer_config.json")


def check_checkpoint(folder: Path) -> ModelConfig:
    """What vLLM needs to load with no flags: config with a quantization block, safetensors."""
    missing = [f for f in REQUIRED if not (folder / f).is_file()]
    if missing:
        raise ExportError(path=folder, path_sep=" ",
                          problem=f"lacks {missing} (the engine did not finish saving)")
    if not list(folder.glob("*.safetensors")):
        raise ExportError(path=folder, path_sep=" ", problem="has no *.safetensors weights")
    pickles = [p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
    if pickles:
        raise ExportError(path=folder, path_sep=" ",
                          problem=f"holds pickle files {pickles}, but exports are safetensors "
                                  "only")
    config = read_config(folder)
    require_quant_config(config, folder, "vLLM would load it as an unquantized model")
    return config


def run(quantized: Path, recipe_text: str, manifest: ExportManifest, out: Path
        ) -> ExportSummary:
    """The export folder; `manifest`: its manifest.json without `files` (added here)."""
    qc = read_quant_config(check_checkpoint(quantized))
    assert qc is not None  # check_checkpoint refused a checkpoint without one
    sources = [f for f in sorted(quantized.iterdir()) if f.is_file()]
    for i, f in enumerate(sources):
        if i == len(sources) // 2:
            pause_point("export:half")  # tests kill the run halfway through the copy
        if f.suffix == ".safetensors":
            link_or_copy(f, out / f.name)
        else:  # small files users do edit (config.json): a copy keeps the stage's own intact
            copy_hashed(f, out / f.name)
    atomic_write_text(out / "recipe.yaml", recipe_text)
    files = hash_tree(out)
    manifest = manifest.model_copy(update={"files": files})
    atomic_write_json(out / "manifest.json", manifest.model_dump(mode="json", exclude_unset=True))
    weights = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    return ExportSummary(weights_bytes=weights, quant_method=qc.method, format=qc.format)
