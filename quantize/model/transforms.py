"""A rotated checkpoint's online transforms (compressed-tensors' transform_config, written by
llm-compressor's QuIPModifier): attached to a model loaded with the stored, already-rotated
weights, so that it computes what the quantized model computed; and the stored weights turned
back into the source model's basis, for comparing them with the source."""

from __future__ import annotations

from typing import Any

from quantize.model.qconfig import ONLINE


def apply_online_transforms(model: Any, quantization_config: dict[str, Any] | None) -> int:
    """The checkpoint's online transforms (a rotated export's Hadamard on each Linear's input)
    attached to `model`, whose weights are the stored, already-rotated ones; returns how many
    schemes were applied. transformers loads such a checkpoint without them (compressed-tensors
    only serialises the transform_config), which computes another model. Only the online
    locations are applied: the weight-side ones are in the stored weights already."""
    from compressed_tensors.transform import TransformConfig, apply_transform_config

    raw = (quantization_config or {}).get("transform_config")
    if not raw:
        return 0
    config = TransformConfig.model_validate(raw)
    for scheme in config.config_groups.values():
        scheme.apply = [a for a in scheme.apply if a.location in ONLINE]
    config.config_groups = {k: v for k, v in config.config_groups.items() if v.apply}
    if config.config_groups:
        apply_transform_config(model, config)
    return len(config.config_groups)


def unrotated(model: Any, decoded: dict[str, Any]) -> dict[str, Any]:
    """Each decoded weight in the source model's basis: a layer whose input is transformed
    online (x -> x M) stores W M^-T, so W = stored M^T; layers without transforms as they are.
    For comparing a rotated export's weights with its source (verify's resemblance check)."""
    import torch
    from compressed_tensors.transform import TransformBase

    out = dict(decoded)
    modules = dict(model.named_modules())
    for name, w in decoded.items():
        for child in modules[name].children():
            if isinstance(child, TransformBase) and child.args.location == "input":
                eye = torch.eye(w.shape[1], dtype=w.dtype)
                out[name] = out[name] @ child(eye).T.to(w.dtype)
    return out
