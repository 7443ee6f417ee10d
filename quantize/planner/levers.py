"""The levers of a plan: for the recommended row (or the closest one when nothing serves
everyone), what each `vllm serve` flag people reach for would change, in memory and in
sequences, and what it costs where that was measured; and which side of the start-up boundary
a request is on, by how much.

Each lever is re-planned with the same memory model (quantize.planner.memory.vllm_memory), so
its effect is the model's, not a rule of thumb:

- `--kv-cache-dtype fp8`: one byte per KV value instead of two;
- `--cpu-offload-gb N`: N GiB of weights kept in host memory (vLLM reads them over PCIe on
  every forward pass), offered only for profiles where it works: in vLLM 0.26 it was measured
  to change nothing (memory.PROFILES);
- `--max-num-batched-tokens`: the chunked-prefill budget sets the profile run's activation
  peak (memory.activation_peak);
- `--enforce-eager`: CUDA graphs are not captured; they live outside vLLM's budget
  (memory.CUDAGRAPH_GIB), so the card's headroom grows by that and
  --gpu-memory-utilization can rise by that share; decoding without graphs is slower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from quantize.model.config import Shape
from quantize.planner.gpus import Gpu
from quantize.planner.memory import CUDAGRAPH_GIB, GIB, Memory, VllmProfile, vllm_memory
from quantize.planner.recommend import Row


@dataclass(frozen=True)
class Lever:
    flag: str  # the `vllm serve` flag as it would be added
    effect: str  # what it changes, in words with numbers
    sequences: int | None  # sequences that fit at --max-model-len with it (None: unchanged)


def margin(mem: Memory | None, concurrency: int) -> str:
    """Which side of the boundary: how many more (or fewer) sequences than asked fit, in %
    of the KV cache the request needs; vLLM refuses to start below one sequence."""
    if mem is None:
        return "-"
    if mem.max_concurrency < 1:
        return f"refused ({mem.max_concurrency:.2f} of 1 sequence)"
    pct = 100 * (mem.max_concurrency / concurrency - 1)
    return f"{pct:+.1f} %"


def boundary(mem: Memory | None, concurrency: int) -> str:
    """The boundary in words, for the recommendation."""
    if mem is None:
        return ""
    need = concurrency * mem.request_bytes
    have = mem.kv_tokens * mem.kv_bytes_per_token
    if have >= need:
        return (f"fits with {(have - need) / GIB:.2f} GiB of KV cache to spare "
                f"({margin(mem, concurrency)} of the {need / GIB:.2f} GiB needed)")
    return (f"short by {(need - have) / GIB:.2f} GiB of KV cache "
            f"({margin(mem, concurrency)}; {need / GIB:.2f} GiB needed)")


@dataclass(frozen=True)
class LeverInputs:
    """What re-planning a row needs: the request's settings and the row's resident weights."""

    shape: Shape
    gpu: Gpu
    weights: int  # the row's weights per GPU before any offload (resident bytes)
    tp: int
    util: float
    context: int
    batched: int
    seqs: int
    kv_bytes: int
    profile: VllmProfile
    offload_gib: float
    eager: bool

    def plan(self, *, kv_bytes: int | None = None, batched: int | None = None,
             offload_gib: float | None = None, util: float | None = None) -> Memory:
        return vllm_memory(self.shape, self.weights, self.gpu, self.tp,
                           self.util if util is None else util, self.context,
                           batched or self.batched, self.seqs, kv_bytes or self.kv_bytes,
                           self.profile, self.offload_gib if offload_gib is None else offload_gib,
                           self.eager)


def levers(row: Row, inp: LeverInputs, concurrency: int) -> list[Lever]:
    """Each lever not already pulled, re-planned for `row`."""
    base = row.memory
    if base is None:
        return []
    out: list[Lever] = []
    if inp.kv_bytes != 1:
        m = inp.plan(kv_bytes=1)
        out.append(Lever("--kv-cache-dtype fp8", f"KV bytes halved: {m.kv_tokens:,} KV tokens "
                         f"(from {base.kv_tokens:,})", m.max_sequences))
    need = concurrency * base.request_bytes
    have = base.kv_tokens * base.kv_bytes_per_token
    if need > have and base.weights > GIB and inp.profile.cpu_offload_effective:
        # the shortfall, at most all weights but 1 GiB, in tenths of a GiB
        gib = min(math.ceil((need - have) / GIB * 10 + 1), math.floor(
            (base.weights - GIB) / GIB * 10)) / 10
        if gib > 0:
            m = inp.plan(offload_gib=inp.offload_gib + gib)
            out.append(Lever(f"--cpu-offload-gb {inp.offload_gib + gib:.1f}",
                             f"{gib:.1f} GiB more of the weights in host memory: "
                             f"{m.kv_tokens:,} KV tokens; every forward pass then reads them "
                             "over PCIe (decode speed not measured here)", m.max_sequences))
    if inp.batched > 2048:
        m = inp.plan(batched=2048)
        gain = (base.activation - m.activation) / GIB
        if gain > 0.01:
            out.append(Lever("--max-num-batched-tokens 2048",
                             f"activation peak {base.activation / GIB:.2f} -> "
                             f"{m.activation / GIB:.2f} GiB: {m.kv_tokens:,} KV tokens; long "
                             "prompts prefill in more chunks", m.max_sequences))
    if not inp.eager:
        util = min(1.0, inp.util + CUDAGRAPH_GIB * GIB / base.total)
        m = inp.plan(util=util)
        out.append(Lever(f"--enforce-eager --gpu-memory-utilization {util:.3f}",
                         f"no CUDA graphs (~{CUDAGRAPH_GIB:.1f} GiB outside the budget; 0.99 "
                         "GiB measured for Llama-3.1-8B): their share goes to the KV cache, "
                         f"{m.kv_tokens:,} KV tokens; decoding without graphs is slower",
                         m.max_sequences))
    return out
