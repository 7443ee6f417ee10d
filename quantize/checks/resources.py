"""Refuse early when the machine cannot hold the work: before the quantize stage loads the
model, estimate the host RAM and (with --device cuda) the GPU memory it needs, from the
meta-device model pre-flight already built (config.json alone, no weights read), and compare
with what is free now.

On a GPU the model goes where it fits, cheapest first:

    resident         the whole model on the GPU (fastest)
    onload           weights in host memory; llm-compressor's sequential pipeline onloads one
                     decoder layer at a time (bench/RESULTS.md: GPU peak 18.7 -> 4.5 GiB on
                     the Llama-3.1-8B architecture, +24 % time, identical GPTQ losses)
    onload+offload   also the calibration activations between layers kept in host memory

and when none fits the run stops with what is needed, what is free and what would fix it.

The GPU model, per decoder layer (the engine works on one at a time): the weights (all of
them when resident, two layers' worth when onloaded), the GPTQ Hessians of the layer's
targeted Linears (fp32 in x in each) plus the largest module's solve (one more Hessian and
three fp32 weight copies), the calibration activations between layers (tokens x hidden x
2 copies), one batch's forward (the widest Linear output x 4, and eager attention scores in
16-bit, softmax in fp32), then +10 % allocator slack and 1 GiB for the CUDA context.
Checked against the H200 rows of bench/RESULTS.md section 3 (8B, 32 x 2048 tokens): resident
batch 1 estimates 19.7 GiB allocated vs 19.4 measured, batch 8 28.3 vs 27.9, onloaded 5.6 vs
4.5 (conservative).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantize.errors import ResourceError
from quantize.model.config import ModelConfig, weight_bytes
from quantize.progress import info
from quantize.recipe.methods import METHODS
from quantize.recipe.recipe import Recipe
from quantize.textfmt import human_bytes

GiB = 2**30
# Host RAM: calibration keeps the model, a second copy during save/compression and the
# engine's per-layer caches; 2.5x the weights at the working dtype covered every run measured.
_OVERHEAD = 2.5
_SLACK = 1.10  # allocator fragmentation over the allocated peak
_CONTEXT = 1 * GiB  # CUDA context, cuBLAS workspaces: outside torch's allocator
PLACEMENTS = ("resident", "onload", "onload+offload")


@dataclass(frozen=True)
class ModelSize:
    """What the memory estimates need from the meta model."""

    params: int
    layer_params: int  # the largest decoder layer
    hessian_bytes: int  # fp32 Hessians of one layer's targeted Linears (GPTQ), largest layer
    solve_bytes: int  # the largest targeted Linear's solve working set (fp32)
    widest_out: int  # the widest Linear output in a layer (MLP intermediate)
    hidden: int
    heads: int


def _decoder_layers(model: Any) -> tuple[str, list[Any]]:
    """The longest ModuleList (the decoder layers) and its qualified name."""
    import torch

    best: tuple[str, list[Any]] = ("", [])
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > len(best[1]):
            best = (name, list(mod))
    return best


def model_size(model: Any, recipe: Recipe) -> ModelSize:
    """Sizes of the meta model pre-flight built (passed in, never rebuilt)."""
    from quantize.model.layers import targeted_layers

    params = sum(p.numel() for p in model.parameters())
    prefix, layers = _decoder_layers(model)
    layer_params = max((sum(p.numel() for p in lay.parameters()) for lay in layers),
                       default=params)
    gptq = METHODS[recipe.method].hessian
    per_layer: dict[str, int] = {}
    solve = widest = 0
    for lay in targeted_layers(model, recipe.targets, recipe.ignore):
        if prefix and lay.name.startswith(prefix + "."):
            idx = lay.name[len(prefix) + 1:].split(".")[0]
            h = lay.in_features ** 2 * 4 if gptq else 0
            # GPTQ holds every module's Hessian until its layer is solved: a MoE layer's are
            # one per expert (Qwen3-30B-A3B: 4.3 GiB a layer, which the H200 rows showed
            # missing from the estimate when experts were counted once, bench/RESULTS.md)
            per_layer[idx] = per_layer.get(idx, 0) + h * lay.copies
            widest = max(widest, lay.out_features)
            copies = 3 * lay.out_features * lay.in_features * 4  # W fp32, Q, error
            solve = max(solve, copies + h)  # GPTQ also inverts a Hessian copy
    cfg = model.config
    text = getattr(cfg, "text_config", None) or cfg
    return ModelSize(params=params, layer_params=layer_params,
                     hessian_bytes=max(per_layer.values(), default=0), solve_bytes=solve,
                     widest_out=widest or int(getattr(text, "intermediate_size", 0) or 0),
                     hidden=int(getattr(text, "hidden_size", 0) or 0),
                     heads=int(getattr(text, "num_attention_heads", 0) or 0))




# --- host RAM ----------------------------------------------------------------------------
def weight_bytes_on(params: int, device: str, dtype_bytes: int = 2) -> int:
    """The weights as the work holds them: fp32 on the CPU (quantizing and the hf engine
    compute there in fp32), the model's 16-bit dtype on a GPU."""
    return params * (4 if device == "cpu" else dtype_bytes)


def estimate_host_bytes(params: int, device: str) -> int:
    """Host RAM needed to quantize: fp32 weights on CPU; 16-bit weights held on the host
    (memory-mapped, then staged for saving) when a GPU does the work."""
    return int(weight_bytes_on(params, device) * _OVERHEAD)


def host_free_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def check_host_memory(params: int, device: str) -> dict[str, float]:
    need, free = estimate_host_bytes(params, device), host_free_bytes()
    facts = {"host_ram_needed_gib": _gib(need), "host_ram_free_gib": _gib(free)}
    if need > free:
        raise ResourceError(
            problem=f"quantizing this model needs about {need / GiB:.1f} GiB of host RAM and "
                    f"{free / GiB:.1f} GiB is free",
            hint="use a machine with more memory, or a GPU (--device cuda: 16-bit weights, "
                 "sequential layer-by-layer onloading), or close other programs")
    return facts


# --- GPU memory --------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuEstimate:
    """Bytes per part; `need(placement)` is the total with slack and the CUDA context."""

    weights: int
    layer: int  # one decoder layer's weights
    working: int  # Hessians + the largest solve
    activations: int  # calibration activations between layers
    forward: int  # one batch through one layer

    def allocated(self, placement: str) -> int:
        if placement == "resident":
            return self.weights + self.working + self.activations + self.forward
        held = 2 * self.layer + self.working + self.forward  # the layer and the next one
        return held + (self.activations if placement == "onload" else 0)

    def need(self, placement: str) -> int:
        return int(self.allocated(placement) * _SLACK) + _CONTEXT


def estimate_gpu(size: ModelSize, recipe: Recipe, config: ModelConfig,
                 samples: list[list[int]], batch: int) -> GpuEstimate:
    b = weight_bytes(config)
    tokens = sum(len(s) for s in samples)
    seq = max((len(s) for s in samples), default=0)
    forward = batch * (seq * size.widest_out * b * 4  # gate, up, activation, product
                       + size.heads * seq * seq * (2 * b + 4))  # scores, fp32 softmax, probs
    working = size.hessian_bytes + size.solve_bytes
    if METHODS[recipe.method].caches_inputs:  # AWQ/AutoRound keep each layer's inputs to search
        working += tokens * size.hidden * b * 2
    return GpuEstimate(weights=size.params * b, layer=size.layer_params * b, working=working,
                       activations=tokens * size.hidden * b * 2, forward=forward)


def gpu_free_bytes() -> int:
    import torch

    free, _total = torch.cuda.mem_get_info()
    return int(free)


def _gib(n: float) -> float:
    return round(n / GiB, 2)


def check_gpu_memory(est: GpuEstimate, batch: int, seq: int,
                     host_need: int) -> dict[str, str | float]:
    """Pick the cheapest placement that fits the free GPU memory, or refuse."""
    free = gpu_free_bytes()
    resident = est.need("resident")
    for placement in PLACEMENTS:
        need = est.need(placement)
        if need <= free:
            if placement != "resident":
                how = ("loading it in host memory and onloading one layer at a time "
                       "(sequential onloading, slower)")
                if placement == "onload+offload":
                    how += " with calibration activations offloaded to host memory"
                info(f"[dim]note: the whole model needs about {resident / GiB:.1f} GiB on the "
                     f"GPU and {free / GiB:.1f} GiB is free: {how}[/dim]")
            return {"gpu_placement": placement, "gpu_needed_gib": _gib(need),
                    "gpu_free_gib": _gib(free)}
    need = est.need("onload+offload")
    fixes = []
    if batch > 1:
        fixes.append(f"set `batch_size: 1` in the recipe (the calibration batch of {batch} "
                     f"takes {est.forward / GiB:.1f} GiB)")
    if seq:
        fixes.append(f"a shorter seq_len than {seq} in the calibration spec (one layer's "
                     f"forward takes {est.forward / GiB:.1f} GiB)")
    fixes.append(f"--device cpu (about {host_need / GiB:.1f} GiB of host RAM)")
    raise ResourceError(
        problem=f"quantizing on the GPU needs about {need / GiB:.1f} GiB of GPU memory even "
                "with sequential onloading and activations offloaded to host memory (layer "
                f"{est.layer / GiB:.2f} GiB x 2, Hessians and solve {est.working / GiB:.2f}, "
                f"forward {est.forward / GiB:.2f}) and {free / GiB:.1f} GiB is free",
        hint="fix: " + "; or ".join([*fixes, "free the GPU / use a larger one"]))


def check_memory(meta: Any, recipe: Recipe, config: ModelConfig, device: str,
                 samples: list[list[int]], batch: int, *, world_size: int = 1,
                 offload_dir: Path | None = None) -> dict[str, Any]:
    """Host RAM always; GPU memory on cuda. Returns the facts recorded in the manifest
    (with `gpu_placement` on a GPU: resident, onload or onload+offload). With `offload_dir`,
    short host RAM sends the weights that do not fit to disk instead of refusing
    (quantize.checks.placement: `host_tier` ram or disk); `samples` are one process's share."""
    size = model_size(meta, recipe)
    if offload_dir is None:
        facts: dict[str, Any] = dict(check_host_memory(size.params, device))
    else:
        from quantize.checks.placement import host_plan

        weights = weight_bytes_on(size.params, device, weight_bytes(config))
        facts = host_plan(estimate_host_bytes(size.params, device), weights,
                          host_free_bytes(), world_size, offload_dir).facts()
    if device != "cpu":
        est = estimate_gpu(size, recipe, config, samples, batch)
        seq = max((len(s) for s in samples), default=0)
        cpu_need = estimate_host_bytes(size.params, "cpu")
        facts |= check_gpu_memory(est, batch, seq, cpu_need)
    return facts



# --- disk --------------------------------------------------------------------------------
@dataclass(frozen=True)
class DiskNeed:
    """Bytes one part of a run will write into `path` (a folder, existing or not)."""

    what: str  # "quantize", "export", "baseline cache", ...
    path: Path
    bytes: int


def _size(n: int) -> str:
    return human_bytes(n, top="GiB", digits=2 if n >= GiB else 1)


def check_disk(needs: list[DiskNeed], *, free: Any = None) -> dict[str, dict[str, int]]:
    """Sum the needs per file system (two folders on one disk share its free space) and
    refuse, on one line (need, free, path, fix), the first file system they overflow.
    Returns the facts recorded in the manifest. `free(path)` is injectable for tests."""
    import os

    from quantize.run.files import free_bytes

    free = free or free_bytes
    by_fs: dict[int, list[DiskNeed]] = {}
    for need in needs:
        probe = Path(os.path.abspath(need.path))
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        by_fs.setdefault(os.stat(probe).st_dev, []).append(need)
    facts = {"disk_needed_bytes": {n.what: n.bytes for n in needs}}
    for group in by_fs.values():
        total = sum(n.bytes for n in group)
        room = int(free(group[0].path))
        if total > room:
            parts = ", ".join(f"{n.what} {_size(n.bytes)}" for n in group if n.bytes)
            where = " and ".join(sorted({str(n.path) for n in group}))
            raise ResourceError(
                problem=f"not enough disk space: this run writes about {_size(total)} to "
                        f"{where} ({parts}) and {_size(room)} is free there",
                hint="free space, or put the run folder (--out) or the cache "
                     "(QUANTIZE_CACHE) on a larger disk, or pass --no-disk-check to try anyway")
    return facts
