"""`quantize plan`: which recipe lets a model serve a context to N users on given GPUs.

For each recipe (and the unquantized baseline) the planner computes, from config.json alone:

* weight memory, per tensor, in the compressed-tensors format the export stage writes
  (packed int32 weights, scales and zero points per group, fp8/int8 weights with per-channel
  scales; unquantized tensors at the model dtype; tied embeddings once);
* KV-cache bytes per token: 2 x layers x kv_heads x head_dim x bytes(kv dtype) for GQA/MQA/MHA
  (kv heads split over tensor-parallel ranks, replicated when fewer than ranks), the latent
  (kv_lora_rank + rope dim) x layers x bytes for MLA (replicated on every rank), and sliding-
  window layers that only need min(window - 1 + max_num_batched_tokens, max_model_len)
  tokens per request;
* vLLM's KV budget, as vllm/v1/worker/gpu_worker.py (Worker.determine_available_memory) and
  vllm/utils/mem_utils.py (memory_profiling) compute it:
      available = total x gpu_memory_utilization - weights - torch activation peak of the
                  profile run - non-torch memory (NCCL, cuBLAS workspaces...)
  with the activation peak modelled from the profile run (a forward pass of
  max_num_batched_tokens tokens, then a dummy sampler pass over max_num_seqs x vocab
  logits) and constants calibrated against published vLLM start-up logs (PROFILES);
* KV tokens = floor(available / (16 x bytes per token)) x 16 (vllm/v1/core/kv_cache_utils.py)
  and the largest concurrency at the requested context.

KV memory grows linearly with context length and with concurrency: bytes = per-token bytes x
tokens x sequences. Nothing in it is quadratic (attention *compute* is, the cache is not).
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from quantize.errors import PreflightError, QuantizeError, first_line
from quantize.planner.gpus import Gpu, PlanError
from quantize.spec.paths import DATA_DIR
from quantize.spec.recipe import Recipe
from quantize.spec.schemes import SCHEMES

GIB = 1 << 30
BLOCK = 16  # vLLM's default KV block size (tokens)
DATA = DATA_DIR
CONFIGS = DATA / "model_configs"
TP_CANDIDATES = (1, 2, 4, 8)
BASELINE = "none"
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


# --- vLLM memory constants -----------------------------------------------------------
@dataclass(frozen=True)
class VllmProfile:
    """Constants of the profile run that vLLM does not derive from the model; fitted to the
    start-up logs listed in docs/plan.md (activation and non-torch columns)."""

    name: str
    sampler_bytes_per_logit: float  # peak bytes per (max_num_seqs x vocab) dummy-sampler logit
    hidden_factor: float  # live [tokens, hidden] buffers at the MLP peak, besides 3 x I
    nontorch_gib_single: float  # non-torch increase with one GPU (cuBLAS, allocator)
    nontorch_gib_tp: float  # ... with tensor parallelism (NCCL + custom all-reduce buffers)
    source: str


PROFILES: dict[str, VllmProfile] = {
    "0.19": VllmProfile("0.19", 15.4, 4.25, 0.25, 2.1,
                        "llm-d-incubation/llm-d-planner accuracy/results/v0.19.0/logs (H100)"),
    "0.11": VllmProfile("0.11", 38.5, 4.25, 0.13, 0.55,
                        "llm-d/llm-d-benchmark config_explorer/empirical-vllm-memory-results.md"),
}
DEFAULT_PROFILE = "0.19"
# Not in the KV budget (vLLM <= 0.19 captures CUDA graphs after sizing the cache), but on the
# card: the graph pool (0.5-1.9 GiB in the v0.19 logs) and the CUDA context.
CUDAGRAPH_GIB = 1.0
CONTEXT_GIB = 0.5


def serve_defaults(gpu: Gpu) -> tuple[int, int]:
    """`vllm serve` max_num_batched_tokens / max_num_seqs defaults for this card
    (EngineArgs.get_batch_defaults, vllm/engine/arg_utils.py)."""
    return (8192, 1024) if gpu.large_defaults else (2048, 256)


# --- where the config comes from --------------------------------------------------------
@dataclass
class RunInfo:
    """A finished (or partial) pipeline run folder."""

    path: Path
    recipe: str
    model_source: str
    model_path: str
    weights_bytes: int | None
    gate_verdict: str | None
    recovery: float | None  # the worst metric's recovery from gate/gate.json
    gate_note: str = ""


@dataclass
class ModelSource:
    spec: str
    name: str  # short name, as run folders use it
    origin: str  # builtin:<repo> | folder:<path> | hub:<id> | default | run:<path>
    config: dict[str, Any]
    serve_ref: str  # what `vllm serve` gets for the baseline
    run: RunInfo | None = None


def _clean(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if not k.startswith("_")}


def builtin_configs() -> dict[str, Path]:
    """repo id -> shipped config file."""
    out = {}
    for p in sorted(CONFIGS.glob("*.json")):
        repo = json.loads(p.read_text())["_source"]["repo_id"]
        out[repo] = p
    return out


def _builtin(spec: str) -> tuple[str, Path] | None:
    want = spec.lower()
    for repo, path in builtin_configs().items():
        if want in (repo.lower(), repo.split("/")[-1].lower()):
            return repo, path
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanError(f"{path}: cannot read JSON ({exc}); fix or re-download it") from None
    if not isinstance(data, dict):
        raise PlanError(f"{path}: expected a JSON object")
    return data


def read_run(path: Path) -> RunInfo | None:
    """The facts of a run folder, or None if it is not one. Reads gate.json defensively."""
    manifest_file = path / "manifest.json"
    if not manifest_file.is_file():
        return None
    try:
        manifest = json.loads(manifest_file.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(manifest, dict):
        return None
    model = manifest.get("model") or {}
    export = ((manifest.get("stages") or {}).get("export") or {}).get("summary") or {}
    weights = export.get("weights_bytes")
    if weights is None and (path / "export").is_dir():
        weights = sum(p.stat().st_size for p in (path / "export").glob("*.safetensors")) or None
    verdict, recovery, note = _read_gate(path / "gate" / "gate.json")
    return RunInfo(path=path, recipe=str((manifest.get("recipe") or {}).get("name", "")),
                   model_source=str(model.get("source", "")), model_path=str(model.get("path", "")),
                   weights_bytes=weights, gate_verdict=verdict, recovery=recovery, gate_note=note)


def _read_gate(path: Path) -> tuple[str | None, float | None, str]:
    if not path.is_file():
        return None, None, ""
    try:
        gate = json.loads(path.read_text())
        verdict = gate.get("verdict")
        recoveries = [float(r["recovery"]) for r in gate.get("rows", [])
                      if isinstance(r, dict) and isinstance(r.get("recovery"), (int, float))]
    except (OSError, json.JSONDecodeError, AttributeError, TypeError, ValueError):
        return None, None, f"{path} is unreadable; ignored"
    if verdict not in ("pass", "fail"):
        return None, None, f"{path} has no pass/fail verdict; ignored"
    return verdict, (min(recoveries) if recoveries else None), ""


def find_runs(runs_dir: Path, name: str, spec: str) -> list[RunInfo]:
    """Run folders under runs_dir that quantized this model."""
    if not runs_dir.is_dir():
        return []
    found = []
    for child in sorted(runs_dir.iterdir()):
        info = read_run(child) if child.is_dir() else None
        if info is None:
            continue
        names = {info.model_source, Path(info.model_source).name, Path(info.model_path).name,
                 info.model_path}
        if name in names or spec in names:
            found.append(info)
    return found


def load_source(spec: str) -> ModelSource:
    """MODEL: a run folder, a local folder, `default`, a built-in config or a Hub id.
    Only config.json is read; no weights."""
    from quantize.model.source import DEFAULT_MODEL, DEFAULT_NAME

    path = Path(spec).expanduser()
    if path.is_dir() and (path / "manifest.json").is_file() and (path / "export").is_dir():
        return _from_run(path, spec)
    if path.is_dir():
        cfg = path / "config.json"
        if not cfg.is_file():
            raise PlanError(f"{path} has no config.json; give the folder that holds it, a run "
                            "folder, a built-in model or a Hub id")
        return ModelSource(spec, path.resolve().name, f"folder:{path}", _clean(_read_json(cfg)),
                           str(path))
    if spec == DEFAULT_MODEL:
        from quantize.model.source import resolve_model

        ref = resolve_model(None)
        return ModelSource(spec, DEFAULT_NAME, "default", _clean(ref.config), str(ref.path))
    hit = _builtin(spec)
    if hit:
        repo, file = hit
        return ModelSource(spec, repo.split("/")[-1], f"builtin:{repo}",
                           _clean(_read_json(file)), repo)
    if _HUB_ID.match(spec):
        return ModelSource(spec, spec.split("/")[-1], f"hub:{spec}", _hub_config(spec), spec)
    raise PlanError(f"model {spec!r} is not a folder, a run folder, `default`, a built-in model "
                    f"or a Hub id; built-in: {', '.join(builtin_configs())}")


def _from_run(path: Path, spec: str) -> ModelSource:
    run = read_run(path)
    if run is None:
        raise PlanError(f"{path}/manifest.json is not a run manifest; re-run the pipeline or "
                        "plan from the model itself")
    config = _read_json(path / "export" / "config.json")
    config = {k: v for k, v in _clean(config).items() if k != "quantization_config"}
    base = Path(run.model_path)
    name = base.name or path.name
    serve = run.model_source if run.model_source not in ("", "default") else str(base)
    return ModelSource(spec, name, f"run:{path}", config, serve, run)


def _hub_config(repo: str) -> dict[str, Any]:
    try:
        from huggingface_hub import hf_hub_download

        file = hf_hub_download(repo, "config.json")
    except Exception as exc:  # offline, gated, missing: all mean "no config"
        first = first_line(exc)[:160]
        raise PlanError(f"cannot get config.json of {repo!r} from the Hub ({first}); pass a "
                        "local folder with config.json or one of the built-in models: "
                        f"{', '.join(builtin_configs())}") from None
    return _clean(_read_json(Path(file)))


# --- architecture ----------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """What the memory model needs from config.json."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_position: int | None
    dtype_bytes: int
    layer_kinds: tuple[str, ...]  # "full" | "sliding" per decoder layer
    sliding_window: int | None
    mla_latent: int  # kv_lora_rank + qk_rope_head_dim; 0 when not MLA
    experts: int
    experts_per_token: int
    moe_intermediate: int
    shared_intermediate: int
    dense_mlp_layers: int  # MoE models whose first layers keep a dense MLP (DeepSeek)

    @property
    def attention(self) -> str:
        if self.mla_latent:
            return "MLA"
        if self.kv_heads == self.heads:
            return "MHA"
        return "MQA" if self.kv_heads == 1 else "GQA"

    def kv_heads_per_rank(self, tp: int) -> int:
        # vLLM splits KV heads over ranks and replicates them when there are fewer than ranks
        return max(1, self.kv_heads // tp)


def _dtype_bytes(config: dict[str, Any]) -> int:
    # vLLM's dtype=auto serves bf16/fp16 checkpoints as they are and float32 ones (e.g.
    # gemma-2) in 16 bits, so unquantized tensors and the KV cache take 2 bytes either way
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    if dtype not in ("bfloat16", "float16", "float32", "torch.bfloat16", "torch.float16",
                     "torch.float32"):
        raise PlanError(f"config.json dtype {dtype!r} is not bfloat16/float16/float32; plan "
                        "from the unquantized model's config")
    return 2


def model_shape(config: dict[str, Any], hf_config: Any) -> Shape:
    c = hf_config
    text = getattr(c, "text_config", None) or c
    hidden = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    layers = int(text.num_hidden_layers)
    window = getattr(text, "sliding_window", None)
    kinds = _layer_kinds(text, layers, window)
    mla = 0
    if getattr(text, "kv_lora_rank", None):
        mla = int(text.kv_lora_rank) + int(getattr(text, "qk_rope_head_dim", 0) or 0)
    experts = int(getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
                  or getattr(text, "n_routed_experts", None) or 0)
    moe_inter = int(getattr(text, "moe_intermediate_size", None) or
                    (text.intermediate_size if experts else 0) or 0)
    shared = int(getattr(text, "shared_expert_intermediate_size", None) or 0)
    if not shared and getattr(text, "n_shared_experts", None):
        shared = int(text.n_shared_experts) * moe_inter
    return Shape(
        model_type=str(config.get("model_type", "")), hidden=hidden,
        intermediate=int(getattr(text, "intermediate_size", 0) or 0), layers=layers, heads=heads,
        kv_heads=kv, head_dim=head_dim, vocab=int(text.vocab_size),
        max_position=getattr(text, "max_position_embeddings", None),
        dtype_bytes=_dtype_bytes(config), layer_kinds=kinds,
        sliding_window=int(window) if window and "sliding" in kinds else None,
        mla_latent=mla, experts=experts,
        experts_per_token=int(getattr(text, "num_experts_per_tok", 0) or 0),
        moe_intermediate=moe_inter if experts else 0, shared_intermediate=shared,
        dense_mlp_layers=int(getattr(text, "first_k_dense_replace", 0) or 0)
        + len(getattr(text, "mlp_only_layers", None) or []))


def _layer_kinds(c: Any, layers: int, window: Any) -> tuple[str, ...]:
    types = getattr(c, "layer_types", None)
    if types:
        return tuple("sliding" if "sliding" in str(t) else "full" for t in types[:layers])
    if window and getattr(c, "use_sliding_window", True) is not False:
        return ("sliding",) * layers  # e.g. Mistral-7B-v0.1: every layer has the window
    return ("full",) * layers


# --- weights ---------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightFormat:
    """How one Linear weight is stored (compressed-tensors formats, or fp8 block scales)."""

    kind: str  # "pack" (int, packed into int32) | "int8" | "fp8" | "fp8-block"
    bits: int
    group: int | None = None  # group size along the input dim; None = per channel/tensor
    symmetric: bool = True
    per_tensor: bool = False
    g_idx: bool = False  # actorder="group" stores a per-input-channel group index
    block: tuple[int, int] | None = None

    @property
    def label(self) -> str:
        if self.kind == "fp8-block":
            return f"fp8 block {self.block}"
        g = f" g{self.group}" if self.group else ""
        return f"{self.kind} {self.bits}-bit{g}{'' if self.symmetric else ' asym'}"


def format_for(scheme: str, group: int | None, actorder: str | None = None) -> WeightFormat:
    info = SCHEMES[scheme]
    if info.weight_type == "float":
        return WeightFormat("fp8", 8, per_tensor=scheme == "FP8")
    if info.group:  # weight-only int schemes are written pack-quantized (8-bit too)
        return WeightFormat("pack", info.weight_bits, group, info.symmetric,
                            g_idx=actorder == "group")
    return WeightFormat("int8", 8, symmetric=info.symmetric)


def linear_bytes(out: int, inp: int, fmt: WeightFormat, dtype_bytes: int) -> int:
    """Bytes of one quantized Linear weight and its scale/zero-point tensors on disk (the
    same tensors vLLM keeps on the GPU, repacked but not resized)."""
    if fmt.kind == "fp8-block":
        bn, bk = fmt.block or (128, 128)
        return out * inp + math.ceil(out / bn) * math.ceil(inp / bk) * 4  # fp32 scale_inv
    if fmt.kind in ("fp8", "int8"):
        scales = 2 if fmt.per_tensor else out  # weight_scale (+ input_scale when static)
        zero = 0 if fmt.symmetric else out
        return out * inp + (scales + zero) * dtype_bytes
    groups = math.ceil(inp / fmt.group) if fmt.group else 1
    packed = out * math.ceil(inp * fmt.bits / 32) * 4  # weight_packed int32
    scale = out * groups * dtype_bytes  # weight_scale in the model dtype
    zero = 0 if fmt.symmetric else math.ceil(out * fmt.bits / 32) * groups * 4  # packed on dim 0
    gidx = inp * 4 if fmt.g_idx else 0
    return packed + scale + zero + gidx + 16  # + weight_shape (2 x int64)


@dataclass(frozen=True)
class LayerPlan:
    """Which Linear layers get which format; experts_fmt for fused MoE expert tensors."""

    formats: dict[str, WeightFormat]
    experts_fmt: WeightFormat | None
    kv_scales: bool = False


@dataclass(frozen=True)
class WeightEstimate:
    total: int
    replicated: int  # bytes every tensor-parallel rank holds in full
    quantized: int  # bytes of the quantized tensors (for checks against exports)

    def per_rank(self, tp: int) -> int:
        return self.replicated + math.ceil((self.total - self.replicated) / tp)


# vLLM keeps these whole on every rank: norms and biases (1-D), MoE routers and the MLA
# down-projections (ReplicatedLinear in vllm/model_executor/models/deepseek_v2.py)
_REPLICATED = re.compile(r"(mlp\.gate\.weight|kv_a_proj_with_mqa|q_a_proj|e_score_correction)")


def estimate_weights(model: Any, dtype_bytes: int, plan: LayerPlan) -> WeightEstimate:
    total = replicated = quantized = 0
    modules = dict(model.named_modules())
    attention_layers = 0
    for name, param in model.named_parameters():  # tied weights are listed once
        owner, _, pname = name.rpartition(".")
        fmt = plan.formats.get(owner)
        if fmt is not None and pname == "weight" and param.ndim == 2:
            size = linear_bytes(param.shape[0], param.shape[1], fmt, dtype_bytes)
            quantized += size
        elif param.ndim == 3 and plan.experts_fmt is not None and _is_experts(modules[owner]):
            size = _experts_bytes(pname, tuple(param.shape), plan.experts_fmt, dtype_bytes)
            quantized += size
        else:
            size = param.numel() * dtype_bytes
        if param.ndim == 1 or _REPLICATED.search(name):
            replicated += size
        total += size
        if pname == "weight" and owner.endswith(("k_proj", "kv_b_proj")):
            attention_layers += 1
    if plan.kv_scales:  # k_scale and v_scale per attention layer, model dtype
        total += 2 * attention_layers * dtype_bytes
        replicated += 2 * attention_layers * dtype_bytes
    return WeightEstimate(total, replicated, quantized)


def _is_experts(module: Any) -> bool:
    return type(module).__name__.endswith("Experts")


def _experts_bytes(pname: str, shape: tuple[int, ...], fmt: WeightFormat, dtype_bytes: int) -> int:
    experts, out, inp = shape
    if "gate_up" in pname:  # exported as separate gate_proj and up_proj per expert
        return experts * 2 * linear_bytes(out // 2, inp, fmt, dtype_bytes)
    return experts * linear_bytes(out, inp, fmt, dtype_bytes)


@functools.lru_cache(maxsize=8)
def _meta(config_json: str) -> Any:
    from quantize.checks.preflight import meta_model
    from quantize.model.source import check_architecture

    config = json.loads(config_json)
    try:
        check_architecture(config, trust_remote_code=False)
        return meta_model(config)
    except QuantizeError:
        raise
    except Exception as exc:
        raise PlanError(f"transformers cannot build model_type {config.get('model_type')!r} "
                        f"from this config ({type(exc).__name__}: {exc}); check config.json "
                        "or upgrade transformers") from None


def meta(config: dict[str, Any]) -> Any:
    return _meta(json.dumps(config, sort_keys=True))


def recipe_layers(model: Any, recipe: Recipe, group: int | None) -> LayerPlan:
    """The recipe's per-layer formats, matched exactly as compressed-tensors matches them."""
    from compressed_tensors.utils import is_match

    from quantize.checks.preflight import override_group_size, targeted_layers

    actorder = recipe.gptq.actorder if recipe.gptq else None
    main = format_for(recipe.scheme, group, actorder)
    formats = {lay.name: main for lay in targeted_layers(model, recipe.targets, recipe.ignore)}
    for ov in recipe.overrides:
        sub = targeted_layers(model, ov.targets, recipe.ignore)
        ov_group = override_group_size(ov, group)  # the rule pre-flight and the engine use
        for lay in sub:
            formats[lay.name] = format_for(ov.scheme, ov_group, actorder)
    experts_fmt = None
    if "Linear" in recipe.targets:
        for name, module in model.named_modules():
            if _is_experts(module) and not is_match(name, module, recipe.ignore):
                experts_fmt = main
                break
    return LayerPlan(formats, experts_fmt, kv_scales=recipe.kv_cache == "fp8")


def published_layers(model: Any, qc: dict[str, Any]) -> tuple[LayerPlan, str]:
    """The format of a pre-quantized checkpoint's quantization_config (compressed-tensors or
    fp8 block), so its baseline row shows the weights as published."""
    from quantize.checks.preflight import targeted_layers

    method = qc.get("quant_method")
    if method == "fp8":
        block = tuple(qc.get("weight_block_size") or (128, 128))
        fmt = WeightFormat("fp8-block", 8, block=(int(block[0]), int(block[1])))
        ignore = ["lm_head", *qc.get("modules_to_not_convert", [])]
        targets = ["Linear"]
    elif method == "compressed-tensors":
        group: dict[str, Any] = next(iter((qc.get("config_groups") or {}).values()), {})
        w = group.get("weights") or {}
        packing = group.get("format") or qc.get("format")
        kind = "fp8" if w.get("type") == "float" else (
            "pack" if packing == "pack-quantized" else "int8")
        fmt = WeightFormat(kind, int(w.get("num_bits", 8)), w.get("group_size"),
                           bool(w.get("symmetric", True)), per_tensor=w.get("strategy") == "tensor",
                           g_idx=w.get("actorder") == "group")
        ignore, targets = list(qc.get("ignore") or []), list(group.get("targets") or ["Linear"])
    else:
        raise PlanError(f"cannot size quantization_config quant_method {method!r}; plan from the "
                        "unquantized base model's config.json instead")
    formats = {lay.name: fmt for lay in targeted_layers(model, targets, ignore)}
    experts = fmt if any(_is_experts(m) for m in model.modules()) else None
    return LayerPlan(formats, experts), f"as published ({method}: {fmt.label})"


# --- KV cache --------------------------------------------------------------------------
def kv_bytes_per_token(shape: Shape, tp: int, kv_bytes: int) -> int:
    """Per GPU, all attention layers: what vLLM divides the KV budget by."""
    return sum(_layer_kv(shape, tp, kv_bytes) for _ in shape.layer_kinds)


def _layer_kv(shape: Shape, tp: int, kv_bytes: int) -> int:
    if shape.mla_latent:  # one latent vector per token, the same on every rank
        return shape.mla_latent * kv_bytes
    return 2 * shape.kv_heads_per_rank(tp) * shape.head_dim * kv_bytes


def request_bytes(shape: Shape, tp: int, kv_bytes: int, context: int, batched: int) -> int:
    """KV bytes one sequence of `context` tokens holds per GPU: linear in the context."""
    full = math.ceil(context / BLOCK) * BLOCK
    # vLLM's SlidingWindowSpec keeps window - 1 + max_num_batched_tokens tokens at most
    swa = min(full, math.ceil(((shape.sliding_window or 0) - 1 + batched) / BLOCK) * BLOCK)
    per = _layer_kv(shape, tp, kv_bytes)
    return sum(per * (swa if kind == "sliding" else full) for kind in shape.layer_kinds)


def kv_description(shape: Shape, tp: int, kv_dtype: str) -> str:
    n_swa = shape.layer_kinds.count("sliding")
    if shape.mla_latent:
        what = (f"MLA latent KV: {shape.mla_latent} values/token/layer x {shape.layers} layers, "
                "replicated on every GPU (no K/V split, no factor 2)")
    else:
        split = shape.kv_heads_per_rank(tp)
        what = (f"{shape.attention}: 2 x {shape.layers} layers x {shape.kv_heads} KV heads "
                f"({split} per GPU at TP={tp}) x head_dim {shape.head_dim}")
        if shape.head_dim * shape.heads != shape.hidden:
            what += f" (head_dim != hidden/heads = {shape.hidden // shape.heads})"
    if n_swa:
        what += (f"; sliding window {shape.sliding_window} on {n_swa} of {shape.layers} layers "
                 "(counted at min(window-1+max_num_batched_tokens, context) tokens per request)")
    else:
        what += "; full attention on every layer"
    return f"{what}; KV dtype {kv_dtype}"


# --- the vLLM memory model -------------------------------------------------------------
@dataclass
class Memory:
    """One configuration's memory, per GPU, in bytes (tokens and sequences where named)."""

    total: int
    requested: int
    weights: int
    activation: int
    activation_forward: int
    activation_sampler: int
    nontorch: int
    available: int
    kv_bytes_per_token: int
    kv_tokens: int
    request_bytes: int
    max_concurrency: float

    @property
    def max_sequences(self) -> int:
        return max(0, math.floor(self.max_concurrency + 1e-9))


def activation_peak(shape: Shape, tp: int, batched: int, seqs: int,
                    profile: VllmProfile) -> tuple[int, int]:
    """The profile run's torch peak: (forward at max_num_batched_tokens, dummy sampler)."""
    b = shape.dtype_bytes
    mlp = 3 * math.ceil(shape.intermediate / tp) if shape.intermediate else 0
    if shape.experts:
        moe = (shape.experts_per_token * 3 * math.ceil(shape.moe_intermediate / tp)
               + 3 * math.ceil(shape.shared_intermediate / tp))
        mlp = max(moe, mlp if shape.dense_mlp_layers else 0)
    attn = (2 * shape.heads + 2 * shape.kv_heads) * shape.head_dim // tp
    forward = int(batched * b * (max(mlp, attn) + profile.hidden_factor * shape.hidden))
    sampler = int(min(seqs, batched) * shape.vocab * profile.sampler_bytes_per_logit)
    return forward, sampler


def vllm_memory(shape: Shape, weights_rank: int, gpu: Gpu, tp: int, util: float, context: int,
                batched: int, seqs: int, kv_bytes: int, profile: VllmProfile) -> Memory:
    total = gpu.memory_bytes
    requested = int(total * util)
    forward, sampler = activation_peak(shape, tp, batched, seqs, profile)
    activation = max(forward, sampler)
    nontorch = int((profile.nontorch_gib_tp if tp > 1 else profile.nontorch_gib_single) * GIB)
    available = requested - weights_rank - activation - nontorch
    per_token = kv_bytes_per_token(shape, tp, kv_bytes)
    blocks = max(0, available) // (per_token * BLOCK) if per_token else 0
    per_request = request_bytes(shape, tp, kv_bytes, context, batched)
    concurrency = (blocks * BLOCK * per_token) / per_request if per_request else 0.0
    return Memory(total, requested, weights_rank, activation, forward, sampler, nontorch,
                  available, per_token, blocks * BLOCK, per_request, concurrency)


# --- recipes -----------------------------------------------------------------------------
# Expected accuracy when no gate result exists: a documented ordering, not a measurement.
# FP8 W8A8 is near-lossless, INT8 W8A8 close behind, 4-bit GPTQ/AWQ a little lower and RTN
# lower still (Kurtic et al., "Give Me BF16 or Give Me Death?", arXiv:2411.02355).
def prior_recovery(recipe: Recipe | None) -> float:
    if recipe is None:
        return 1.0
    info = SCHEMES[recipe.scheme]
    if info.weight_bits >= 8:
        base = 0.995 if info.weight_type == "float" or info.activations == "none" else 0.99
    else:
        calibrated = recipe.method in ("gptq", "awq")
        base = {4: 0.975 if calibrated else 0.95, 3: 0.92 if calibrated else 0.85}.get(
            info.weight_bits, 0.5)
    return round(base - (0.003 if recipe.kv_cache == "fp8" else 0.0), 4)


def gpu_support(recipe: Recipe | None, gpu: Gpu, experts: bool) -> tuple[bool, str]:
    """(runs at all, note) for this recipe's kernels on this card."""
    if recipe is None:
        return True, ""
    info = SCHEMES[recipe.scheme]
    major, minor = gpu.capability
    cc = major * 10 + minor
    if info.weight_type == "float":
        if gpu.fp8:
            return True, ""
        if experts:
            return False, ("FP8 MoE needs FP8 hardware (capability >= 8.9) in the vLLM "
                           f"releases this was checked against; verify before using {gpu.name}")
        if cc >= 75:  # vLLM docs, FP8 W8A8: weight-only W8A16 via FP8 Marlin from 7.5
            return True, ("no FP8 hardware: vLLM runs it weight-only (W8A16, FP8 Marlin): same "
                          "memory, no FP8 activation speed-up")
        return False, (f"FP8 needs capability >= 7.5 for the Marlin fallback; {gpu.name} is "
                       f"{gpu.compute_capability}")
    if info.activations == "int8-dynamic":
        if gpu.int8 is None:
            return True, f"INT8 W8A8 kernels on {gpu.name} are unverified; check vLLM's support"
        return (True, "") if gpu.int8 else (False, f"no INT8 W8A8 kernels on {gpu.name}")
    if cc < 80:
        return True, "no Marlin kernels below capability 8.0: slower fallback kernels"
    note = ""
    if recipe.kv_cache == "fp8" and not gpu.fp8:
        note = "FP8 KV cache without FP8 hardware depends on the attention backend"
    return True, note


def tp_problem(shape: Shape, tp: int, fmt_group: int | None) -> str | None:
    """Why vLLM cannot shard this model `tp` ways, or None."""
    if shape.heads % tp:
        return f"{shape.heads} attention heads do not split over {tp} GPUs"
    if not shape.mla_latent and shape.kv_heads % tp and tp % shape.kv_heads:
        return f"{shape.kv_heads} KV heads do not split over {tp} GPUs"
    if fmt_group:
        row_inputs = [shape.intermediate, shape.heads * shape.head_dim, shape.moe_intermediate]
        for width in row_inputs:
            if width and (width % tp or (width // tp) % fmt_group):
                return (f"group size {fmt_group} does not divide the per-GPU input "
                        f"({width}/{tp}) of the row-parallel layers")
    return None


@dataclass
class Row:
    """One recipe (or the baseline) planned on the requested GPUs."""

    recipe: str
    scheme: str
    kv_dtype: str
    weights_total: int
    weights_source: str
    accuracy: float
    accuracy_source: str
    status: str  # "fits" | "partial" | "no-kv" | "no-fit" | "unsupported" | "n/a"
    reason: str
    memory: Memory | None
    min_tp: int | None
    min_tp_sequences: int | None
    gpu_note: str
    gate_verdict: str | None
    serve: str | None
    kv_bytes_per_token_by_dtype: dict[str, int] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.status == "fits"


@dataclass
class PlanRequest:
    model: str
    gpu: Gpu
    gpus: int = 1
    context: int = 32768
    concurrency: int = 16
    recipes: list[str] = field(default_factory=lambda: ["all"])
    util: float = 0.9
    kv_cache_dtype: str = "auto"  # auto: the recipe's (fp8 for kv_cache: fp8), else model dtype
    max_num_batched_tokens: int | None = None
    runs_dir: Path = Path("runs")
    profile: str = DEFAULT_PROFILE


@dataclass
class Plan:
    request: PlanRequest
    source: ModelSource
    shape: Shape
    rows: list[Row]
    recommendation: Row | None
    recommendation_kind: str  # "fits" | "partial" | "none"
    batched: int
    notes: list[str]
    kv_model: str
    hints: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        req = self.request
        return {
            "model": {"spec": req.model, "name": self.source.name, "origin": self.source.origin,
                      "architecture": asdict(self.shape)},
            "gpu": req.gpu.model_dump(),
            "gpus": req.gpus, "context": req.context, "concurrency": req.concurrency,
            "gpu_memory_utilization": req.util, "max_num_batched_tokens": self.batched,
            "max_num_seqs": req.concurrency, "vllm_profile": asdict(PROFILES[req.profile]),
            "kv_model": self.kv_model,
            "rows": [_row_dict(r) for r in self.rows],
            "recommendation": _row_dict(self.recommendation) if self.recommendation else None,
            "recommendation_kind": self.recommendation_kind,
            "hints": self.hints,
            "notes": self.notes,
        }


def _row_dict(row: Row) -> dict[str, Any]:
    d = asdict(row)
    if row.memory is not None:
        d["memory"]["max_sequences"] = row.memory.max_sequences
    return d


def _recipe_list(names: Iterable[str]) -> list[str]:
    from quantize.spec.recipe import available

    out: list[str] = []
    for name in names:
        for part in (p.strip() for p in name.split(",")):
            if part == "all":
                out.extend(available("recipes"))
            elif part and part != BASELINE:
                out.append(part)
    return list(dict.fromkeys(out))


def make_plan(req: PlanRequest) -> Plan:
    from quantize.spec.recipe import load_recipe

    if req.profile not in PROFILES:
        raise PlanError(f"unknown vLLM profile {req.profile!r}; known: {', '.join(PROFILES)}")
    if not 0.05 <= req.util <= 1.0:
        raise PlanError(f"--gpu-memory-utilization {req.util} is outside (0.05, 1]; vLLM takes "
                        "a fraction of the card, e.g. 0.9")
    if req.gpus < 1 or req.context < 1 or req.concurrency < 1:
        raise PlanError("--gpus, --max-model-len and --concurrency must be positive")
    source = load_source(req.model)
    model = meta(source.config)
    shape = model_shape(source.config, model.config)
    profile = PROFILES[req.profile]
    t_default, _ = serve_defaults(req.gpu)
    batched = max(req.max_num_batched_tokens or t_default, req.concurrency)
    runs = find_runs(req.runs_dir, source.name, req.model)
    if source.run is not None:
        runs = [source.run, *[r for r in runs if r.path != source.run.path]]
    ctx = _Ctx(req, source, model, shape, profile, batched, runs)
    rows = [ctx.baseline()]
    for name in _recipe_list(req.recipes):
        rows.append(ctx.recipe_row(load_recipe(name)))
    rec, kind = _recommend(rows)
    notes = ctx.notes + _general_notes(req, shape, batched)
    kv_model = kv_description(shape, req.gpus, "the recipe's (model dtype unless fp8)")
    return Plan(req, source, shape, rows, rec, kind, batched, list(dict.fromkeys(notes)),
                kv_model, ctx.hints(rows, rec, kind))


def predict(model: str, gpu: Gpu, *, tp: int = 1, util: float = 0.9, context: int = 8192,
            batched: int | None = None, seqs: int | None = None, kv_fp8: bool = False,
            recipe: Recipe | None = None, profile: str = DEFAULT_PROFILE) -> Memory:
    """One vLLM start-up predicted: the numbers behind `GPU KV cache size: N tokens`.
    batched/seqs default to `vllm serve`'s defaults for the GPU."""
    from quantize.checks.preflight import resolve_group_size, targeted_layers

    source = load_source(model)
    mdl = meta(source.config)
    shape = model_shape(source.config, mdl.config)
    t_default, s_default = serve_defaults(gpu)
    group = None
    if recipe is not None:
        group = resolve_group_size(recipe, targeted_layers(mdl, recipe.targets, recipe.ignore))
        plan = recipe_layers(mdl, recipe, group)
    elif source.config.get("quantization_config"):
        plan = published_layers(mdl, source.config["quantization_config"])[0]
    else:
        plan = LayerPlan({}, None)
    weights = estimate_weights(mdl, shape.dtype_bytes, plan).per_rank(tp)
    return vllm_memory(shape, weights, gpu, tp, util, context, batched or t_default,
                       seqs or s_default, 1 if kv_fp8 else shape.dtype_bytes, PROFILES[profile])


MIN_ACCURACY = 0.9  # never recommend a recipe expected (or measured) below 90% recovery


def _recommendable(row: Row) -> bool:
    return row.gate_verdict != "fail" and row.accuracy >= MIN_ACCURACY


def _recommend(rows: list[Row]) -> tuple[Row | None, str]:
    """The most accurate recipe that serves every sequence (ties: more room). When none does,
    the one that serves the most sequences (ties: more accurate): "partial"."""
    ok = [r for r in rows if r.status == "fits" and _recommendable(r)]
    if ok:
        return max(ok, key=lambda r: (r.accuracy, r.memory.max_concurrency if r.memory else 0)), \
            "fits"
    part = [r for r in rows if r.status == "partial" and _recommendable(r) and r.memory]
    if part:
        return max(part, key=lambda r: (r.memory.max_sequences, r.accuracy,
                                        r.memory.max_concurrency) if r.memory else (0, 0, 0)), \
            "partial"
    return None, "none"


def _general_notes(req: PlanRequest, shape: Shape, batched: int) -> list[str]:
    notes = []
    gpu = req.gpu
    head = req.util * gpu.memory_gib + CUDAGRAPH_GIB + CONTEXT_GIB
    if head > gpu.memory_gib:
        outside = gpu.memory_gib * (1 - req.util)
        notes.append(f"--gpu-memory-utilization {req.util} leaves {outside:.2f} GiB outside "
                     f"vLLM's budget, less than the ~{CUDAGRAPH_GIB + CONTEXT_GIB:.1f} GiB of CUDA "
                     "graphs and CUDA context that live there: start-up may run out of memory; "
                     "lower it")
    if shape.max_position and req.context > shape.max_position:
        notes.append(f"--max-model-len {req.context} exceeds the model's max_position_embeddings "
                     f"({shape.max_position}); vLLM refuses it unless you override the limit")
    return notes


@dataclass
class _Ctx:
    req: PlanRequest
    source: ModelSource
    model: Any
    shape: Shape
    profile: VllmProfile
    batched: int
    runs: list[RunInfo]
    notes: list[str] = field(default_factory=list)
    loaded: dict[str, Recipe] = field(default_factory=dict)

    def hints(self, rows: list[Row], rec: Row | None, kind: str) -> list[str]:
        """What would make the request fit: fp8 KV for the chosen recipe, more GPUs."""
        out = []
        if rec is not None and kind == "partial" and rec.kv_dtype != "fp8":
            est = self._estimate(self.loaded.get(rec.recipe))
            if est is not None:
                mem = vllm_memory(self.shape, est.per_rank(self.req.gpus), self.req.gpu,
                                  self.req.gpus, self.req.util, self.req.context, self.batched,
                                  self.req.concurrency, 1, self.profile)
                out.append(f"--kv-cache-dtype fp8 halves the KV bytes: {rec.recipe} would hold "
                           f"{mem.max_sequences} sequences at TP={self.req.gpus}")
        full = [r for r in rows if r.min_tp and _recommendable(r)]
        if kind != "fits" and full:
            best = min(full, key=lambda r: (r.min_tp or 0, -r.accuracy))
            out.append(f"{best.recipe} serves all {self.req.concurrency} sequences with "
                       f"--gpus {best.min_tp} ({best.min_tp_sequences} fit there)")
        elif kind != "fits":
            out.append(f"no recipe serves {self.req.concurrency} x {self.req.context:,} tokens "
                       f"on up to {TP_CANDIDATES[-1]} x {self.req.gpu.name}; lower "
                       "--max-model-len or --concurrency")
        return out

    def _group(self, recipe: Recipe) -> int | None:
        """The recipe's resolved group size; PreflightError when it does not apply."""
        from quantize.checks.preflight import resolve_group_size, targeted_layers

        layers = targeted_layers(self.model, recipe.targets, recipe.ignore)
        if not layers:
            raise PreflightError("the recipe's targets match no layer of this model")
        return resolve_group_size(recipe, layers)

    def _estimate(self, recipe: Recipe | None) -> WeightEstimate | None:
        if recipe is None:
            return estimate_weights(self.model, self.shape.dtype_bytes, self._baseline_plan()[0])
        try:
            group = self._group(recipe)
        except PreflightError:
            return None
        return estimate_weights(self.model, self.shape.dtype_bytes,
                                recipe_layers(self.model, recipe, group))

    def kv_dtype(self, recipe: Recipe | None) -> tuple[str, int]:
        if self.req.kv_cache_dtype == "fp8" or (recipe is not None and recipe.kv_cache == "fp8"):
            return "fp8", 1
        return "auto (model dtype)", self.shape.dtype_bytes

    def _baseline_plan(self) -> tuple[LayerPlan, str]:
        qc = self.source.config.get("quantization_config")
        if qc:
            return published_layers(self.model, qc)
        return LayerPlan({}, None), f"unquantized ({self.shape.dtype_bytes * 8}-bit)"

    def baseline(self) -> Row:
        plan, label = self._baseline_plan()
        est = estimate_weights(self.model, self.shape.dtype_bytes, plan)
        return self._row(BASELINE, label, None, est, "estimated from config.json", None, None)

    def recipe_row(self, recipe: Recipe) -> Row:
        self.loaded[recipe.name] = recipe
        info = SCHEMES[recipe.scheme]
        label = f"{recipe.method} {recipe.scheme}" + (" +kv-fp8" if recipe.kv_cache else "")
        try:
            group = self._group(recipe)
        except PreflightError as exc:
            return self._na(recipe, label, f"recipe does not apply: {exc}")
        est = estimate_weights(self.model, self.shape.dtype_bytes,
                               recipe_layers(self.model, recipe, group))
        run = next((r for r in self.runs if r.recipe == recipe.name), None)
        weights_source = "estimated from config.json"
        if run is not None and run.weights_bytes:
            est = WeightEstimate(run.weights_bytes, int(est.replicated * run.weights_bytes
                                                        / max(est.total, 1)), est.quantized)
            weights_source = f"exported size of {run.path}"
        label += f" g{group}" if group and info.group else ""
        return self._row(recipe.name, label, recipe, est, weights_source, run, group)

    def _na(self, recipe: Recipe, label: str, reason: str) -> Row:
        return Row(recipe.name, label, "-", 0, "-", prior_recovery(recipe), "prior", "n/a",
                   reason, None, None, None, "", None, None)

    def _row(self, name: str, label: str, recipe: Recipe | None, est: WeightEstimate,
             weights_source: str, run: RunInfo | None, group: int | None) -> Row:
        req, shape = self.req, self.shape
        kv_name, kv_bytes = self.kv_dtype(recipe)
        accuracy, acc_source = prior_recovery(recipe), "prior"
        if recipe is None:
            acc_source = "baseline"
        elif run is not None and run.recovery is not None:
            accuracy, acc_source = run.recovery, f"measured ({run.path}/gate/gate.json)"
        if run is not None and run.gate_note:
            self.notes.append(run.gate_note)
        supported, gpu_note = gpu_support(recipe, req.gpu, bool(shape.experts))
        memory, status, reason = self._fit(est, kv_bytes, req.gpus, group)
        if not supported:
            status, reason = "unsupported", gpu_note
        min_tp, min_seq = self._min_tp(est, kv_bytes, group) if supported else (None, None)
        by_dtype = {"auto": kv_bytes_per_token(shape, req.gpus, shape.dtype_bytes),
                    "fp8": kv_bytes_per_token(shape, req.gpus, 1)}
        row = Row(name, label, kv_name, est.total, weights_source, accuracy, acc_source, status,
                  reason, memory, min_tp, min_seq, gpu_note,
                  run.gate_verdict if run else None, None, by_dtype)
        if status in ("fits", "partial"):
            row.serve = self._serve(recipe, run, kv_bytes)
        return row

    def _fit(self, est: WeightEstimate, kv_bytes: int, tp: int,
             group: int | None) -> tuple[Memory | None, str, str]:
        req = self.req
        problem = tp_problem(self.shape, tp, group)
        if problem:
            return None, "no-fit", f"TP={tp} impossible: {problem}"
        mem = vllm_memory(self.shape, est.per_rank(tp), req.gpu, tp, req.util, req.context,
                          self.batched, req.concurrency, kv_bytes, self.profile)
        if mem.weights >= mem.requested:
            return mem, "no-fit", (f"weights need {mem.weights / GIB:.1f} GiB per GPU, the "
                                   f"budget is {mem.requested / GIB:.1f} GiB")
        if mem.max_concurrency < 1:
            return mem, "no-kv", (f"room for {mem.kv_tokens:,} KV tokens, less than one "
                                  f"{req.context:,}-token sequence: vLLM refuses to start")
        if mem.max_sequences < req.concurrency:
            return mem, "partial", (f"only {mem.max_sequences} of {req.concurrency} sequences "
                                    f"at {req.context:,} tokens")
        return mem, "fits", ""

    def _min_tp(self, est: WeightEstimate, kv_bytes: int,
                group: int | None) -> tuple[int | None, int | None]:
        for tp in TP_CANDIDATES:
            mem, status, _ = self._fit(est, kv_bytes, tp, group)
            if status == "fits" and mem is not None:
                return tp, mem.max_sequences
        return None, None

    def _serve(self, recipe: Recipe | None, run: RunInfo | None, kv_bytes: int) -> str:
        req = self.req
        if recipe is None:
            ref = self.source.serve_ref
        elif run is not None and (run.path / "export").is_dir():
            ref = str(run.path / "export")
        else:
            ref = f"runs/{self.source.name}-{recipe.name}/export"
        parts = [f"vllm serve {ref}", f"--tensor-parallel-size {req.gpus}",
                 f"--max-model-len {req.context}", f"--max-num-seqs {req.concurrency}",
                 f"--max-num-batched-tokens {self.batched}",
                 f"--gpu-memory-utilization {req.util}"]
        if kv_bytes == 1:
            parts.append("--kv-cache-dtype fp8")
        cmd = " ".join(parts)
        if recipe is not None and (run is None or not (run.path / "export").is_dir()):
            cmd += f"   # build it first: quantize run {recipe.name} --model {req.model}"
        return cmd
