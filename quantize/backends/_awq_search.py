"""AWQ's scale search on a subset of the calibration samples (recipe `awq.search_samples`).

llm-compressor 0.14.0.1's AWQModifier (modifiers/transform/awq/base.py) picks each mapping's
smoothing scales by a grid search: for each of `n_grid` candidates it re-runs the mapping's
parent module (the whole attention block, the whole MLP, or down_proj) over every cached
calibration batch and compares the output with the unscaled one. On the 2-core CPU that is
90 % of the AWQ run (default model, 2 decoder layers: 64.8 s of 72.4 s in those forwards,
bench/awq_cpu.py), and the library has no knob to search on fewer tokens. This subclass keeps
everything else as the library does it, including the activation means that shape every
candidate, which still come from all samples, and runs only the search's forwards on
`search_samples` samples spread evenly over the calibration set. What that costs in quality
is measured per setting in docs/awq-cpu.md.
"""

from __future__ import annotations

import math
from typing import Any

from llmcompressor.core import active_session
from llmcompressor.modifiers.transform.awq import AWQModifier
from torch.nn import Module


def spread(n_batches: int, rows: int, samples: int) -> list[int]:
    """Indices of the batches to search on: enough batches of `rows` samples each to hold
    `samples` samples, spread evenly over all `n_batches` (the first one included)."""
    need = min(n_batches, max(1, math.ceil(samples / max(rows, 1))))
    return sorted({(i * n_batches) // need for i in range(need)})


class SubsetSearchAWQModifier(AWQModifier):
    """AWQModifier whose grid search (and the unscaled reference output it compares with)
    runs on `search_samples` of the calibration samples; None: all, as the library does."""

    search_samples: int | None = None

    def _run_samples(self, module: Module) -> list[Any]:
        state = active_session().state
        if self.search_samples is None or (state is not None and state.loss_masks):
            # the library indexes loss masks by batch position: keep its full search there
            return super()._run_samples(module)
        cache = self._parent_args_cache[module]
        if len(cache) == 0:
            return []
        first = cache.fetch(0)
        rows = _rows(first)
        outputs = []
        for i in spread(len(cache), rows, self.search_samples):
            out = module(**(first if i == 0 else cache.fetch(i)))
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return outputs


def _rows(batch: dict[str, Any]) -> int:
    """Samples in one cached batch: the leading dimension of its first tensor argument."""
    import torch

    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.ndim >= 2:
            return int(value.shape[0])
    return 1
