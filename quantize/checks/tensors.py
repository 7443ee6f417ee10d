"""Pre-flight of the weights against config.json, from the safetensors headers alone (no
tensor is read): every tensor the architecture needs is stored, none is left over, each has
the shape config.json gives it and a dtype the model can load.

Why before calibration: transformers initialises a missing weight at random and drops an
unexpected one with a log line, so a checkpoint missing a tensor quantized "fine" into a
broken export (exit 0); a shape that config.json contradicts failed only when the engine
loaded the model, after calibration, as an internal error.

The checkpoint's names are read in the model's terms as transformers' loader reads them
(its conversion mapping: renamings such as `LayerNorm.gamma`, a missing or extra base-model
prefix); a key that one of its WeightConverters fuses (per-expert MoE tensors into one 3-D
tensor) is checked by name only.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from quantize.errors import PreflightError
from quantize.model.config import ModelConfig
from quantize.model.source import safetensors_header, weight_files

_FLOAT = ("F16", "BF16", "F32", "F64")
_SIXTEEN = {"float16": "F16", "bfloat16": "BF16"}
_SHOWN = 3  # names quoted in one line


def check_weights(folder: Path, model: Any, config: ModelConfig) -> None:
    """Refuse (PreflightError naming the tensor and its file) a missing, unexpected,
    mis-shaped or mis-typed tensor. `model`: the meta-device model of `config`. A checkpoint
    that is already quantized (config.json has a quantization_config) stores other tensors
    than the dense model and is left to its engine; so is one without safetensors."""
    files = weight_files(folder)
    if not files or config.quantization_config:
        return
    stored: dict[str, tuple[str, dict[str, Any]]] = {}  # checkpoint key -> (file, info)
    for f in files:
        for key, info in safetensors_header(f).items():
            stored[key] = (f.name, info)
    if not stored:
        raise PreflightError(path=files[0], path_sep=" ", problem="holds no tensors",
                             hint="re-download or re-export the weights")
    expected = {k: v for k, v in model.state_dict().items()}
    present: set[str] = set()
    unexpected: list[tuple[str, str]] = []  # (checkpoint key, the model's name for it)
    rename = _renamer(model, expected)
    parts: dict[tuple[str, str], int] = {}  # (fused target, source pattern) -> keys stored
    for key in sorted(stored):
        name, fused, pattern = rename(key)
        if fused is not None:  # fused by a WeightConverter: its parts are not the target
            present.update(fused)
            parts[name, pattern or ""] = parts.get((name, pattern or ""), 0) + 1
            continue
        if name not in expected:
            unexpected.append((key, name))
            continue
        present.add(name)
        _check_tensor(key, stored[key], expected[name], config, folder)
    _check_stacked(parts, expected, folder)
    missing = [k for k in expected if k not in present and not _may_be_missing(model, k, present)]
    if missing:
        raise PreflightError(
            path=folder, path_sep=" ",
            problem=f"stores no tensor {_names(missing)}, which config.json's architecture "
                    "needs (transformers would initialise it at random)",
            hint="download every weight file, or fix config.json to match the weights")
    computed = _computed_buffers(model, expected)
    roots = {k.partition(".")[0] for k in expected}
    extra = [k for k, name in unexpected if not _may_be_extra(model, name, computed, roots)]
    if extra:
        where = stored[extra[0]][0]
        raise PreflightError(
            path=folder / where, path_sep=" ",
            problem=f"stores {_names(extra)}, which config.json's architecture has no place "
                    "for (transformers would drop it)",
            hint="use the config.json that came with these weights")


def _names(keys: list[str]) -> str:
    more = f" (and {len(keys) - _SHOWN} more)" if len(keys) > _SHOWN else ""
    return ", ".join(keys[:_SHOWN]) + more


def _check_tensor(key: str, stored: tuple[str, dict[str, Any]], meta: Any,
                  config: ModelConfig, folder: Path) -> None:
    file, info = stored
    shape, dtype = list(info["shape"]), str(info["dtype"])
    want = list(meta.shape)
    if shape != want:
        raise PreflightError(
            path=folder / file, path_sep=": ",
            problem=f"{key} has shape {shape} but config.json makes it {want}",
            hint="the weights and config.json are of different models: use the config.json "
                 "that came with these weights")
    if not meta.is_floating_point():
        return  # an integer buffer: its dtype is the model's business
    declared = config.declared_dtype
    if dtype not in _FLOAT:
        raise PreflightError(
            path=folder / file, path_sep=": ",
            problem=f"{key} is stored as {dtype}, but a weight of this model is floating point "
                    f"(config.json declares {declared or 'no dtype'})",
            hint="re-export the weights in the dtype config.json declares")
    sixteen = _SIXTEEN.get(declared or "")
    if sixteen and dtype in _SIXTEEN.values() and dtype != sixteen:
        raise PreflightError(
            path=folder / file, path_sep=": ",
            problem=f"{key} is stored as {dtype}, but config.json declares {declared} "
                    f"(loading it as {declared} would change its values)",
            hint="set config.json's dtype to what the weights are, or re-export them")


def _renamer(model: Any, expected: dict[str, Any]) -> Any:
    """checkpoint key -> (the model's name, None), or (the name, the keys it fuses into) for
    a key a WeightConverter fuses."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        rename_source_key,
    )

    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    splits = any(len(c.target_patterns) > 1 for c in converters)  # one key into several
    prefix = getattr(model, "base_model_prefix", None) or None

    def rename(key: str) -> tuple[str, set[str] | None, str | None]:
        name, source = rename_source_key(key, renamings, converters, prefix, expected)
        if source is None:
            return name, None, None
        # the target, and where a converter splits one key into several, its siblings
        under = name.rsplit(".", 2)[0] if splits else name
        fused = {k for k in expected if k == under or k.startswith(under + ".")} | {name}
        return name, fused, source

    return rename


def _check_stacked(parts: dict[tuple[str, str], int], expected: dict[str, Any],
                   folder: Path) -> None:
    """A converter that stacks one stored tensor per expert (`experts.*.`) into one tensor
    of the experts along its first dimension needs one key per expert."""
    for (name, pattern), count in sorted(parts.items()):
        target = expected.get(name)
        if "*" not in pattern or target is None or target.dim() == 0:
            continue
        if count != target.shape[0]:
            raise PreflightError(
                path=folder, path_sep=" ",
                problem=f"stores {count} tensors matching {pattern!r} for {name}, which "
                        f"config.json makes of {target.shape[0]} (one per expert)",
                hint="download every weight file, or fix config.json to match the weights")


def _may_be_missing(model: Any, key: str, present: set[str]) -> bool:
    """A tied weight whose partner is stored, or a key the model lets its loader skip."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    partner = tied.get(key) or next((t for t, s in tied.items() if s == key), None)
    if partner is not None and partner in present:
        return True
    return any(re.search(p, key) for p in getattr(model, "_keys_to_ignore_on_load_missing",
                                                  None) or ())


def _may_be_extra(model: Any, name: str, computed: set[str], roots: set[str]) -> bool:
    """A key the model lets its loader drop; a buffer the model computes itself (its
    non-persistent buffers, by leaf name: older Llama checkpoints store each layer's
    `self_attn.rotary_emb.inv_freq`, which transformers 5 keeps once, in `model.rotary_emb`);
    or a tower the causal-LM class does not have (`vision_model.`, `multi_modal_projector.`
    of a multimodal checkpoint whose text model is what is quantized: a root no tensor of the
    model has). A stray tensor under the model's own roots (a layer config.json does not
    count) is what is refused."""
    if any(re.search(p, name) for p in getattr(model, "_keys_to_ignore_on_load_unexpected",
                                               None) or ()):
        return True
    return name.rpartition(".")[2] in computed or name.partition(".")[0] not in roots


def _computed_buffers(model: Any, expected: dict[str, Any]) -> set[str]:
    return {n.rpartition(".")[2] for n, _ in model.named_buffers() if n not in expected}
