"""Mixture-of-experts calibration: routers kept dense and expert coverage counted.

`calibration(model, job, out)` wraps the engine's calibration of a loaded model:

- before it, the routers and shared-expert gates found in the model (quantize.model.moe) join
  the recipe's `ignore`, and a recipe whose targets would still quantize one is refused;
- during it, a forward hook on every router counts the tokens its real top-k sends to each
  expert (the indices the router returns, whatever the engine then runs: llm-compressor's
  `moe_calibrate_all_experts` feeds every token to every expert, but the router's choice is
  what serving does). Each calibration token counts once: llm-compressor's sequential
  pipeline runs each layer twice (calibrate, then propagate with its hooks disabled) and AWQ
  re-runs layers for its grid search with its hooks disabled, which the counter follows; other
  forwards run with the hooks on (a second calibration pass of SmoothQuant + GPTQ in
  w8a8-int8, AutoRound's 200 tuning iterations over each layer's cached inputs: measured 2x
  and 40-170x the tokens on the tiny MoE fixtures), so each router counts the first pass over
  the calibration tokens only (`budget`, the tokens of this process's samples) and no more;
- after it, `moe_coverage.json` (quantize.model.moe.ExpertCoverage) is written into the
  quantize stage's folder, from where the export carries it.

A dense model passes through untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from quantize.backends import QuantizeJob
from quantize.errors import QuantizationError
from quantize.model.moe import (
    COVERAGE_FILE,
    ExpertCoverage,
    LayerCoverage,
    check_routers_dense,
    derived_ignore,
    routing_modules,
)
from quantize.run.files import atomic_write_json

if TYPE_CHECKING:
    import torch


def _hooks_disabled() -> bool:
    """llm-compressor's switch for its own hooks (propagation passes, AWQ's grid search)."""
    try:
        from llmcompressor.modifiers.utils.hooks import HooksMixin
    except ImportError:
        return False
    return bool(HooksMixin._HOOKS_DISABLED)


def _top_k(model: Any) -> int:
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    return int(getattr(cfg, "num_experts_per_tok", 0) or 1)


class RoutingCounter:
    """Counts, per router, the tokens its top-k sends to each expert."""

    def __init__(self, routers: dict[str, torch.nn.Module], top_k: int, *,
                 follow_engine: bool = True, budget: int | None = None):
        self.routers, self.top_k, self.follow_engine = routers, top_k, follow_engine
        # tokens one pass over the calibration data routes through each router; later
        # forwards (re-runs of the same tokens) are not counted. None: count every forward
        self.budget = budget
        self.counts: dict[str, torch.Tensor] = {}
        self.seen: dict[str, int] = {}
        self._handles: list[Any] = []

    def _indices(self, output: Any) -> Any:
        """The experts chosen per token: transformers 5 routers return (logits, weights,
        indices); a plain nn.Linear gate returns logits, whose top-k the block takes (softmax
        keeps the order)."""
        import torch

        if isinstance(output, tuple):
            ints = [t for t in output if isinstance(t, torch.Tensor) and not
                    t.is_floating_point()]
            if ints:
                return ints[-1]
            output = output[0]
        return torch.topk(output.reshape(-1, output.shape[-1]), self.top_k, dim=-1).indices

    def _hook(self, name: str, experts: int) -> Any:
        import torch

        def hook(_mod: Any, _args: Any, output: Any) -> None:
            if self.follow_engine and _hooks_disabled():
                return
            if self.budget is not None and self.seen[name] >= self.budget:
                return  # a later pass: no indices to read, no copy to the host (a GPU sync)
            rows = self._indices(output)
            rows = rows.reshape(-1, rows.shape[-1]) if rows.dim() else rows.reshape(1, 1)
            if self.budget is not None:  # the first pass's tokens only
                rows = rows[: max(self.budget - self.seen[name], 0)]
            self.seen[name] += int(rows.shape[0])
            idx = rows.reshape(-1).to("cpu", torch.int64)
            idx = idx[(idx >= 0) & (idx < experts)]
            self.counts[name] = self.counts[name] + torch.bincount(idx, minlength=experts)

        return hook

    def __enter__(self) -> RoutingCounter:
        import torch

        for name, mod in self.routers.items():
            # not get_parameter: a router offloaded to disk by compressed-tensors (the disk
            # tier) onloads its weight as a plain tensor, which get_parameter refuses
            experts = int(cast("torch.Tensor", mod.weight).shape[0])
            self.counts[name] = torch.zeros(experts, dtype=torch.int64)
            self.seen[name] = 0
            self._handles.append(mod.register_forward_hook(self._hook(name, experts)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def layers(self) -> list[LayerCoverage]:
        return [LayerCoverage.from_counts(n[: -len(".gate")] if n.endswith(".gate") else n,
                                          [int(x) for x in c.tolist()], self.top_k)
                for n, c in self.counts.items()]


@contextlib.contextmanager
def calibration(model: Any, job: QuantizeJob, out: Path) -> Iterator[QuantizeJob]:
    """The job to calibrate with (routers added to its ignore list); writes coverage."""
    routers = routing_modules(model)
    if not routers:
        yield job
        return
    recipe = job.recipe
    ignore = list(dict.fromkeys([*recipe.ignore, *derived_ignore(model)]))
    targets = [*recipe.targets, *(t for ov in recipe.overrides for t in ov.targets)]
    check_routers_dense(model, targets, ignore, QuantizationError)
    job = dataclasses.replace(job, recipe=recipe.model_copy(update={"ignore": ignore}))
    budget = sum(len(s) for s in job.samples) if job.samples else None
    with RoutingCounter(routers, _top_k(model), budget=budget) as counter:
        yield job
    cov = ExpertCoverage(calibrated=recipe.needs_calibration,
                         all_experts_calibrated=recipe.needs_calibration
                         and recipe.calibrate_all_experts,
                         layers=counter.layers())
    atomic_write_json(out / COVERAGE_FILE, cov.model_dump(mode="json"))
