"""The model card (`README.md`) of a published run, built from the run's own files.

Every number in the card is read from the run folder (export config and manifest, eval.json,
gate.json, verify.json) or from the base model's files; nothing is typed in. The YAML header
is `huggingface_hub`'s ModelCardData, so the Hub links the base model (`base_model`,
`base_model_relation: quantized`) and renders the eval results (`model-index`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from quantize.errors import QuantizeError
from quantize.spec.recipe import Recipe

# Repo-name tags, following the names users know from Red Hat AI / Neural Magic releases.
_SCHEME_TAGS = {
    "W4A16": "W4A16", "W4A16_ASYM": "W4A16-asym", "W3A16": "W3A16", "W2A16": "W2A16",
    "W8A16": "W8A16", "W8A8": "W8A8", "FP8_DYNAMIC": "FP8-dynamic", "FP8": "FP8",
}
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
                "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}
_MAX_IGNORE_SHOWN = 12


@dataclass(frozen=True)
class BaseInfo:
    """What is known about the model the run started from."""

    name: str  # short name, used for the default repo name
    source: str  # what the run was given (`default`, a Hub id, a folder name)
    repo_id: str | None  # Hub id, for `base_model`; None when unknown
    license: str | None = None
    license_name: str | None = None
    license_link: str | None = None
    weights_bytes: int | None = None  # safetensors on disk
    dtype: str | None = None  # torch dtype of the base weights (config.json)
    note: str = ""  # provenance caveat shown under the eval table


@dataclass(frozen=True)
class CardInputs:
    repo_id: str
    run: str
    base: BaseInfo
    recipe: Recipe
    recipe_text: str
    config: dict[str, Any]  # the export's config.json
    calibration: dict[str, Any]  # export manifest `calibration`
    versions: dict[str, str]
    preflight: dict[str, Any]
    weights_bytes: int
    has_chat_template: bool
    eval: dict[str, Any] | None = None
    gate: dict[str, Any] | None = None
    verify: dict[str, Any] | None = None
    forced: bool = False
    force_reason: str = ""
    extra_files: list[str] = field(default_factory=list)  # provenance files in the repo


# --- small facts ---------------------------------------------------------------------------
def scheme_tag(scheme: str, kv_cache: str | None) -> str:
    """`W4A16`, `FP8-dynamic`, ...; an FP8 KV cache gives `FP8-KV` (or `<tag>-FP8-KV`)."""
    tag = _SCHEME_TAGS[scheme]
    if kv_cache == "fp8":
        return "FP8-KV" if scheme in ("FP8", "FP8_DYNAMIC") else f"{tag}-FP8-KV"
    return tag


def default_repo_name(base_name: str, recipe: Recipe) -> str:
    return f"{base_name}-{scheme_tag(recipe.scheme, recipe.kv_cache)}"


def dtype_bytes(name: str | None) -> int | None:
    return _DTYPE_BYTES.get(str(name).removeprefix("torch.")) if name else None


def config_dtype(config: dict[str, Any]) -> str | None:
    value = config.get("dtype") or config.get("torch_dtype")
    return str(value).removeprefix("torch.") if value else None


def kv_dims(config: dict[str, Any]) -> tuple[int, int, int] | None:
    """(layers, KV heads, head dim) from a config; None if it lacks the sizes."""
    text = config.get("text_config") or config
    try:
        layers = int(text["num_hidden_layers"])
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError):
        return None
    return layers, kv_heads, head_dim


def _plan_kv(config: dict[str, Any], element_bytes: int) -> tuple[int, str] | None:
    """KV bytes per token from `quantize plan`'s model shape, which also knows MLA latents
    and multimodal text configs; None when the planner is absent or cannot read the config."""
    try:
        from quantize.planner import plan
    except ImportError:
        return None
    try:
        from transformers import AutoConfig

        fields = {k: v for k, v in config.items() if k != "quantization_config"}
        hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        shape = plan.model_shape(config, hf_config)
        return (int(plan.kv_bytes_per_token(shape, 1, element_bytes)),
                str(plan.kv_description(shape, 1, f"{element_bytes} bytes per element")))
    except (QuantizeError, AttributeError, TypeError, ValueError, KeyError):
        return None  # e.g. a config transformers cannot build: fall back to its sizes


def kv_per_token(config: dict[str, Any], element_bytes: int) -> tuple[int | None, str]:
    """(bytes, how they were counted) of the KV cache per token, all layers, one GPU."""
    planned = _plan_kv(config, element_bytes)
    if planned is not None:
        return planned
    dims = kv_dims(config)
    if dims is None:
        return None, "not computable from config.json"
    layers, kv_heads, head_dim = dims
    return (2 * layers * kv_heads * head_dim * element_bytes,
            f"2 (K, V) x {layers} layers x {kv_heads} KV heads x head_dim {head_dim} x "
            f"{element_bytes} bytes per element")


def kv_bytes_per_token(config: dict[str, Any], element_bytes: int) -> int | None:
    """2 (K and V) × layers × KV heads × head dim × bytes per element (the latent size for
    MLA); None if the config lacks the sizes."""
    return kv_per_token(config, element_bytes)[0]


def kv_cache_bits(config: dict[str, Any]) -> int | None:
    """Bits per KV-cache element stored in the checkpoint's kv_cache_scheme (None: not set)."""
    scheme = (config.get("quantization_config") or {}).get("kv_cache_scheme")
    return int(scheme["num_bits"]) if scheme and scheme.get("num_bits") else None


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _hub_link(repo_id: str) -> str:
    return f"[{repo_id}](https://huggingface.co/{repo_id})"


# --- eval values ---------------------------------------------------------------------------
def _is_accuracy(row: dict[str, Any]) -> bool:
    return row.get("kind") == "multiple_choice" or (
        row.get("kind") is None and row.get("direction") == "higher_is_better")


def _value(row: dict[str, Any], v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.1%}" if _is_accuracy(row) else f"{v:.4g}"


def _stderr(row: dict[str, Any], se: float | None) -> str:
    if not se:
        return ""
    return f" ± {se * 100:.1f}" if _is_accuracy(row) else f" ± {se:.2g}"


def metric_rows(inputs: CardInputs) -> list[dict[str, Any]]:
    """eval.json rows joined with the gate's verdicts (the gate's thresholds win)."""
    rows: list[dict[str, Any]] = [dict(r) for r in (inputs.eval or {}).get("metrics", [])]
    verdicts = {r["name"]: r for r in (inputs.gate or {}).get("rows", [])}
    for r in rows:
        g = verdicts.get(r["name"], {})
        for k in ("threshold", "verdict", "note", "recovery"):
            if g.get(k) is not None:
                r[k] = g[k]
    return rows


def _dataset(row: dict[str, Any]) -> tuple[str, str, str | None]:
    """(type, name, config) of the data a metric was measured on, from its recorded settings."""
    settings = row.get("settings") or {}
    task = settings.get("task")
    if isinstance(task, str) and task.startswith("bigbench:"):
        sub = task.split(":", 1)[1]
        return "bigbench", f"BIG-bench {sub}", sub
    if isinstance(task, str):
        return task, task, None
    return row["name"], row["name"], None


def eval_results(inputs: CardInputs) -> list[EvalResult]:
    """The candidate's scores as model-index entries (what the Hub renders)."""
    suite = (inputs.eval or {}).get("suite", "?")
    out = []
    for r in metric_rows(inputs):
        dtype, dname, dconfig = _dataset(r)
        kind = "accuracy" if _is_accuracy(r) else "perplexity"
        shots = (r.get("settings") or {}).get("num_fewshot")
        name = f"{kind} ({shots}-shot)" if kind == "accuracy" and shots is not None else kind
        out.append(EvalResult(
            task_type="text-generation", task_name="Text Generation",
            dataset_type=dtype, dataset_name=dname, dataset_config=dconfig,
            metric_type=kind, metric_name=f"{name}, suite {suite}",
            metric_value=round(float(r["candidate"]), 6)))
    return out


# --- the YAML header -----------------------------------------------------------------------
def tags(inputs: CardInputs) -> list[str]:
    r = inputs.recipe
    weights = (next(iter(_groups(inputs.config)), {}) or {}).get("weights") or {}
    bits = f"{weights.get('type', 'int')}{weights.get('num_bits', '')}"
    if _native(inputs.config):  # backend gptqmodel/autoawq: a native GPTQ/AWQ checkpoint
        bits = f"int{(inputs.config.get('quantization_config') or {}).get('bits', '')}"
    fmt = ["compressed-tensors", "llmcompressor"] if not _native(inputs.config) else \
        [r.method, r.backend]
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
        base_model=b.repo_id, library_name="transformers", pipeline_tag="text-generation",
        license=b.license, license_name=b.license_name, license_link=b.license_link,
        tags=tags(inputs), model_name=inputs.repo_id if results else None,
        eval_results=results or None, **extra)


# --- the body ----------------------------------------------------------------------------
def _native(config: dict[str, Any]) -> bool:
    """A native GPTQ/AWQ checkpoint (made by GPTQModel or AutoAWQ), not compressed-tensors."""
    return (config.get("quantization_config") or {}).get("quant_method") in ("gptq", "awq")


_ENGINE_NAMES = {"llmcompressor": "llm-compressor", "gptqmodel": "GPTQModel",
                 "autoawq": "AutoAWQ"}


def engine(inputs: CardInputs) -> str:
    """The engine that made the checkpoint, with its version where the run recorded it."""
    b = inputs.recipe.backend
    qc = inputs.config.get("quantization_config") or {}
    stamp = [str(q) for q in (qc.get("meta") or {}).get("quantizer") or []]
    version = inputs.versions.get(b) or next(
        (q.split(":", 1)[1] for q in stamp if q.startswith(f"{b}:")), "?")
    return f"{_ENGINE_NAMES.get(b, b)} {version}"


def _format_name(config: dict[str, Any]) -> str:
    if _native(config):
        qc = config["quantization_config"]
        return f"native {qc['quant_method'].upper()} ({qc.get('format') or qc.get('version')})"
    return "[compressed-tensors](https://github.com/neuralmagic/compressed-tensors)"


def describe_native(qc: dict[str, Any]) -> str:
    """One sentence for a native GPTQ/AWQ quantization_config."""
    sym = qc.get("sym", True) if qc.get("quant_method") == "gptq" else not qc.get("zero_point")
    gs = qc.get("group_size")
    where = f"groups of {gs} along the input dimension" if gs and gs > 0 else "per channel"
    return (f"{qc.get('bits')}-bit integer weights ({'symmetric' if sym else 'asymmetric'}, "
            f"{where}), 16-bit activations")


def _groups(config: dict[str, Any]) -> list[dict[str, Any]]:
    qc = config.get("quantization_config") or {}
    return list((qc.get("config_groups") or {}).values())


def _strategy(q: dict[str, Any]) -> str:
    s = q.get("strategy")
    if s == "group":
        return f"groups of {q.get('group_size')} along the input dimension"
    return {"channel": "per output channel", "tensor": "per tensor", "token": "per token",
            "block": f"blocks of {q.get('block_structure')}"}.get(str(s), str(s))


def describe_group(group: dict[str, Any]) -> str:
    """One sentence for one compressed-tensors config group, from what the checkpoint holds."""
    w = group.get("weights") or {}
    kind = "integer" if w.get("type") == "int" else "float"
    sym = "symmetric" if w.get("symmetric") else "asymmetric"
    text = f"{w.get('num_bits')}-bit {kind} weights ({sym}, {_strategy(w)})"
    a = group.get("input_activations")
    if not a:
        return text + ", 16-bit activations"
    akind = "integer" if a.get("type") == "int" else "float"
    how = "dynamic, computed at run time" if a.get("dynamic") else "static, calibrated scales"
    return text + f", {a.get('num_bits')}-bit {akind} activations ({_strategy(a)}, {how})"


def _warning(inputs: CardInputs) -> list[str]:
    if not inputs.forced:
        return []
    if inputs.gate is None:
        text = ("**Published with `--force` without a release gate**: the run was not "
                "evaluated and gated, so nothing here shows that quality held up.")
    else:
        failed = ", ".join(inputs.gate.get("failures") or []) or "see below"
        text = (f"**Published with `--force` although the release gate failed** (blocking: "
                f"{failed}). The scores below fell short of the thresholds set for a "
                "release; check them before using this model.")
    return ["> [!WARNING]", f"> {text}", ""]


def _intro(inputs: CardInputs) -> list[str]:
    b, r = inputs.base, inputs.recipe
    base = _hub_link(b.repo_id) if b.repo_id else f"`{b.name}`"
    gs = f", group size {inputs.preflight.get('group_size')}" \
        if inputs.preflight.get("group_size") else ""
    return [f"# {inputs.repo_id.split('/')[-1]}", "",
            f"{r.method.upper()} {r.scheme}{gs} quantization of {base} in the "
            f"{_format_name(inputs.config)} format, "
            "which [vLLM](https://github.com/vllm-project/vllm) loads with no extra flags"
            + (" (except `--kv-cache-dtype fp8` for the FP8 KV cache)" if r.kv_cache else "")
            + f". Made by `quantize` {inputs.versions.get('quantize', '?')} with the recipe "
            f"`{r.name}` (run `{inputs.run}`).", ""]


def _quantization(inputs: CardInputs) -> list[str]:
    r, cal = inputs.recipe, inputs.calibration
    qc = inputs.config.get("quantization_config") or {}
    lines = ["## Quantization", "", "| | |", "| --- | --- |",
             f"| method | {r.method.upper()} ({engine(inputs)})"
             + (f", SmoothQuant strength {r.smoothquant.strength}" if r.smoothquant else "")
             + " |",
             f"| scheme | {r.scheme} |"]
    for g in _groups(inputs.config):
        targets = ", ".join(map(str, g.get("targets") or []))
        lines.append(f"| targets: {targets} | {describe_group(g)} |")
    if _native(inputs.config):
        lines.append(f"| targets: Linear layers of the decoder | {describe_native(qc)} |")
    if inputs.preflight.get("group_size"):
        lines.append(f"| group size | {inputs.preflight['group_size']} |")
    if inputs.preflight.get("layers"):
        lines.append(f"| quantized layers | {inputs.preflight['layers']} |")
    ignore = list(qc.get("ignore") or r.ignore)
    shown = ", ".join(f"`{x}`" for x in ignore[:_MAX_IGNORE_SHOWN])
    more = f" and {len(ignore) - _MAX_IGNORE_SHOWN} more" if len(ignore) > _MAX_IGNORE_SHOWN else ""
    lines.append(f"| not quantized (ignore) | {shown or 'nothing'}{more} |")
    if r.trust_remote_code:
        lines.append("| trust_remote_code | **true**: the base model's repo code ran to build it, "
                     "and loading this model runs that code too; read it before you trust it |")
    kv_bits = kv_cache_bits(inputs.config)
    kv = "FP8 with calibrated scales" if kv_bits == 8 else "not quantized"
    lines.append(f"| KV cache | {kv} |")
    if _native(inputs.config):
        lines.append(f"| format | {_format_name(inputs.config)}, `quant_method: "
                     f"{qc.get('quant_method')}` |")
    else:
        lines.append(f"| format | {qc.get('format', '?')} (compressed-tensors "
                     f"{qc.get('version') or inputs.versions.get('compressed-tensors', '?')}) |")
    if r.needs_calibration and cal:
        spec = cal.get("spec") or {}
        source = (f"builtin `{spec['builtin']}`" if spec.get("builtin") else
                  f"Hub dataset `{spec['hub']}`" if spec.get("hub") else
                  f"file `{Path(str(spec.get('path'))).name}`" if spec.get("path") else "?")
        lines += [f"| calibration data | spec `{spec.get('name', '?')}`, {source}: "
                  f"{spec.get('description') or 'no description'} |",
                  f"| calibration samples | {cal.get('num_samples')} × {cal.get('seq_len')} "
                  f"tokens ({cal.get('tokens')} tokens) |",
                  f"| calibration fingerprint | `{cal.get('fingerprint')}` (sha256 of the "
                  "token ids) |"]
    else:
        lines.append("| calibration data | none: this recipe is data-free |")
    return [*lines, ""]


def _eval(inputs: CardInputs) -> list[str]:
    lines = ["## Evaluation", ""]
    rows = metric_rows(inputs)
    if not rows:
        return [*lines, "Not evaluated: the run has no eval results, so there is no quality "
                "evidence for this model.", ""]
    ev, gate = inputs.eval or {}, inputs.gate or {}
    lines += [f"Suite `{ev.get('suite', '?')}` on {ev.get('device', '?')}: the baseline is the "
              f"unquantized model{f' ({inputs.base.dtype})' if inputs.base.dtype else ''}, "
              "measured by the same code on the same data. Recovery is baseline/candidate "
              "for perplexity (lower is better) and candidate/baseline for accuracy; ± is "
              "the standard error (in points for accuracy).", "",
              "| metric | n | baseline | this model | recovery | threshold | verdict |",
              "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    notes = []
    for r in rows:
        unit = "accuracy" if _is_accuracy(r) else "perplexity"
        lines.append(
            f"| {r['name']} ({unit}) | {r.get('n', '-')} | "
            f"{_value(r, r.get('baseline'))}{_stderr(r, r.get('baseline_stderr'))} | "
            f"{_value(r, r.get('candidate'))}{_stderr(r, r.get('candidate_stderr'))} | "
            f"{float(r['recovery']):.1%} | {float(r['threshold']):.1%} | "
            f"{r.get('verdict', '-')}{' (advisory)' if r.get('on_fail') == 'warn' else ''} |")
        if r.get("note"):
            notes.append(f"- {r['name']}: {r['note']}")
    lines.append("")
    if gate:
        verdict = str(gate.get("verdict", "?")).upper()
        fails = ", ".join(gate.get("failures") or []) or "none"
        warns = ", ".join(gate.get("warnings") or []) or "none"
        lines.append(f"**Release gate: {verdict}** (blocking failures: {fails}; warnings: "
                     f"{warns})." + (" Published anyway with `--force`." if inputs.forced
                                     else ""))
    else:
        lines.append("**Release gate: not run.**" + (" Published with `--force`."
                                                     if inputs.forced else ""))
    if notes:
        lines += ["", *notes]
    if inputs.base.note:
        lines += ["", inputs.base.note]
    return [*lines, ""]


_VERIFY_FIELDS = (("result", "result"), ("why_not_vllm", "vLLM check skipped"),
                  ("format", "format"), ("kv_cache_dtype", "KV cache dtype"),
                  ("tp", "tensor parallel"), ("host", "host"))


def _verify(inputs: CardInputs) -> list[str]:
    v = inputs.verify
    lines = ["## Verification", ""]
    if v is None:
        return [*lines, "Not verified: `quantize verify` was not run on this export, so loading "
                "in vLLM was not checked by this run.", ""]
    status = "passed" if v.get("passed") else "FAILED"
    how = {"vllm": " (loaded and decoded in vLLM, compared with transformers)",
           "decode": " (decoded independently of the loader and compared; vLLM "
                     "could not run on the verifying host)"}.get(str(v.get("level")), "")
    lines.append(f"Verification level `{v.get('level', '?')}`{how}: **{status}**.")
    rows = [(label, v[key]) for key, label in _VERIFY_FIELDS
            if isinstance(v.get(key), (str, int, float)) and v.get(key) != ""]
    # other scalar facts a verify result may carry (but never local paths)
    rows += [(k, val) for k, val in sorted(v.items())
             if k not in {key for key, _ in _VERIFY_FIELDS} | {"level", "passed", "verdict",
                                                                "checkpoint", "out"}
             and isinstance(val, (int, float, str)) and not isinstance(val, bool)
             and not str(val).startswith(("/", "~"))]
    if rows:
        lines += ["", "| | |", "| --- | --- |", *(f"| {k} | {val} |" for k, val in rows)]
    return [*lines, ""]


def _memory(inputs: CardInputs) -> list[str]:
    b = inputs.base
    before_dtype = b.dtype or config_dtype(inputs.config)
    elem_before = dtype_bytes(before_dtype)
    kv_bits = kv_cache_bits(inputs.config)
    elem_after = kv_bits // 8 if kv_bits else elem_before
    kv_before, _ = kv_per_token(inputs.config, elem_before) if elem_before else (None, "")
    kv_after, how = kv_per_token(inputs.config, elem_after) if elem_after else (None, "")
    w_before = human_bytes(b.weights_bytes) if b.weights_bytes else "unknown"
    ratio = (f" ({b.weights_bytes / inputs.weights_bytes:.2f}× smaller)"
             if b.weights_bytes else "")
    return ["## Memory", "",
            f"| | base ({before_dtype or '?'}) | this model |", "| --- | ---: | ---: |",
            f"| weights (safetensors) | {w_before} | {human_bytes(inputs.weights_bytes)}"
            f"{ratio} |",
            f"| KV cache per token | {_bytes(kv_before)} | {_bytes(kv_after)} |", "",
            f"KV cache per token, this model: {how or 'unknown'}"
            + (". The FP8 KV cache needs `--kv-cache-dtype fp8` in vLLM." if kv_bits else "."),
            ""]


def _bytes(n: int | None) -> str:
    return f"{n:,} B" if n is not None else "unknown"


def _usage(inputs: CardInputs) -> list[str]:
    rid = inputs.repo_id
    kv = bool(kv_cache_bits(inputs.config))
    remote = inputs.recipe.trust_remote_code  # the model needs its repo's own code
    serve = f"vllm serve {rid}" + (" --kv-cache-dtype fp8" if kv else "") + (
        " --trust-remote-code" if remote else "")
    llm_args = f'"{rid}"' + (', kv_cache_dtype="fp8"' if kv else "") + (
        ", trust_remote_code=True" if remote else "")
    hf_args = f'"{rid}"' + (", trust_remote_code=True" if remote else "")
    if inputs.has_chat_template:
        vllm_call = ['messages = [{"role": "user", "content": "What is the capital of France?"}]',
                     "out = llm.chat(messages, SamplingParams(max_tokens=64, temperature=0))"]
        hf_call = ['messages = [{"role": "user", "content": "What is the capital of France?"}]',
                   "ids = tok.apply_chat_template(messages, add_generation_prompt=True, "
                   'return_tensors="pt", return_dict=True)',
                   "out = model.generate(**ids, max_new_tokens=64, do_sample=False)",
                   'print(tok.decode(out[0][ids["input_ids"].shape[1]:], '
                   "skip_special_tokens=True))"]
    else:
        vllm_call = ['out = llm.generate(["The capital of France is"], '
                     "SamplingParams(max_tokens=64, temperature=0))"]
        hf_call = ['ids = tok("The capital of France is", return_tensors="pt")',
                   "out = model.generate(**ids, max_new_tokens=64, do_sample=False)",
                   "print(tok.decode(out[0], skip_special_tokens=True))"]
    return ["## Use it", "", "With vLLM (server, OpenAI-compatible API):", "", "```bash",
            serve, "```", "", "With vLLM in Python:", "", "```python",
            "from vllm import LLM, SamplingParams", "", f"llm = LLM(model={llm_args})",
            *vllm_call, "print(out[0].outputs[0].text)", "```", "",
            f"With transformers (needs `pip install {_hf_needs(inputs.config)}`):", "",
            "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
            f"tok = AutoTokenizer.from_pretrained({hf_args})",
            f'model = AutoModelForCausalLM.from_pretrained({hf_args}, device_map="auto")',
            *hf_call, "```", ""]


def _hf_needs(config: dict[str, Any]) -> str:
    """What transformers needs to load the checkpoint."""
    return "gptqmodel optimum" if _native(config) else "compressed-tensors"


def _reproduce(inputs: CardInputs) -> list[str]:
    v = inputs.versions
    b = inputs.base
    model_arg = b.source if b.source == "default" or b.source == b.repo_id else \
        (b.repo_id or f"<folder of {b.name}>")
    own = "; `llmcompressor_recipe.yaml` is the engine's own form of it" \
        if inputs.recipe.backend == "llmcompressor" else ""
    lines = ["## Reproduce", "",
             f"The recipe as run (`recipe.yaml` in this repo{own}):", "", "```yaml",
             inputs.recipe_text.rstrip(), "```",
             "", f"Save it as `{inputs.recipe.name}.yaml` (a recipe's name matches its file "
             "name) and run:", "", "```bash",
             f"quantize run {inputs.recipe.name}.yaml --model {model_arg}", "```", "",
             "A run that calibrates on the same tokens reports the same calibration "
             "fingerprint.", "", "| package | version |", "| --- | --- |",
             *(f"| {k} | {val} |" for k, val in sorted(v.items()))]
    if inputs.extra_files:
        lines += ["", "Raw results in this repo: "
                  + ", ".join(f"`{f}`" for f in inputs.extra_files) + "."]
    return [*lines, ""]


def body(inputs: CardInputs) -> str:
    parts = [*_intro(inputs), *_warning(inputs), *_quantization(inputs), *_eval(inputs),
             *_verify(inputs), *_memory(inputs), *_usage(inputs), *_reproduce(inputs)]
    return "\n".join(parts).rstrip() + "\n"


def build_card(inputs: CardInputs) -> ModelCard:
    data = card_data(inputs)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body(inputs)}")


def dumps_json(data: Any) -> str:
    """Stable JSON for the provenance files shipped next to the card."""
    return json.dumps(data, indent=2, sort_keys=True) + "\n"
