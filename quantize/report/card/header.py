"""The card's YAML header: huggingface_hub's ModelCardData, so the Hub links the base model
(`base_model`, `base_model_relation: quantized`), lists the tags and renders the eval results
(`model-index`)."""

from __future__ import annotations

from typing import Any

from huggingface_hub import EvalResult, ModelCardData

from quantize.model.formats import Format
from quantize.report.card.inputs import CardInputs, CardMetric


def _dataset(row: CardMetric) -> tuple[str, str, str | None]:
    """(type, name, config) of the data a metric was measured on, from its recorded settings."""
    task = row.settings.get("task")
    if isinstance(task, str) and task.startswith("bigbench:"):
        sub = task.split(":", 1)[1]
        return "bigbench", f"BIG-bench {sub}", sub
    if isinstance(task, str):
        return task, task, None
    return row.name, row.name, None


def eval_results(inputs: CardInputs) -> list[EvalResult]:
    """The candidate's scores as model-index entries (what the Hub renders)."""
    suite = (inputs.eval or {}).get("suite", "?")
    out = []
    for r in CardMetric.join(inputs.eval, inputs.gate):
        dtype, dname, dconfig = _dataset(r)
        kind = r.unit
        shots = r.settings.get("num_fewshot")
        name = f"{kind} ({shots}-shot)" if kind == "accuracy" and shots is not None else kind
        out.append(EvalResult(
            task_type="text-generation", task_name="Text Generation",
            dataset_type=dtype, dataset_name=dname, dataset_config=dconfig,
            metric_type=kind, metric_name=f"{name}, suite {suite}",
            metric_value=round(r.candidate, 6)))
    return out


def tags(inputs: CardInputs) -> list[str]:
    r, q = inputs.recipe, inputs.quant
    weights = q.groups[0].weights if q and q.groups else None
    bits = f"{weights.type}{weights.num_bits}" if weights else "int"
    fmt = [r.method, r.backend] if inputs.native else [Format.COMPRESSED_TENSORS.value,
                                                       "llmcompressor"]
    out = ["quantized", r.scheme.lower().replace("_", "-"), bits, r.method, "vllm", *fmt,
           "quantize"]
    if r.kv_cache:
        out.append("fp8-kv-cache")
    return list(dict.fromkeys(out))


def card_data(inputs: CardInputs) -> ModelCardData:
    b = inputs.base
    extra: dict[str, Any] = {}
    if b.repo_id:
        extra["base_model_relation"] = "quantized"
    results = eval_results(inputs)
    return ModelCardData(
        # the Hub's "use this model" button: only where this run loaded it in transformers
        base_model=b.repo_id,
        library_name="transformers" if inputs.checked("transformers") else None,
        pipeline_tag="text-generation",
        license=b.license, license_name=b.license_name, license_link=b.license_link,
        tags=tags(inputs), model_name=inputs.repo_id if results else None,
        eval_results=results or None, **extra)
