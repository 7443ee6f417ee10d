"""AutoAWQ (legacy): AWQ written as a native AWQ GEMM checkpoint (`quant_method: awq`,
zero points), which vLLM loads with Marlin on a GPU and CPUWNA16 on a CPU.

AutoAWQ is archived upstream (its authors point to llm-compressor) and was last tested by
them on torch 2.6 / transformers 4.51. Here it runs on transformers 5.17 only for the model
types checked end to end on this pin (VERIFIED_MODEL_TYPES, see docs/engines.md); any other
model type is refused with a clear error rather than attempted. Installed by the optional
extra `.[autoawq]` (which also brings GPTQModel: transformers loads AWQ checkpoints through
it for evaluation)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import warnings
from pathlib import Path
from typing import Any, TypedDict

from quantize.backends import QuantizeJob
from quantize.backends._native import (
    check_job,
    engine_run,
    finish,
    quiet_imports,
    require_packed_samples,
    source_dtype,
)
from quantize.errors import NotImplementedFeature
from quantize.model.config import ModelConfig, read_config
from quantize.recipe.options import AWQOptions
from quantize.recipe.recipe import Recipe
from quantize.recipe.schemes import SCHEMES

for _mod in ("awq", "gptqmodel", "optimum"):
    if importlib.util.find_spec(_mod) is None:
        raise ModuleNotFoundError(f"No module named {_mod!r}", name=_mod)

# Model types AutoAWQ 0.2.9 runs with here on transformers 5.17 without an error: a small
# random model of each type quantized and reloaded (docs/engines.md).
VERIFIED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3")
# Running is not working: on the real default model (llama) AutoAWQ 0.2.9 on transformers 5.17
# writes a checkpoint whose perplexity is 194,000 (baseline 17.94) and from which vLLM
# generates garbage too; its weights sit 2-6x further from the AWQ-scaled source than
# GPTQModel's (docs/engines.md). Random tiny models cannot show this, so the backend refuses
# by default; this variable lets someone reproduce or debug it.
UNVERIFIED_ENV = "QUANTIZE_AUTOAWQ_UNVERIFIED"


def check_model(config: ModelConfig) -> None:
    """Refuse: AutoAWQ's output is broken on the pinned transformers (see above); and with the
    override, model types it was not even run with."""
    tf = importlib.metadata.version("transformers")
    if os.environ.get(UNVERIFIED_ENV, "") in ("", "0"):
        raise NotImplementedFeature(
            problem=f"backend autoawq does not work with transformers {tf}: AutoAWQ 0.2.9 "
                    "(archived upstream, tested by its authors up to transformers 4.51) wrote "
                    "a broken checkpoint of the default model here (perplexity 17.9 -> "
                    "194,000, garbage in vLLM too)",
            hint=f"use awq-int4-gptqmodel or awq-int4 (set {UNVERIFIED_ENV}=1 only to "
                 "reproduce it)")
    mt = config.model_type
    if mt not in VERIFIED_MODEL_TYPES:
        raise NotImplementedFeature(
            problem=f"backend autoawq (archived upstream, tested by its authors only up to "
                    f"transformers 4.51) runs here with transformers {tf} for model_type "
                    f"{', '.join(VERIFIED_MODEL_TYPES)} only, not {mt!r}",
            hint="use backend: gptqmodel or llmcompressor")


class AWQQuantConfig(TypedDict):
    """AutoAWQ's `quant_config` argument."""

    zero_point: bool
    q_group_size: int
    w_bit: int
    version: str


def quant_config(recipe: Recipe, group_size: int | None) -> AWQQuantConfig:
    info = SCHEMES[recipe.scheme]  # W4A16_ASYM: the recipe validator allows nothing else
    return {"zero_point": not info.symmetric, "q_group_size": group_size or -1,
            "w_bit": info.weight_bits, "version": "GEMM"}


def _load_awq() -> Any:
    # AutoAWQ warns on import that it is deprecated: docs/engines.md says so once.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from awq import AutoAWQForCausalLM
    return AutoAWQForCausalLM


class AutoAWQBackend:
    name = "autoawq"

    def check_model(self, config: ModelConfig, recipe: Any = None) -> None:
        check_model(config)

    def quantize(self, job: QuantizeJob, out: Path) -> dict[str, Any]:
        import torch

        check_job(job, self.name)
        quiet_imports()
        check_model(read_config(job.model_path))
        require_packed_samples(job.samples, self.name)
        logs = out.parent / "logs"
        log = logs / "autoawq.log"
        src = source_dtype(job.model_path)
        # fp32 on CPU as with llm-compressor; on a GPU the checkpoint's 16-bit dtype
        dtype = torch.float32 if job.device == "cpu" else src
        opts = job.recipe.awq or AWQOptions()
        seq_len = max(len(s) for s in job.samples)
        with engine_run("autoawq", log):
            from transformers import AutoTokenizer

            awq_cls = _load_awq()
            # loaded in host memory: AutoAWQ moves one decoder layer at a time to the GPU
            model = awq_cls.from_pretrained(
                str(job.model_path), torch_dtype=dtype, device_map=None,
                trust_remote_code=job.recipe.trust_remote_code, safetensors=True)
            tok = AutoTokenizer.from_pretrained(job.model_path)
            # token ids: AutoAWQ concatenates them and cuts seq_len windows, which for
            # packed samples are exactly the calibration stage's windows
            model.quantize(tok, quant_config=quant_config(job.recipe, job.group_size),
                           calib_data=job.samples, max_calib_samples=len(job.samples),
                           max_calib_seq_len=seq_len, duo_scaling=bool(opts.duo_scaling))
            model.model.to(src)
            model.save_quantized(str(out), safetensors=True)
        qc = finish(out, job.model_path, logs, src)
        return {"engine": "autoawq", "engine_version": importlib.metadata.version("autoawq"),
                "quant_method": qc.quant_method, "format": qc.version,
                "calibration_dtype": str(dtype).split(".")[-1],
                "export_dtype": str(src).split(".")[-1]}


BACKEND = AutoAWQBackend()
