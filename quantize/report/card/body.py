"""The values the card's body template (card.md) shows, computed from CardInputs.

Each field of `BodyView` is a template variable; the wording and layout live in the template,
the facts here: what the checkpoint's quantization block says (quantize.model.qconfig), what
the scheme and engine tables say (quantize.recipe), and the run's results (inputs.py views).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from quantize.recipe.consumers import ATTACH_TRANSFORMS
from quantize.recipe.engines import ENGINES
from quantize.recipe.methods import METHODS
from quantize.report.card.inputs import (
    Calibration,
    CardInputs,
    CardMetric,
    GateView,
    Json,
    VerifyView,
    kernel_names,
)
from quantize.report.card.memory import MemoryView, memory

_MAX_IGNORE_SHOWN = 12
_CT_LINK = "[compressed-tensors](https://github.com/neuralmagic/compressed-tensors)"


@dataclass(frozen=True)
class BodyView:
    title: str
    repo_id: str
    run: str
    # intro
    method: str  # GPTQ, AWQ, RTN
    scheme: str
    group_note: str  # ", group size 64" or ""
    base_link: str
    format_link: str
    kv_recipe: bool  # the recipe asked for an FP8 KV cache
    quantize_version: str
    recipe_name: str
    warning: str  # the --force warning ("" when not forced)
    # quantization
    method_cell: str
    groups: list[tuple[str, str]]  # (targets, what the checkpoint holds for them)
    group_size: int | None
    layers: int | None
    ignore: str
    trust_remote_code: bool
    kv_cache: str
    format_cell: str
    calibration: Calibration | None  # None: a data-free recipe
    # evaluation and verification
    metrics: list[CardMetric]
    suite: str
    device: str
    scored_by: str  # vLLM's version, where it ran and its kernels; "" for transformers
    base_dtype_note: str
    gate: GateView | None
    forced: bool
    notes: list[str]
    base_note: str
    verify: VerifyView | None
    # memory and use
    memory: MemoryView
    kv_fp8: bool  # the checkpoint stores an FP8 KV cache (vLLM needs --kv-cache-dtype fp8)
    chat: bool
    speed: list[str]  # the format's measured serving speed (planner.speed), where measured
    hf_needs: str
    consumers: list[Any]  # card/consumers.py ConsumerLine: where this run loaded it
    hf_plain: bool  # plain transformers loads it right (checked): its snippet
    hf_transforms: bool  # transformers + the transform snippet loads it right (checked)
    vllm_checked: bool
    attach_transforms: str  # the snippet lines that attach the online transforms
    # reproduce
    recipe_text: str
    llmc_recipe: bool  # the export carries llmcompressor_recipe.yaml
    model_arg: str
    versions: list[tuple[str, str]]
    extra_files: str

    def template_vars(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def engine(inputs: CardInputs) -> str:
    """The engine that made the checkpoint, with its version where the run recorded it."""
    b = inputs.recipe.backend
    stamps = inputs.quant.quantizer if inputs.quant else ()
    version = inputs.versions.get(b) or next(
        (q.split(":", 1)[1] for q in stamps if q.startswith(f"{b}:")), "?")
    label = ENGINES[b].label if b in ENGINES else b
    return f"{label} {version}"


def _warning(inputs: CardInputs) -> str:
    if not inputs.forced:
        return ""
    if inputs.gate is None:
        return ("**Published with `--force` without a release gate**: the run was not "
                "evaluated and gated, so nothing here shows that quality held up.")
    failed = ", ".join(inputs.gate.get("failures") or []) or "see below"
    return (f"**Published with `--force` although the release gate failed** (blocking: "
            f"{failed}). The scores below fell short of the thresholds set for a release; "
            "check them before using this model.")


def _groups(inputs: CardInputs) -> list[tuple[str, str]]:
    q = inputs.quant
    if q is None:
        return []
    if q.native:
        return [("Linear layers of the decoder", g.describe()) for g in q.groups]
    return [(", ".join(g.targets), g.describe()) for g in q.groups]


def _ignore(inputs: CardInputs) -> str:
    ignore = list((inputs.quant.ignore if inputs.quant else ()) or inputs.recipe.ignore)
    shown = ", ".join(f"`{x}`" for x in ignore[:_MAX_IGNORE_SHOWN])
    more = f" and {len(ignore) - _MAX_IGNORE_SHOWN} more" if len(ignore) > _MAX_IGNORE_SHOWN else ""
    return f"{shown or 'nothing'}{more}"


def _format_cell(inputs: CardInputs) -> str:
    q = inputs.quant
    if q is not None and q.native:
        return f"{q.format_name}, `quant_method: {q.method}`"
    version = (q.ct_version if q else None) or inputs.versions.get("compressed-tensors", "?")
    return f"{(q.format if q else None) or '?'} (compressed-tensors {version})"


def _model_arg(inputs: CardInputs) -> str:
    """What `quantize run --model` takes to start from the same base model."""
    b = inputs.base
    if b.source == "default" or b.source == b.repo_id:
        return b.source
    return b.repo_id or f"<folder of {b.name}>"


def scored_by(ev: Json) -> str:
    """Who scored the eval when it was vLLM: the version, where, the candidate's kernels
    (eval.json `engine`); quality can change with the kernel vLLM picks."""
    engine = ev.get("engine") or {}
    if engine.get("name") != "vllm":
        return ""
    cand = (engine.get("vllm") or {}).get("candidate") or {}
    where = {"cuda": "GPU", "cpu": "CPU"}.get(str(engine.get("device")), "?")
    text = f"vLLM {engine.get('vllm_version') or cand.get('vllm_version') or '?'} on {where}"
    kernels = cand.get("kernels") or {}
    return text + (f" (kernels: {kernel_names(kernels)})" if kernels else "")


def _speed(inputs: CardInputs) -> list[str]:
    """The measured rows of this export's format on the GPUs they were measured on."""
    from quantize.planner.speed import describe, measured, table

    cards = {r.gpu: r.gpu_cc for r in table().rows}
    return [line for gpu, cc in cards.items()
            for line in describe([r for r in measured(inputs.recipe, cc, inputs.group_size, gpu)
                                  if r.gpu == gpu])]


def body_view(inputs: CardInputs) -> BodyView:
    r, b = inputs.recipe, inputs.base
    kv_bits = inputs.kv_cache_bits
    metrics = CardMetric.join(inputs.eval, inputs.gate)
    ev = inputs.eval or {}
    gs = inputs.group_size
    return BodyView(
        title=inputs.repo_id.split("/")[-1], repo_id=inputs.repo_id, run=inputs.run,
        method=METHODS[r.method].label, scheme=r.scheme,
        group_note=f", group size {gs}" if gs else "",
        base_link=(f"[{b.repo_id}](https://huggingface.co/{b.repo_id})" if b.repo_id
                   else f"`{b.name}`"),
        format_link=inputs.quant.format_name if inputs.native and inputs.quant else _CT_LINK,
        kv_recipe=bool(r.kv_cache), quantize_version=inputs.versions.get("quantize", "?"),
        recipe_name=r.name, warning=_warning(inputs),
        method_cell=f"{METHODS[r.method].label} ({engine(inputs)})" + (
            f", SmoothQuant strength {r.smoothquant.strength}" if r.smoothquant else ""),
        groups=_groups(inputs), group_size=gs, layers=inputs.layers, ignore=_ignore(inputs),
        trust_remote_code=r.trust_remote_code,
        kv_cache="FP8 with calibrated scales" if kv_bits == 8 else "not quantized",
        format_cell=_format_cell(inputs),
        calibration=inputs.calibration if r.needs_calibration else None,
        metrics=metrics, suite=str(ev.get("suite", "?")), device=str(ev.get("device", "?")),
        scored_by=scored_by(ev),
        base_dtype_note=f" ({b.dtype})" if b.dtype else "", gate=GateView.read(inputs.gate),
        forced=inputs.forced, notes=[f"{m.name}: {m.note}" for m in metrics if m.note],
        base_note=b.note, verify=VerifyView.read(inputs.verify), memory=memory(inputs),
        kv_fp8=bool(kv_bits), chat=inputs.has_chat_template,
        speed=_speed(inputs),
        hf_needs="gptqmodel optimum" if inputs.native else "compressed-tensors",
        consumers=inputs.consumers, hf_plain=inputs.checked("transformers"),
        hf_transforms=inputs.checked("transformers+transforms"),
        vllm_checked=inputs.checked("vllm"), attach_transforms=ATTACH_TRANSFORMS,
        recipe_text=inputs.recipe_text.rstrip(), llmc_recipe=r.backend == "llmcompressor",
        model_arg=_model_arg(inputs), versions=sorted(inputs.versions.items()),
        extra_files=", ".join(f"`{f}`" for f in inputs.extra_files))
