"""The main engine: llm-compressor `oneshot`, writing compressed-tensors checkpoints."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from quantize.backends import QuantizeJob
from quantize.checks.preflight import override_group_size  # the one rule pre-flight checks too
from quantize.errors import QuantizationError, first_line
from quantize.model.config import ModelConfig, read_config, torch_dtype
from quantize.recipe.options import AutoRoundOptions, AWQOptions, GPTQOptions
from quantize.recipe.recipe import Recipe
from quantize.recipe.schemes import SCHEMES

if TYPE_CHECKING:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme


class QuantizerArgs(TypedDict, total=False):
    """The keyword arguments every llm-compressor quantizing modifier takes from a recipe."""

    config_groups: dict[str, QuantizationScheme]
    ignore: list[str]
    kv_cache_scheme: QuantizationArgs


class OneshotArgs(TypedDict, total=False):
    """The keyword arguments of llm-compressor's `oneshot` this engine sets."""

    dataset: Any  # a datasets.Dataset
    num_calibration_samples: int
    max_seq_length: int
    shuffle_calibration_samples: bool
    batch_size: int
    sequential_offload_device: str
    moe_calibrate_all_experts: bool


def _scheme(name: str, targets: list[str], group_size: int | None,
            observer: str | None = None) -> QuantizationScheme:
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme(name, targets)
    update: dict[str, int | str] = {}
    if group_size is not None and SCHEMES[name].group:
        update["group_size"] = group_size
    if observer is not None:
        update["observer"] = observer
    if update:
        scheme = scheme.model_copy(
            update={"weights": scheme.weights.model_copy(update=update)})
    return scheme


def config_groups(recipe: Recipe, group_size: int | None) -> dict[str, QuantizationScheme]:
    """compressed-tensors config groups: the main scheme, then each override."""
    groups = {"group_0": _scheme(recipe.scheme, recipe.targets, group_size, recipe.observer)}
    for i, ov in enumerate(recipe.overrides, 1):
        groups[f"group_{i}"] = _scheme(ov.scheme, ov.targets,
                                       override_group_size(ov, group_size), recipe.observer)
    return groups


def _awq(recipe: Recipe, common: QuantizerArgs, model: Any) -> list[Any]:
    """AWQ's smoothing; a quantizer modifier follows it (awq: RTN, awq+gptq: GPTQ)."""
    from llmcompressor.modifiers.transform.awq import AWQModifier

    from quantize.backends._llmc_compat import awq_mappings

    awq = recipe.awq or AWQOptions()
    mapped = awq_mappings(model)
    kw: dict[str, Any] = {} if mapped is None else {"mappings": mapped}
    if awq.search_samples is None:  # the library's search, on every sample
        return [AWQModifier(n_grid=awq.n_grid, duo_scaling=awq.duo_scaling, **kw)]
    from quantize.backends._awq_search import SubsetSearchAWQModifier

    return [SubsetSearchAWQModifier(n_grid=awq.n_grid, duo_scaling=awq.duo_scaling,
                                    search_samples=awq.search_samples, **kw)]


def _gptq(recipe: Recipe, common: QuantizerArgs, model: Any) -> list[Any]:
    from llmcompressor.modifiers.quantization import GPTQModifier

    opts = recipe.gptq or GPTQOptions()
    return [GPTQModifier(block_size=opts.block_size, dampening_frac=opts.dampening_frac,
                         actorder=opts.actorder, **common)]


def _rtn(recipe: Recipe, common: QuantizerArgs, model: Any) -> list[Any]:
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return [QuantizationModifier(**common)]


def _autoround(recipe: Recipe, common: QuantizerArgs, model: Any) -> list[Any]:
    from llmcompressor.modifiers.autoround import AutoRoundModifier

    ar = recipe.autoround or AutoRoundOptions()
    return [AutoRoundModifier(iters=ar.iters, lr=ar.lr, batch_size=ar.batch_size,
                              enable_torch_compile=ar.compile, **common)]


ModifierBuilder = Callable[[Recipe, QuantizerArgs, Any], list[Any]]
# One entry per method of quantize.recipe.methods.METHODS: the llm-compressor modifiers it is
# (`model` lets AWQ take mappings the library gets wrong for it: _llmc_compat.awq_mappings)
MODIFIERS: dict[str, ModifierBuilder] = {
    "gptq": _gptq,
    "awq": lambda r, c, m: [*_awq(r, c, m), *_rtn(r, c, m)],
    "rtn": _rtn,
    "autoround": _autoround,
    "awq+gptq": lambda r, c, m: [*_awq(r, c, m), *_gptq(r, c, m)],
}


def build_modifiers(recipe: Recipe, group_size: int | None, model: Any = None) -> list[Any]:
    """The llm-compressor modifier list a recipe stands for: Hadamard rotations and SmoothQuant
    when asked, then the method's own (MODIFIERS)."""
    from compressed_tensors.quantization import QuantizationArgs

    groups = config_groups(recipe, group_size)
    common: QuantizerArgs = {"config_groups": groups, "ignore": list(recipe.ignore)}
    if recipe.kv_cache == "fp8":
        common["kv_cache_scheme"] = QuantizationArgs(
            num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
    mods: list[Any] = []
    if recipe.rotation is not None:  # the weights rotated before anything measures them
        from llmcompressor.modifiers.transform import QuIPModifier

        mods.append(QuIPModifier(rotations=["v"], transform_type="hadamard",
                                 transform_block_size=recipe.rotation.block,
                                 targets=list(recipe.targets), ignore=list(recipe.ignore)))
    if recipe.smoothquant is not None:
        from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

        mods.append(SmoothQuantModifier(smoothing_strength=recipe.smoothquant.strength))
    return mods + MODIFIERS[recipe.method](recipe, common, model)


def prepare_engine(distributed: bool = False) -> None:
    """What every process does before it runs llm-compressor (the pipeline, its torchrun
    workers, the benchmarks that time the library's steps): quiet logs, and the library
    fixes of quantize/backends/_llmc_compat.py (its data-parallel ones when `distributed`).

    llm-compressor logs every layer (INFO and its METRIC level, 38) to stdout; show only
    errors on the console (its full log goes to <run>/logs/) unless the user chose a level."""
    from quantize.backends import _llmc_compat

    os.environ.setdefault("LLM_COMPRESSOR_LOG_LEVEL", "ERROR")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*offloaded modules.*")
    warnings.filterwarnings("ignore", message=".*is_fx_tracing.*")
    _llmc_compat.apply()
    if distributed:
        _llmc_compat.apply_distributed()


class LLMCompressorBackend:
    name = "llmcompressor"

    def check_model(self, config: ModelConfig, recipe: Recipe) -> None:
        """Nothing beyond pre-flight: its checks are this engine's limits."""

    def quantize(self, job: QuantizeJob, out: Path) -> dict[str, Any]:
        if job.world_size > 1:  # data-parallel: the same steps on N processes (torchrun)
            from quantize.backends import distributed

            return distributed.launch(job, out)
        prepare_engine()
        from transformers import AutoTokenizer

        from quantize.backends import moe_coverage

        src_dtype, dtype = dtypes(job)
        tokenizer = AutoTokenizer.from_pretrained(job.model_path)
        _drop_offload(job)  # what a killed run left behind
        try:
            model = load_model(job, dtype)
            # MoE: routers stay dense, tokens per expert counted (quantize/backends/moe_coverage.py)
            with moe_coverage.calibration(model, job, out) as job:
                calibrate(model, tokenizer, job, job.samples, out.parent / "logs")
            save(model, tokenizer, out, dtype, src_dtype, write=True,
                 disk=job.host_tier == "disk")
        finally:
            _drop_offload(job)
        return summary(job, dtype, src_dtype)


def dtypes(job: QuantizeJob) -> tuple[Any, Any]:
    """(source dtype, calibration dtype). Calibrate in fp32 on CPU (bf16 matmuls there are
    slow and lossy); on a GPU in the checkpoint's own 16-bit dtype. The export is cast back
    to the source dtype."""
    import torch

    src_dtype = torch_dtype(read_config(job.model_path), allow_fp32=True)
    return src_dtype, torch.float32 if job.device == "cpu" else src_dtype


def load_model(job: QuantizeJob, dtype: Any) -> Any:
    """The model where quantize.checks.placement put it (GPU, host RAM, host RAM + disk; with
    several processes through compressed-tensors' load_offloaded_model)."""
    from transformers import AutoModelForCausalLM

    from quantize.checks.placement import load_plan

    plan = load_plan(job.device, job.placement, job.host_tier, job.world_size,
                     job.cpu_budget, job.offload_dir)
    kwargs = {"dtype": dtype, "trust_remote_code": job.recipe.trust_remote_code,
              **plan.kwargs}
    if plan.offloaded_context and "max_memory" not in kwargs and job.device == "cpu":
        import psutil  # load_offloaded_model would ask a missing accelerator for its memory

        kwargs["max_memory"] = {"cpu": int(psutil.virtual_memory().available)}
    from quantize.model.moe import linearize  # MoE: per-expert Linears, one layer at a time

    if not plan.offloaded_context:
        return linearize(AutoModelForCausalLM.from_pretrained(job.model_path, **kwargs))
    from compressed_tensors.offload import load_offloaded_model

    with load_offloaded_model():
        return linearize(AutoModelForCausalLM.from_pretrained(job.model_path, **kwargs))


def calibrate(model: Any, tokenizer: Any, job: QuantizeJob, samples: list[list[int]],
              log_dir: Path) -> None:
    """llm-compressor's oneshot on `samples` (this process's share under torchrun)."""
    from datasets import Dataset
    from llmcompressor import oneshot

    from quantize.backends._cpu_fast import shared_hessian
    from quantize.backends._gpu_fast import fast_hessian, sdpa_in_traced_layers
    from quantize.backends._imatrix_batch import batched_imatrix

    recipe = job.recipe
    gpu = job.device != "cpu"
    kwargs: OneshotArgs = {}
    if recipe.needs_calibration:
        ds = Dataset.from_dict(calibration_columns(samples, gpu))
        kwargs = {"dataset": ds, "num_calibration_samples": len(samples),
                  "max_seq_length": max(len(s) for s in samples),
                  "shuffle_calibration_samples": False, "batch_size": job.batch_size,
                  "moe_calibrate_all_experts": recipe.calibrate_all_experts}
    if job.device != "cpu":
        kwargs.update(_gpu_speedups(offload=job.placement == "onload+offload"))
    try:
        with contextlib.redirect_stdout(io.StringIO()), fast_hessian(gpu), \
                shared_hessian(not gpu), sdpa_in_traced_layers(model, gpu), \
                batched_imatrix():
            oneshot(model=model, processor=tokenizer,
                    log_dir=str(log_dir), recipe=build_modifiers(recipe, job.group_size, model),
                    **kwargs)
    except (ValueError, RuntimeError, TypeError) as exc:
        msg = first_line(exc)
        raise QuantizationError(problem=f"llm-compressor failed: {msg}") from exc


def calibration_columns(samples: list[list[int]], gpu: bool) -> dict[str, list[list[int]]]:
    """The dataset oneshot reads. On a GPU, equal-length samples (packed windows) go without
    an all-ones attention mask: the model then takes its plain causal attention path instead
    of building a 4-D mask (same result; measured in bench/RESULTS.md). The CPU keeps it."""
    cols = {"input_ids": samples}
    if not (gpu and len({len(s) for s in samples}) == 1):
        cols["attention_mask"] = [[1] * len(s) for s in samples]
    return cols


# llm-compressor saves one shard of up to 20 GB; the pipeline then hashes each output file,
# one thread per file. Smaller shards let an 8B checkpoint hash on several cores at once
# (8.5 GB of fp8 on an H200 host: one file 7.9 s; 2 GB shards 1.8 s; 1 GB 1.37 s; 512 MB
# 1.41 s but 1.8 s slower to write, bench/RESULTS.md); vLLM and transformers load any number.
SHARD_SIZE = "1GB"


def save(model: Any, tokenizer: Any, out: Path, dtype: Any, src_dtype: Any,
         write: bool, disk: bool = False) -> None:
    """Compress and save. Under torchrun every rank calls this (llm-compressor's
    save_pretrained synchronises the ranks and writes on rank 0); `write` is rank 0."""
    if dtype != src_dtype and disk:
        cast_parameters(model, src_dtype)
    elif dtype != src_dtype:
        # replaces each parameter's data in place: the key order compressed-tensors'
        # distributed compression walks in lockstep on every rank stays as it was
        model.to(src_dtype)
        if any(p.is_floating_point() and p.dtype != src_dtype for p in model.parameters()):
            # with torch 2.11 `model.to` after oneshot can leave every parameter fp32, and the
            # export then comes out fp32, 2x the planned size (bench/moe_matrix.py found it);
            # replacing each parameter does cast
            cast_parameters(model, src_dtype)
    import transformers.modeling_utils as hf_saving

    from quantize.run.files import hashed_while_written

    # each 1 GB shard is hashed in a child process while the next one is written
    with hashed_while_written(hf_saving, "safe_save_file"):
        model.save_pretrained(out, save_compressed=True, max_shard_size=SHARD_SIZE)
    if not write:
        return
    tokenizer.save_pretrained(out)
    name_fused_layers(out)
    # llm-compressor writes its own modifier list as recipe.yaml; ours takes that name in
    # the export, so keep theirs under a name that says what it is.
    own = out / "recipe.yaml"
    if own.exists():
        own.rename(out / "llmcompressor_recipe.yaml")


def name_fused_layers(out: Path) -> None:
    """config.json's config groups with vLLM's fused layer names beside their shards
    (quantize/vllm/targets.py: what lets vLLM before 0.30 load a per-layer mix)."""
    from quantize.run.files import atomic_write_json
    from quantize.vllm.targets import with_fused_names

    path = out / "config.json"
    config = json.loads(path.read_text())
    qc = config.get("quantization_config") or {}
    groups = qc.get("config_groups")
    if not groups or len(groups) < 2:  # one group: nothing to tell apart
        return
    named = with_fused_names(groups)
    if named != groups:
        qc["config_groups"] = named
        atomic_write_json(path, config)


def cast_parameters(model: Any, dtype: Any) -> None:
    """Cast floating-point parameters to `dtype` when some are offloaded to disk. There
    `model.to()` is not enough: it casts a copy read back from disk and writes it into the
    existing file, keeping the file's dtype (fp32 scales reached a disk-offloaded export that
    way), so offloaded entries are replaced, not assigned. A tied parameter (embeddings and
    lm_head) is cast once and the second owner re-pointed to it. One process only: under
    torchrun the ranks share the offload files (quantize.checks.placement refuses that case)."""
    import torch
    from compressed_tensors.offload import disable_onloading
    from compressed_tensors.offload.cache import OffloadCache

    # id of a stored tensor -> (that tensor, what replaced it); holding the old tensor keeps
    # its id from being reused by a new one, which would look tied (and, under torchrun,
    # skip a collective on one rank only)
    done: dict[int, tuple[Any, Any]] = {}
    with torch.no_grad():
        for module in model.modules():
            params = module._parameters
            cached = isinstance(params, OffloadCache)
            for name in list(params.keys()):
                old = params.offloaded_values[name] if cached else params[name]
                if old is None:
                    continue
                if id(old) in done:  # tied: already cast through its first owner
                    with disable_onloading():
                        params[name] = done[id(old)][1]
                    continue
                p = params[name]
                if not p.is_floating_point() or p.dtype == dtype:
                    continue
                new = torch.nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                if cached:
                    del params[name]
                params[name] = new
                done[id(old)] = (old, params.offloaded_values[name] if cached else new)


def summary(job: QuantizeJob, dtype: Any, src_dtype: Any) -> dict[str, str | int | bool]:
    out: dict[str, str | int | bool] = {
        "engine": "llmcompressor", "batch_size": job.batch_size,
        "calibration_dtype": str(dtype).split(".")[-1],
        "export_dtype": str(src_dtype).split(".")[-1]}
    from quantize.checks.placement import load_plan

    plan = load_plan(job.device, job.placement, job.host_tier, job.world_size, job.cpu_budget,
                     job.offload_dir)
    out["weights"] = plan.where
    if "offload_folder" in plan.kwargs:
        out["disk_offload"] = True
    return out


def _drop_offload(job: QuantizeJob) -> None:
    """The disk offload folder holds a copy of the weights: never leave it behind."""
    if job.offload_dir is not None:
        import shutil

        shutil.rmtree(job.offload_dir, ignore_errors=True)


def _gpu_speedups(offload: bool = False) -> OneshotArgs:
    """GPU defaults measured on an H200 with the Llama-3.1-8B architecture (bench/RESULTS.md):
    TF32 for the fp32 Hessian accumulation (26.1 s -> 7.1 s; GPTQ losses moved by -0.005% in
    total) and layer activations kept on the GPU instead of host memory (10.9 s -> 0.3 s,
    bit-identical losses, +0.7 GiB) unless the memory check chose to `offload` them."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    return {"sequential_offload_device": "cpu" if offload else "cuda"}




BACKEND = LLMCompressorBackend()
