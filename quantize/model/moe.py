"""Mixture-of-experts facts, read from the model itself: which modules route tokens (the
routers/gates vLLM needs dense), the ignore list that keeps them unquantized, expert coverage
as a typed record, and the check of every exported expert's scales.

Layouts handled (transformers 5.17): Qwen3-MoE and Mixtral (`mlp.gate`, a TopKRouter holding
an [experts, hidden] weight), DeepSeek-V2/V3 (`mlp.gate` with a score-correction bias, shared
experts in `mlp.shared_experts`, the first layers dense), gpt-oss (`mlp.router` with a bias),
Qwen2-MoE style shared-expert gates (`mlp.shared_expert_gate`, an nn.Linear to 1 output), and
older remote-code models whose router is a plain `nn.Linear` named `gate`. Expert projections
(`gate_proj`, `gate_up_proj`) are not routers: only the last name component decides.

Exported experts (llm-compressor unfuses transformers' 3-D expert tensors) are named
`...experts.<index>.<proj>`; their scales are `weight_scale` (compressed-tensors) or `scales`
(native GPTQ/AWQ).
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from quantize.errors import QuantizeError
from quantize.model.config import ModelConfig

if TYPE_CHECKING:
    import torch

# the last component of a module name that routes tokens to experts, or gates a shared expert
ROUTER_NAMES = ("gate", "router", "shared_expert_gate")
COVERAGE_FILE = "moe_coverage.json"
_EXPERT_SCALE = re.compile(r"^(?P<layer>.+)\.experts\.(?P<expert>\d+)\.(?P<proj>[^.]+)\."
                           r"(?P<kind>weight_scale|scales)$")


def _has_experts(parent: Any) -> bool:
    return any(n == "experts" for n, _ in parent.named_children())


def router_modules(model: Any) -> dict[str, torch.nn.Module]:
    """Every module that routes tokens to experts or gates a shared expert, by name: its last
    name component is a router name, its parent holds `experts` (or it gates a shared expert),
    and it has a 2-D weight. Works on a meta-device model."""
    modules = dict(model.named_modules())
    out: dict[str, torch.nn.Module] = {}
    for name, mod in modules.items():
        parent_name, _, last = name.rpartition(".")
        if last not in ROUTER_NAMES:
            continue
        weight = getattr(mod, "weight", None)
        if weight is None or getattr(weight, "ndim", 0) != 2:
            continue
        if last == "shared_expert_gate" or _has_experts(modules.get(parent_name, model)):
            out[name] = mod
    return out


def routing_modules(model: Any) -> dict[str, torch.nn.Module]:
    """The routers proper (not shared-expert gates): the modules whose output picks experts."""
    return {n: m for n, m in router_modules(model).items()
            if not n.endswith("shared_expert_gate")}


def is_moe(model: Any) -> bool:
    return bool(routing_modules(model))


def derived_ignore(model: Any) -> list[str]:
    """The module names a recipe must leave unquantized on this model: every router and
    shared-expert gate (vLLM loads them as dense ReplicatedLinear/GateLinear layers)."""
    return sorted(router_modules(model))


def quantized_routers(model: Any, targets: list[str], ignore: list[str]) -> list[str]:
    """Routers/gates that `targets` minus `ignore` would quantize, matched exactly as
    compressed-tensors matches them."""
    from compressed_tensors.utils import is_match

    return [n for n, m in router_modules(model).items()
            if any(is_match(n, m, t) for t in targets) and not is_match(n, m, ignore)]


def check_routers_dense(model: Any, targets: list[str], ignore: list[str],
                        error: type[QuantizeError] = QuantizeError) -> None:
    """Refuse, before calibration, a recipe whose targets would quantize a router."""
    bad = quantized_routers(model, targets, ignore)
    if bad:
        raise error(problem=f"the recipe would quantize {len(bad)} MoE router/gate layer(s) "
                            f"(e.g. {bad[0]}), which vLLM needs dense",
                    hint="add them to `ignore:` (e.g. 're:.*mlp\\.gate$') or narrow `targets:`")


def fused_expert_projections(model: Any, targets: list[str], ignore: list[str]
                             ) -> list[tuple[str, int, int, int]]:
    """(name, in_features, out_features, experts) of the per-expert Linear layers the engine
    will make of transformers 5's fused 3-D expert tensors and quantize (llm-compressor unfuses
    them when `Linear` is targeted), one per experts module and projection, named as expert
    0's and standing for `experts` identical layers. Layouts:
    [E, out, in], or [E, in, out] where the module says `is_transposed` (gpt-oss); a
    concatenated `gate_up_proj` holds gate and up halves along out. Beside the `Linear` class,
    a target or ignore entry matches a projection by that name, as compressed-tensors matches
    the per-expert Linears once they are unfused (`re:...experts.*down_proj$`)."""
    from compressed_tensors.utils import is_match, match_name

    named = [t for t in targets if t != "Linear"]
    if "Linear" not in targets and not named:
        return []
    out: list[tuple[str, int, int, int]] = []
    for name, mod in model.named_modules():
        if not type(mod).__name__.endswith("Experts") or is_match(name, mod, ignore):
            continue
        for pname, p in mod.named_parameters(recurse=False):
            if p.ndim != 3:
                continue
            for proj, in_f, out_f, e in expert_linears(mod, pname, tuple(p.shape)):
                full = f"{name}.0.{proj}"
                chosen = "Linear" in targets or any(match_name(full, t) for t in named)
                if chosen and not any(match_name(full, i) for i in ignore):
                    out.append((full, in_f, out_f, e))
    return out


def expert_linears(experts: Any, pname: str, shape: tuple[int, ...]
                   ) -> list[tuple[str, int, int, int]]:
    """(projection, in_features, out_features, experts) of the per-expert Linears that one
    fused 3-D tensor `pname` of the experts module becomes: [E, out, in], or [E, in, out]
    where the module says `is_transposed` (gpt-oss); a concatenated `gate_up_proj` holds gate
    and up halves along out."""
    e, a, b = (int(x) for x in shape)
    out_f, in_f = (b, a) if getattr(experts, "is_transposed", False) else (a, b)
    if pname == "gate_up_proj":
        return [(proj, in_f, out_f // 2, e) for proj in ("gate_proj", "up_proj")]
    return [(pname, in_f, out_f, e)]


_EXPERT_LAYER = re.compile(r"^(?P<base>.+\.experts)\.(?P<e>\d+)\."
                           r"(?P<proj>gate_proj|up_proj|down_proj)$")


def fused_source_weight(get: Any, shape_of: Any, keys: set[str], name: str,
                        shape: tuple[int, ...], all_keys: set[str]) -> torch.Tensor | None:
    """A source model's weight for one exported expert layer `name` (`...experts.<i>.<proj>`),
    cut from transformers 5's fused tensors: `gate_up_proj` [E, 2I, H] holds gate then up
    (Qwen3-MoE, Mixtral, DeepSeek), or [E, H, 2I] transposed with gate and up interleaved
    (gpt-oss); `down_proj` [E, H, I] or [E, I, H]. `get(key)` reads a tensor of this shard
    (`keys`), `shape_of(key)` the shape of any of the source's tensors (`all_keys`); `shape` is
    the exported layer's [out, in]. None when this shard holds no such tensor.

    The layout is read from both fused tensors together: untransposed, gate_up's last
    dimension and down's middle one are both H; transposed, gate_up's middle and down's last
    are. One tensor alone cannot tell a square one (gpt-oss-20b's down_proj is 2880 x 2880;
    the tiny fixture's gate_up 128 x 128), which made verify compare gpt-oss experts with
    the wrong orientation (cosine 0.07)."""
    m = _EXPERT_LAYER.match(name)
    if m is None:
        return None
    gate_up, down = m["base"] + ".gate_up_proj", m["base"] + ".down_proj"
    fused = down if m["proj"] == "down_proj" else gate_up
    if fused not in keys:
        return None
    t = get(fused)[int(m["e"])].float()
    out_f, _ = shape
    if gate_up in all_keys and down in all_keys:
        transposed = tuple(shape_of(gate_up))[1] == tuple(shape_of(down))[2]
    else:  # a layout with one fused tensor: by the exported layer's shape
        transposed = t.shape[0] == shape[1] and t.shape[1] != shape[1]
    if transposed:
        t = t.transpose(0, 1)
    if m["proj"] != "down_proj":
        half = {"gate_proj": 0, "up_proj": 1}[m["proj"]]
        t = t[half::2] if transposed else t[half * out_f:(half + 1) * out_f]
    return t if tuple(t.shape) == tuple(shape) else None


def config_is_moe(config: ModelConfig) -> bool:
    """Whether config.json describes a mixture-of-experts model (quantize.model.config)."""
    from quantize.model.config import model_shape

    try:
        return model_shape(config).experts > 0
    except Exception:  # a config model_shape cannot read is not one this check can judge
        return False


def routing_kind(config: ModelConfig) -> str:
    """How the model picks experts, in vLLM's terms: `grouped-topk` (DeepSeek-V2/V3: sigmoid
    scores, expert groups, a correction bias; RoutingMethodType.DeepSeekV3) or `softmax-topk`
    (Mixtral, Qwen-MoE, gpt-oss: Default/Renormalize)."""
    cfg = config.text
    if (cfg.model_type or "").startswith("deepseek") or cfg.topk_method in (
            "group_limited_greedy", "noaux_tc") or int(cfg.n_group or 1) > 1:
        return "grouped-topk"
    return "softmax-topk"


def silu_experts(config: ModelConfig) -> bool:
    """Whether the experts compute SiLU(gate) * up (gpt-oss clamps and biases its SwiGLU:
    vLLM's MoEActivation.SWIGLUOAI)."""
    cfg = config.text
    act = cfg.hidden_act if cfg.has("hidden_act") else "silu"
    return cfg.model_type != "gpt_oss" and act == "silu"


def transformers_load_problem(config: ModelConfig) -> str | None:
    """Why transformers 5.17 cannot load this compressed-tensors MoE export, or None.

    It re-fuses the exported per-expert tensors into its 3-D expert parameters through
    `DecompressExperts` (transformers/integrations/compressed_tensors.py), whose stand-in
    module carries `weight_packed`, `weight_scale` and `weight_shape` only: the zero points
    of asymmetric experts are never collected, and compressed-tensors' decompress asserts
    ("Asymmetric quant requires zero-point values"); the load ends in "We encountered some
    issues during automatic conversion of the weights"."""
    from quantize.model.qconfig import read_quant_config

    qc = read_quant_config(config)
    if qc is None or qc.native or not config_is_moe(config):
        return None
    if any(g.weights is not None and not g.weights.symmetric for g in qc.groups):
        return ("transformers 5.17 drops the zero points of asymmetric MoE experts when it "
                "re-fuses them (integrations/compressed_tensors.py DecompressExperts)")
    return None


def linearize(model: Any) -> Any:
    """Replace transformers 5's fused 3-D expert tensors with one nn.Linear per expert
    projection (`experts.<i>.gate_proj/up_proj/down_proj`): the form calibration needs and
    the layout exports are written in. llm-compressor's own per-expert modules
    (`LinearExperts2D.from_experts_module`), applied one MoE layer at a time: its
    `linearize_moe` (what `oneshot` falls back to for a fused model) holds every fused module
    until the last one is replaced, so the experts sit in memory twice (Qwen3-30B-A3B on an
    H200: 110.97 GiB GPU peak for 56.9 GiB of weights, pipeline and plain oneshot alike).
    Here each fused module's tensors are released as soon as its replacement is in, and the
    heap memory the copy freed goes back to the system (quantize.model.release;
    bench/moe_load.py and bench/moe_tiers.py measure it on the CPU). Its `load_quantizable_moe`
    would avoid the copy entirely, but in transformers 5.17 it imports every model's image
    processor (torchvision, which this project does not install). A dense model is returned
    as is."""
    if not is_moe(model):
        return model
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D
    from llmcompressor.modeling.moe.linearize import get_non_linearized_moes

    from quantize.model.release import release_module, trim_heap

    names = [name for name, _ in get_non_linearized_moes(model)]
    for name in names:
        fused = model.get_submodule(name)
        make = LinearExperts2D.get_linear_experts_cls(fused.__class__).from_experts_module
        with _built_on(fused):
            model.set_submodule(name, make(fused, getattr(fused, "config", model.config)))
        release_module(fused)
        trim_heap()
    return model


def _built_on(fused: Any) -> Any:
    """Where the per-expert Linears are created: on the fused module's own device when it
    is one plain device (a resident GPU model), else torch's default (the host).
    `from_experts_module` builds them on the default device and copies each expert into
    them, then moves them to the fused module's device: on a GPU-resident model every
    expert made a round trip through host memory (1.1 s a layer for Qwen3-30B-A3B's 128
    experts on an H200, a quarter of a 12-layer fp8-dynamic run; bench/RESULTS.md). An
    offloaded module (compressed-tensors' caches: the onload placement's host and disk
    tiers) keeps the library's path."""
    import contextlib

    import torch
    from compressed_tensors.offload.cache import OffloadCache

    devices = set()
    for mod in fused.modules():
        if isinstance(mod._parameters, OffloadCache) or isinstance(mod._buffers, OffloadCache):
            return contextlib.nullcontext()
        devices |= {t.device for t in (*mod._parameters.values(), *mod._buffers.values())
                    if t is not None}
    return torch.device(devices.pop()) if len(devices) == 1 else contextlib.nullcontext()


def load_linearized(ckpt: Path, config: ModelConfig) -> Any:
    """A compressed-tensors MoE export loaded as transformers would load it, minus the
    re-fusing that drops asymmetric zero points (`transformers_load_problem`): the model built
    from config with one Linear per expert projection, compressed-tensors' quantization config
    applied, the stored tensors loaded as they are (by the model's names: Mixtral stores
    `block_sparse_moe.`, quantize.model.moe_load), then compressed-tensors' own
    `decompress_model` (the same steps transformers' CompressedTensorsHfQuantizer takes for a
    dense model). fp32, on the CPU; activation quantization stays compressed-tensors', made
    per token on every input shape (moe_load.per_token_inputs)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from quantize.model import moe_load
    from quantize.model.config import hf_config
    from quantize.model.qconfig import compress_as_stored

    with no_init_weights():
        model = AutoModelForCausalLM.from_config(copy.deepcopy(hf_config(config)),
                                                 dtype=torch.float32).eval()
    linearize(model)
    name = moe_load.model_namer(model)
    compressor = compress_as_stored(model, moe_load.in_model_terms(config, name))  # as stored
    missing, _ = model.load_state_dict(moe_load.stored_tensors(ckpt, name), strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and
                                          getattr(model.config, "tie_word_embeddings", False))]
    if missing:
        raise QuantizeError(path=ckpt, problem=f"no stored tensor for {missing[:3]}: the "
                                               "export is incomplete", hint="re-run it")
    compressor.decompress_model(model)
    with torch.no_grad():  # FP4 (nvfp4, mxfp4) decompresses into bf16 weights: back to fp32
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.float()
    moe_load.per_token_inputs(model)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


# --- coverage, typed ------------------------------------------------------------------------
class LayerCoverage(BaseModel):
    """Tokens the router of one MoE layer sent to each expert during calibration."""

    layer: str
    experts: int
    top_k: int
    tokens: int  # tokens routed (each counts top_k times in `counts`)
    counts: list[int]
    min: int
    median: float
    max: int
    unrouted: list[int] = Field(default_factory=list)  # experts that got no token

    @classmethod
    def from_counts(cls, layer: str, counts: list[int], top_k: int) -> LayerCoverage:
        return cls(layer=layer, experts=len(counts), top_k=top_k,
                   tokens=sum(counts) // max(top_k, 1), counts=counts, min=min(counts),
                   median=float(statistics.median(counts)), max=max(counts),
                   unrouted=[i for i, c in enumerate(counts) if c == 0])


class ExpertCoverage(BaseModel):
    """Expert coverage of one calibration: per MoE layer, and whether every expert's weights
    saw calibration data (llm-compressor's `moe_calibrate_all_experts` sends every token
    through every expert, whatever the router picks)."""

    calibrated: bool  # the recipe calibrates on data (RTN/FP8-dynamic do not)
    all_experts_calibrated: bool
    layers: list[LayerCoverage] = Field(default_factory=list)

    @property
    def unrouted(self) -> list[str]:
        return [f"{lay.layer}.experts.{e}" for lay in self.layers for e in lay.unrouted]

    @property
    def never_calibrated(self) -> list[str]:
        """Experts whose weights saw no calibration token (empty for data-free recipes)."""
        if not self.calibrated or self.all_experts_calibrated:
            return []
        return self.unrouted

    def summary(self) -> dict[str, Any]:
        counts = [c for lay in self.layers for c in lay.counts]
        return {"layers": len(self.layers), "experts": len(counts),
                "min": min(counts, default=0),
                "median": float(statistics.median(counts)) if counts else 0.0,
                "max": max(counts, default=0), "unrouted": len(self.unrouted),
                "never_calibrated": len(self.never_calibrated),
                "all_experts_calibrated": self.all_experts_calibrated,
                "calibrated": self.calibrated}


def read_coverage(folder: Path) -> ExpertCoverage | None:
    path = folder / COVERAGE_FILE
    if not path.is_file():
        return None
    return ExpertCoverage.model_validate_json(path.read_text())


# --- exported scales --------------------------------------------------------------------
class ScaleCheck(BaseModel):
    """Every exported expert's scales: NaN/Inf, or all zero (a degenerate expert)."""

    experts: int  # (layer, expert) pairs found
    tensors: int
    nonfinite: list[str] = Field(default_factory=list)  # tensor names
    all_zero: list[str] = Field(default_factory=list)


def _check_tensor(name: str, t: torch.Tensor, out: ScaleCheck) -> None:
    import torch

    f = t.float()
    if not bool(torch.isfinite(f).all()):
        out.nonfinite.append(name)
    elif not bool(f.abs().amax() > 0):
        out.all_zero.append(name)


def check_expert_scales(ckpt: Path) -> ScaleCheck:
    """Read every `...experts.<i>.<proj>.weight_scale|scales` tensor of an export."""
    from safetensors import safe_open

    out = ScaleCheck(experts=0, tensors=0)
    seen: set[tuple[str, str]] = set()
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for key in fh.keys():  # noqa: SIM118
                m = _EXPERT_SCALE.match(key)
                if m is None:
                    continue
                seen.add((m["layer"], m["expert"]))
                out.tensors += 1
                _check_tensor(key, fh.get_tensor(key), out)
    out.experts = len(seen)
    return out
