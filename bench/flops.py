"""The compute floor of a calibration run: FLOPs from the model's config alone.

Counts (2 FLOPs per multiply-add, tokens N, sequence length s, per decoder layer):
  forward  = 2·N·Σ(d_in·d_out of every Linear) + 2·N·s·heads·head_dim (causal attention:
             QKᵀ and AV over s/2 keys on average), plus the lm_head once per pass
  hessian  = 2·N·d_in² for every Linear that GPTQ hooks (llm-compressor keeps one Hessian per
             module, so q/k/v and gate/up each recompute the same XᵀX)
  awq grid = (n_grid + 1)·N·(attention block + MLP + down_proj) (each grid point re-runs the
             mapping's parent module; the v→o mapping is skipped under GQA)
How many forward passes a recipe makes is in `passes()`: llm-compressor's sequential pipeline
runs every layer twice per modifier (a calibration pass with hooks, then a propagation pass
that carries the quantized layer's output to the next layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Dims:
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Dims:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(hidden=hidden, inter=int(cfg["intermediate_size"]),
                   layers=int(cfg["num_hidden_layers"]), heads=heads,
                   kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=int(cfg.get("head_dim") or hidden // heads),
                   vocab=int(cfg["vocab_size"]))

    def linears(self) -> list[tuple[str, int, int]]:
        """(name, d_in, d_out) of one decoder layer's Linear modules."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        h, i = self.hidden, self.inter
        return [("q_proj", h, q), ("k_proj", h, kv), ("v_proj", h, kv), ("o_proj", q, h),
                ("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)]

    def params(self) -> int:
        """Weights of the decoder layers, embeddings and lm_head (norms are negligible)."""
        per_layer = sum(a * b for _, a, b in self.linears())
        return self.layers * per_layer + 2 * self.vocab * self.hidden


def forward_flops(d: Dims, tokens: int, seq_len: int, *, lm_head: bool = True) -> float:
    linear = 2.0 * tokens * sum(a * b for _, a, b in d.linears())
    attention = 2.0 * tokens * seq_len * d.heads * d.head_dim
    head = 2.0 * tokens * d.hidden * d.vocab if lm_head else 0.0
    return d.layers * (linear + attention) + head


def hessian_flops(d: Dims, tokens: int) -> float:
    return d.layers * sum(2.0 * tokens * a * a for _, a, _ in d.linears())


def awq_grid_flops(d: Dims, tokens: int, seq_len: int, n_grid: int) -> float:
    """Each grid point re-runs the attention block, the MLP, and down_proj alone."""
    per_layer = forward_flops(d, tokens, seq_len, lm_head=False) / d.layers
    down = 2.0 * tokens * d.inter * d.hidden
    return (n_grid + 1) * d.layers * (per_layer + down)


def passes(recipe: str) -> int:
    """Full forward passes over the calibration set that llm-compressor makes."""
    return {"gptq-int4": 2, "awq-int4": 2, "w8a8-int8": 4, "fp8-dynamic": 0}.get(recipe, 2)


@dataclass(frozen=True)
class Floor:
    forward: float  # FLOPs
    stats: float  # Hessian or AWQ grid FLOPs
    seconds_tensor: float  # everything at the bf16 matrix rate
    seconds_engine: float  # the Hessian at the fp32 (or tf32) rate llm-compressor uses

    def as_dict(self) -> dict[str, float]:
        return {"forward_tflop": self.forward / 1e12, "stats_tflop": self.stats / 1e12,
                "floor_s": self.seconds_tensor, "floor_engine_s": self.seconds_engine}


def floor(recipe: str, d: Dims, tokens: int, seq_len: int, rates: dict[str, float], *,
          tf32: bool = False, n_grid: int = 20) -> Floor:
    """rates: measured TFLOP/s for 'bf16', 'fp32' and 'tf32' matrix products."""
    fwd = passes(recipe) * forward_flops(d, tokens, seq_len)
    if recipe in ("gptq-int4", "w8a8-int8"):
        stats = hessian_flops(d, tokens)
        stats_rate = rates["tf32"] if tf32 else rates["fp32"]
    elif recipe == "awq-int4":
        stats = awq_grid_flops(d, tokens, seq_len, n_grid)
        stats_rate = rates["bf16"]
    else:
        stats, stats_rate = 0.0, rates["bf16"]
    bf16 = rates["bf16"] * 1e12
    return Floor(forward=fwd, stats=stats, seconds_tensor=(fwd + stats) / bf16,
                 seconds_engine=fwd / bf16 + stats / (stats_rate * 1e12))
