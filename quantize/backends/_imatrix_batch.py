"""The imatrix observer's range search for many same-width Linears at once.

llm-compressor 0.14's GPTQ observes each quantized Linear of a layer one by one at the end
of its calibration epoch (`observe(modules, "weight")`); the `imatrix_mse` observer then
searches up to 20 shrink factors of the min/max range, each step a fake-quantize of the
whole weight and a host sync (`torch.any(improved)`). On a MoE layer that is 128 experts
x 3 projections of small matrices: a few thousand tiny GPU steps per layer, launch- and
sync-bound (the default recipe's quantize stage took 1.71x gptq-int4's on 12 layers of
Qwen3-30B-A3B, bench/RESULTS.md, against 1.11x on a dense 8B).

`batched_imatrix()` replaces that `observe` for one `oneshot`: the weights of the layer's
imatrix-observed Linears that share an input width and quantization args are stacked along
the output rows (each row's groups are searched independently by the library too) and
searched in one pass, with a per-module patience counter, so every module stops at the step
the library's own loop would have stopped at and ends with the same min/max: the result is
the library's, only the loop is shared (tests/unit/backends/test_imatrix_batch.py compares
the two on CPU). The importance vector of each module still comes from the observer's own
`_prepare_importance` (its validation and fallbacks included). Anything else — another
observer, TENSOR_GROUP (its global scale fuses observers), a module already observed —
goes through the library's `observe` unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

# the stacked weights of one search pass, in elements (fp32: 4 bytes each; the search holds
# about 4 copies: the stack, its importance, one fake-quantized step and its error)
MAX_BATCH_ELEMENTS = 1 << 26


def _key(module: Any) -> tuple[Any, ...] | None:
    """Modules that may share one pass: same input width, device and quantization args
    and search settings; None for any the batched search does not cover."""
    from compressed_tensors.quantization import QuantizationStrategy
    from llmcompressor.observers.imatrix import IMatrixMSEObserver

    obs = getattr(module, "weight_observer", None)
    if type(obs) is not IMatrixMSEObserver or obs.has_statistics:
        return None
    args = obs.args
    if args.strategy not in (QuantizationStrategy.GROUP, QuantizationStrategy.CHANNEL):
        return None
    w = module.weight
    return (w.shape[1], w.device, w.dtype, args.model_dump_json(), obs.maxshrink,
            obs.patience, obs.grid, obs.norm, obs.expand)


def _batches(modules: list[Any]) -> tuple[list[list[Any]], list[Any]]:
    groups: dict[tuple[Any, ...], list[Any]] = {}
    rest = []
    for m in modules:
        k = _key(m)
        if k is None:
            rest.append(m)
        else:
            groups.setdefault(k, []).append(m)
    out: list[list[Any]] = []
    for members in groups.values():
        batch: list[Any] = []
        size = 0
        for m in members:
            n = m.weight.numel()
            if batch and size + n > MAX_BATCH_ELEMENTS:
                out.append(batch)
                batch, size = [], 0
            batch.append(m)
            size += n
        out.append(batch)
    return out, rest


def search(modules: list[Any]) -> None:
    """Set each module's observer min/max as `observer(module.weight)` would."""
    import torch
    from compressed_tensors.quantization import QuantizationStrategy
    from compressed_tensors.quantization.lifecycle import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams
    from compressed_tensors.utils import patch_attr
    from llmcompressor.observers.helpers import flatten_for_calibration

    obs0 = modules[0].weight_observer
    args = obs0.args
    flat, imps, rows = [], [], []
    for m in modules:
        observed = flatten_for_calibration(m.weight, "weight", m.weight_observer.args)
        imp = m.weight_observer._prepare_importance(observed)
        if imp is None:  # the library's uniform-MSE fallback, per module
            imp = torch.ones_like(observed, dtype=torch.float32)
        flat.append(observed)
        imps.append(imp)
        rows.append(observed.shape[1])
    observed = torch.cat(flat, dim=1)
    importance = torch.cat(imps, dim=1)
    del flat, imps
    owner = torch.repeat_interleave(torch.arange(len(modules), device=observed.device),
                                    torch.tensor(rows, device=observed.device))

    min_val = torch.amin(observed, dim=(0, -1)) * obs0.expand
    max_val = torch.amax(observed, dim=(0, -1)) * obs0.expand
    best_error = torch.full(min_val.shape, torch.finfo(torch.float32).max,
                            device=min_val.device, dtype=torch.float32)
    best_min, best_max = min_val.clone(), max_val.clone()
    observed_f = observed.float()
    active = torch.ones(len(modules), dtype=torch.bool, device=observed.device)
    no_improve = torch.zeros(len(modules), dtype=torch.int64, device=observed.device)
    for i in range(max(1, int(obs0.maxshrink * obs0.grid)) + 1):
        p = 1 - i / obs0.grid
        shrink_min, shrink_max = p * min_val, p * max_val
        scales, zps = calculate_qparams(min_vals=shrink_min, max_vals=shrink_max,
                                        quantization_args=args, global_scale=None)
        with patch_attr(args, "strategy", QuantizationStrategy.TOKEN):
            q = fake_quantize(observed, scales.unsqueeze(-1), zps.unsqueeze(-1), args).float()
        q.sub_(observed_f).abs_().pow_(obs0.norm).mul_(importance)
        err = q.sum(dim=(0, -1))
        del q
        improved = (err < best_error) & active[owner].unsqueeze(-1)
        best_error = torch.where(improved, err, best_error)
        best_min = torch.where(improved, shrink_min, best_min)
        best_max = torch.where(improved, shrink_max, best_max)
        hits = torch.zeros(len(modules), dtype=torch.float32, device=observed.device)
        any_module = hits.index_add_(0, owner, improved.any(dim=-1).float()) > 0
        no_improve = torch.where(any_module, 0, no_improve + active.long())
        if obs0.patience > 0:
            active &= no_improve < obs0.patience
            if not bool(active.any()):  # the one host sync per step, for all modules
                break
    for m, lo, hi in zip(modules, best_min.split(rows), best_max.split(rows), strict=True):
        m.weight_observer.min_vals, m.weight_observer.max_vals = lo.clone(), hi.clone()


def observe_batched(orig: Any) -> Any:
    """llm-compressor's `observe(modules, base_name)`, with the weights' imatrix search
    shared per batch (module docstring); every other call is the library's."""

    def observe(module: Any, base_name: str) -> None:
        if base_name != "weight" or not isinstance(module, list):
            orig(module, base_name)
            return
        batches, rest = _batches(module)
        for batch in batches:
            if len(batch) == 1:
                orig(batch[0], base_name)
            else:
                search(batch)
        for m in rest:
            orig(m, base_name)

    return observe


@contextlib.contextmanager
def batched_imatrix(enabled: bool = True) -> Iterator[None]:
    """Use the shared search for one `oneshot` (a no-op where GPTQ does not use `observe`)."""
    if not enabled:
        yield
        return
    from llmcompressor.modifiers.gptq import base

    orig = base.observe
    base.observe = observe_batched(orig)
    try:
        yield
    finally:
        base.observe = orig
