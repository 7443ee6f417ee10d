"""vLLM's KV budget on one GPU, as vllm/v1/worker/gpu_worker.py
(Worker.determine_available_memory) and vllm/utils/mem_utils.py (memory_profiling) compute it:

    available = total x gpu_memory_utilization - weights - torch activation peak of the
                profile run - non-torch memory (NCCL, cuBLAS workspaces...)

with the activation peak modelled from the profile run (a forward pass of
max_num_batched_tokens tokens, then a dummy sampler pass over max_num_seqs x vocab logits)
and constants calibrated against published vLLM start-up logs (PROFILES). KV tokens =
floor(available / (16 x bytes per token)) x 16 (vllm/v1/core/kv_cache_utils.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from quantize.model.config import Shape, model_shape
from quantize.planner.gpus import Gpu
from quantize.planner.kv import BLOCK, kv_bytes_per_token, request_bytes
from quantize.planner.sources import load_source
from quantize.planner.weights import (
    LayerPlan,
    WeightEstimate,
    estimate_weights,
    meta,
    published_layers,
    published_quant,
    recipe_layers,
)
from quantize.recipe.recipe import Recipe

GIB = 1 << 30


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
    # what vLLM holds beside the checkpoint's tensors (resident_extra): read from the engine
    # for 0.26; the older profiles were fitted to logs with it inside their constants
    resident_misc_gib: float = 0.0
    resident_tables: bool = False
    # with CUDA graphs on, the profile run's peak also held fp32 logits for this many tokens
    # (at most max_num_batched_tokens) and two [tokens, hidden] buffers; 0: not seen
    graph_logit_tokens: int = 0
    # whether --cpu-offload-gb moved weights off the GPU in this version's engine
    cpu_offload_effective: bool = True


PROFILES: dict[str, VllmProfile] = {
    # vLLM 0.26.0 on an H200, read from the engine itself (its worker's memory profile, its
    # "GPU KV cache size" line): the forward peak over max_num_batched_tokens x hidden is
    # 3.82 hidden-sized buffers besides the MLP (1.78 GiB at 16,384 tokens, 0.21 GiB at 2,048
    # on Llama-3.1-8B); the dummy sampler never set the peak there, so its constant is the
    # largest those rows allow (6.9 bytes per logit: a plan never counts it short); non-torch
    # 0.225 GiB on one GPU. The V2 model runner captures CUDA graphs after sizing the cache
    # (v1/worker/gpu/model_runner.py profile_cudagraph_memory returns 0), so graphs stay
    # outside the budget as in 0.19. Tensor parallelism was not measured: 0.19's value.
    # Measured again on 2026-12-05 (bench/results/2026-12-05-plan-vs-vllm.json): with CUDA
    # graphs on, a 24 GB card's settings (2,048 batched tokens, 256 sequences) peaked at
    # 1.01 GiB where --enforce-eager peaked at 0.21: exactly 2,048 tokens' fp32 logits over
    # the 128,256-token vocabulary plus two [2,048, 4,096] bf16 buffers (within 44 KiB); at
    # 16,384 batched tokens the forward (1.78 GiB) stayed the peak, so the term is capped at
    # the 2,048 tokens measured. And --cpu-offload-gb 8 changed nothing in 0.26's V2 runner:
    # weights 15.0 GiB on the GPU, the same KV tokens, the same decode speed (194 against 196
    # tokens/s): the plan counts no offload for this profile.
    "0.26": VllmProfile("0.26", 6.9, 3.82, 0.225, 2.1,
                        "measured: vLLM 0.26.0 on an H200 (bench/results/"
                        "2026-12-04-plan-vs-vllm.json, 2026-12-05-plan-vs-vllm.json)", 0.05,
                        True, graph_logit_tokens=2048, cpu_offload_effective=False),
    "0.19": VllmProfile("0.19", 15.4, 4.25, 0.25, 2.1,
                        "llm-d-incubation/llm-d-planner accuracy/results/v0.19.0/logs (H100)"),
    "0.11": VllmProfile("0.11", 38.5, 4.25, 0.13, 0.55,
                        "llm-d/llm-d-benchmark config_explorer/empirical-vllm-memory-results.md"),
}
DEFAULT_PROFILE = "0.26"
# Not in the KV budget (vLLM 0.19 and 0.26 capture CUDA graphs after sizing the cache), but on
# the card: the graph pool (0.5-1.9 GiB in the v0.19 logs; 0.99 GiB for Llama-3.1-8B at
# max_num_seqs 1024 with vLLM 0.26 on an H200, none with --enforce-eager) and the CUDA context.
CUDAGRAPH_GIB = 1.0
CONTEXT_GIB = 0.5


def resident_extra(shape: Shape, est: WeightEstimate, gpu: Gpu, tp: int,
                   profile: VllmProfile) -> int:
    """Bytes per GPU that vLLM holds beside the stored weights, measured on an H200 with vLLM
    0.26 (model_memory_usage against the planner's tensor sum, Llama-3.1-8B): the rotary
    cos/sin table (max_position x head_dim at the model dtype: 32 MiB there), 16-45 MiB of
    allocator rounding and kernel workspaces (the profile's resident_misc_gib, the top of that
    range), and on Hopper the Machete kernel's zero points at 16 bits where the checkpoint
    packs them at 4 (+0.16 GiB for the 8B at group 64; Marlin keeps them packed)."""
    if not profile.resident_tables:
        return int(profile.resident_misc_gib * GIB)
    rotary = (shape.max_position or 0) * shape.head_dim * shape.dtype_bytes
    machete = 0
    if gpu.capability[0] == 9 and est.zero_points:
        machete = est.zero_points * (shape.dtype_bytes * 8 - est.zero_point_bits) // 8 // tp
    return rotary + machete + int(profile.resident_misc_gib * GIB)


def serve_defaults(gpu: Gpu) -> tuple[int, int]:
    """`vllm serve` max_num_batched_tokens / max_num_seqs defaults for this card
    (EngineArgs.get_batch_defaults, vllm/engine/arg_utils.py)."""
    return (8192, 1024) if gpu.large_defaults else (2048, 256)


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
    offloaded: int  # weight bytes --cpu-offload-gb keeps in host memory (at least that)
    available: int
    kv_bytes_per_token: int
    kv_tokens: int
    request_bytes: int
    max_concurrency: float

    @property
    def max_sequences(self) -> int:
        return max(0, math.floor(self.max_concurrency + 1e-9))


def activation_peak(shape: Shape, tp: int, batched: int, seqs: int,
                    profile: VllmProfile, eager: bool = False) -> tuple[int, int]:
    """The profile run's torch peak: (forward at max_num_batched_tokens, dummy sampler);
    with CUDA graphs on (not `eager`), the forward is at least the profile's logits term."""
    b = shape.dtype_bytes
    mlp = 3 * math.ceil(shape.intermediate / tp) if shape.intermediate else 0
    if shape.experts:
        moe = (shape.experts_per_token * 3 * math.ceil(shape.moe_intermediate / tp)
               + 3 * math.ceil(shape.shared_intermediate / tp))
        mlp = max(moe, mlp if shape.dense_mlp_layers else 0)
    attn = (2 * shape.heads + 2 * shape.kv_heads) * shape.head_dim // tp
    forward = int(batched * b * (max(mlp, attn) + profile.hidden_factor * shape.hidden))
    if not eager and profile.graph_logit_tokens:
        t = min(batched, profile.graph_logit_tokens)
        forward = max(forward, t * (shape.vocab * 4 + 2 * shape.hidden * b))
    sampler = int(min(seqs, batched) * shape.vocab * profile.sampler_bytes_per_logit)
    return forward, sampler


def vllm_memory(shape: Shape, weights_rank: int, gpu: Gpu, tp: int, util: float, context: int,
                batched: int, seqs: int, kv_bytes: int, profile: VllmProfile,
                cpu_offload_gib: float = 0.0, eager: bool = False) -> Memory:
    """`cpu_offload_gib`: vLLM's --cpu-offload-gb. It moves whole parameters to host memory
    until at least that many GiB are there (model_executor/offloader/uva.py), so the GPU holds
    at most weights - that: counted at exactly that, a plan never counts KV it lacks."""
    total = gpu.memory_bytes
    requested = int(total * util)
    forward, sampler = activation_peak(shape, tp, batched, seqs, profile, eager)
    activation = max(forward, sampler)
    nontorch = int((profile.nontorch_gib_tp if tp > 1 else profile.nontorch_gib_single) * GIB)
    offloaded = min(weights_rank, int(cpu_offload_gib * GIB)) \
        if profile.cpu_offload_effective else 0
    weights_rank -= offloaded
    available = requested - weights_rank - activation - nontorch
    per_token = kv_bytes_per_token(shape, tp, kv_bytes)
    blocks = max(0, available) // (per_token * BLOCK) if per_token else 0
    per_request = request_bytes(shape, tp, kv_bytes, context, batched)
    concurrency = (blocks * BLOCK * per_token) / per_request if per_request else 0.0
    return Memory(total, requested, weights_rank, activation, forward, sampler, nontorch,
                  offloaded, available, per_token, blocks * BLOCK, per_request, concurrency)


def predict(model: str, gpu: Gpu, *, tp: int = 1, util: float = 0.9, context: int = 8192,
            batched: int | None = None, seqs: int | None = None, kv_fp8: bool = False,
            recipe: Recipe | None = None, profile: str = DEFAULT_PROFILE,
            cpu_offload_gib: float = 0.0, eager: bool = False) -> Memory:
    """One vLLM start-up predicted: the numbers behind `GPU KV cache size: N tokens`.
    batched/seqs default to `vllm serve`'s defaults for the GPU. `eager` (--enforce-eager)
    leaves the graphs' pool outside the budget as before (CUDAGRAPH_GIB) and, where the
    profile says so, a smaller profile peak (VllmProfile.graph_logit_tokens)."""
    from quantize.model.layers import resolve_group_size, targeted_layers

    source = load_source(model)
    mdl = meta(source.config)
    shape = model_shape(source.config, mdl.config)
    t_default, s_default = serve_defaults(gpu)
    if recipe is not None:
        group = resolve_group_size(recipe, targeted_layers(mdl, recipe.targets, recipe.ignore))
        plan = recipe_layers(mdl, recipe, group, shape.dtype_bytes)
    else:  # the checkpoint as published (or unquantized)
        qc = published_quant(source.config)
        plan = published_layers(mdl, qc)[0] if qc is not None else LayerPlan({}, None)
    est = estimate_weights(mdl, shape.dtype_bytes, plan)
    weights = est.per_rank(tp) + resident_extra(shape, est, gpu, tp, PROFILES[profile])
    return vllm_memory(shape, weights, gpu, tp, util, context, batched or t_default,
                       seqs or s_default, 1 if kv_fp8 else shape.dtype_bytes, PROFILES[profile],
                       cpu_offload_gib, eager)
