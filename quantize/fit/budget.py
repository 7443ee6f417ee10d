"""The weight budget per GPU: what the planner's memory model leaves for weights once the KV
cache of C sequences of L tokens is reserved.

vLLM's KV budget on one GPU is (planner/memory.py, vLLM's determine_available_memory)

    available = total x util - weights - activation peak - non-torch memory

and C sequences of L tokens need C x request_bytes of it, in whole 16-token blocks. So the
weights a GPU can hold are `available(weights=0) - KV needed`; the whole model's budget
follows from the planner's tensor-parallel split (replicated tensors on every rank, the rest
divided by the TP size). Nothing here re-models memory: every number is
quantize.planner.memory.vllm_memory's.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from quantize.errors import FitError
from quantize.model.config import Shape
from quantize.planner.gpus import Gpu
from quantize.planner.kv import BLOCK
from quantize.planner.memory import GIB, PROFILES, Memory, serve_defaults, vllm_memory
from quantize.planner.recommend import tp_problem
from quantize.planner.rows import TP_CANDIDATES

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "t": 10**12,
          "tb": 10**12, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """`120MB`, `0.5GiB`, `90M`, `123456789` -> bytes (decimal units, binary with `i`)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise FitError(problem=f"--max-weights {text!r} is not a positive size",
                       hint="write e.g. 120MB, 0.5GiB or a byte count")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class Serving:
    """What the model must serve: GPUs, context, users, KV dtype."""

    gpu: Gpu
    gpus: int = 1
    context: int = 32768
    concurrency: int = 16
    kv_fp8: bool = False
    util: float = 0.9
    profile: str = "0.19"

    @property
    def batched(self) -> int:
        """vLLM's max_num_batched_tokens (its default for the card, at least C)."""
        return max(serve_defaults(self.gpu)[0], self.concurrency)

    def kv_bytes(self, shape: Shape) -> int:
        return 1 if self.kv_fp8 else shape.dtype_bytes

    def memory(self, shape: Shape, weights_per_gpu: int) -> Memory:
        return vllm_memory(shape, weights_per_gpu, self.gpu, self.gpus, self.util, self.context,
                           self.batched, self.concurrency, self.kv_bytes(shape),
                           PROFILES[self.profile])

    def describe(self) -> str:
        kv = "fp8" if self.kv_fp8 else "auto"
        return (f"{self.gpus} x {self.gpu.label or self.gpu.name}, {self.context:,} tokens x "
                f"{self.concurrency} users, KV {kv}")


@dataclass(frozen=True)
class Budget:
    """Bytes the weights may take: per GPU, and for the whole model (what the knapsack
    fills). `serving` is None when the budget was given directly (--max-weights)."""

    total: int
    per_gpu: int | None = None
    serving: Serving | None = None
    kv_needed: int = 0  # KV bytes per GPU reserved for C x L tokens
    activation: int = 0
    nontorch: int = 0
    requested: int = 0

    def lines(self) -> list[str]:
        if self.serving is None or self.per_gpu is None:
            return [f"weight budget: {self.total / 1e6:,.1f} MB (--max-weights)"]
        s = self.serving
        return [f"serving: {s.describe()}",
                f"per GPU: {self.requested / GIB:.2f} GiB (x{s.util}) - activations "
                f"{self.activation / GIB:.2f} - non-torch {self.nontorch / GIB:.2f} - KV "
                f"{self.kv_needed / GIB:.2f} = {self.per_gpu / GIB:.2f} GiB for weights",
                f"weight budget: {self.total / GIB:.2f} GiB for the whole model "
                f"({self.total / 1e9:.2f} GB)"]


def kv_needed(shape: Shape, s: Serving) -> int:
    """KV bytes per GPU for C sequences of L tokens, in whole blocks (as vLLM allocates)."""
    mem = s.memory(shape, 0)
    per_block = mem.kv_bytes_per_token * BLOCK
    return math.ceil(s.concurrency * mem.request_bytes / per_block) * per_block if per_block \
        else 0


def per_rank(total: int, replicated: int, tp: int) -> int:
    """The planner's split (WeightEstimate.per_rank): replicated tensors on every rank."""
    return replicated + math.ceil((total - replicated) / tp)


def weight_budget(shape: Shape, s: Serving, replicated: int, group: int | None) -> Budget:
    """The weight budget that leaves room for the KV cache of C x L tokens."""
    problem = tp_problem(shape, s.gpus, group)
    if problem:
        raise FitError(problem=f"--gpus {s.gpus}: vLLM cannot shard this model {s.gpus} ways "
                               f"({problem})", hint=f"use --gpus {_tp_hint(shape, group)}")
    mem = s.memory(shape, 0)
    need = kv_needed(shape, s)
    per_gpu = mem.available - need
    total = replicated + (per_gpu - replicated) * s.gpus if per_gpu > replicated else 0
    return Budget(max(0, total), per_gpu, s, need, mem.activation, mem.nontorch, mem.requested)


def _tp_hint(shape: Shape, group: int | None) -> str:
    ok = [str(tp) for tp in TP_CANDIDATES if not tp_problem(shape, tp, group)]
    return " or ".join(ok) or "1"


def check_fit(shape: Shape, s: Serving, total: int, replicated: int) -> tuple[bool, Memory]:
    """The planner's verdict on a finished assignment: do C sequences fit beside it?"""
    mem = s.memory(shape, per_rank(total, replicated, s.gpus))
    return mem.weights < mem.requested and mem.max_sequences >= s.concurrency, mem


def nearest(shape: Shape, s: Serving, smallest: int, replicated: int,
            group: int | None) -> FitError:
    """The refusal when nothing fits, naming the nearest setups where the smallest assignment
    fits."""
    def fits(t: Serving) -> bool:
        if tp_problem(shape, t.gpus, group):
            return False
        return check_fit(shape, t, smallest, replicated)[0]

    options = []
    users = max((c for c in range(s.concurrency - 1, 0, -1)
                 if fits(_with(s, concurrency=c))), default=None)
    if users:
        options.append(f"--concurrency {users}")
    ctx = next((c for c in _shorter(s.context) if fits(_with(s, context=c))), None)
    if ctx:
        options.append(f"--max-model-len {ctx}")
    if not s.kv_fp8 and fits(_with(s, kv_fp8=True)):
        options.append("--kv-cache-dtype fp8")
    more = next((tp for tp in TP_CANDIDATES if tp > s.gpus and fits(_with(s, gpus=tp))), None)
    if more:
        options.append(f"--gpus {more}")
    what = " or ".join(options) if options else f"a GPU with more memory than {s.gpu.name}"
    return FitError(problem=f"nothing fits {s.describe()}: even every layer at the lowest "
                            f"precision ({smallest / GIB:.2f} GiB) leaves too little KV room",
                    hint=f"nearest fitting setup: {what}")


def _with(s: Serving, **kw: object) -> Serving:
    from dataclasses import replace

    return replace(s, **kw)  # type: ignore[arg-type]


def _shorter(context: int) -> list[int]:
    out, c = [], context
    while c > 512:
        c = c * 3 // 4 // 256 * 256
        out.append(c)
    return out
