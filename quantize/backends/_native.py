"""What the native-format engines (GPTQModel, AutoAWQ) share: their console output goes to a
log file, and their checkpoint is finished so that only the weights and the quantization
config differ from the source model (the same tokenizer, generation config and model config
as the llm-compressor exports)."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from quantize.errors import QuantizationError
from quantize.model.config import read_config, torch_dtype, write_config
from quantize.model.qconfig import (  # noqa: F401 (verify imports NATIVE_METHODS from here)
    NATIVE_METHODS,
    QuantizationJSON,
    raw_quant_config,
    with_quant_config,
)

# Files a checkpoint's tokenizer consists of; the engines rewrite them in their own way
# (GPTQModel adds a pad token and renames the tokenizer class), so they are written afresh.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt",
                    "added_tokens.json")


# What the engines raise for a model, config or environment they cannot handle: reported as
# one line that names the engine's full log (MemoryError and Ctrl-C pass through).
ENGINE_ERRORS = (ValueError, RuntimeError, TypeError, NotImplementedError, KeyError,
                 AttributeError, OSError)


@contextlib.contextmanager
def engine_run(engine: str, log: Path) -> Iterator[None]:
    """The engine's console output into `log`, its failures into one QuantizationError."""
    from quantize.errors import QuantizationError, first_line

    try:
        with engine_output(log):
            yield
    except ENGINE_ERRORS as exc:
        raise QuantizationError(problem=f"{engine} failed: {first_line(exc)} (full log: {log})") \
            from exc


def quiet_imports() -> None:
    """torchao (a GPTQModel dependency that transformers imports when present) logs missing
    CUDA libraries and torch logs enum deprecations on every import: noise, not problems."""
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*is deprecated.*", category=FutureWarning)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    keep_user_hf_cache()


# tokenicer (a GPTQModel dependency) sets these at import when they are unset, HF_HOME to
# /tmp/tokenicer_hf_home: this process's and every child's Hub cache would move to /tmp.
_HF_CACHE_VARS = ("HF_HOME", "HF_HUB_CACHE", "TRANSFORMERS_CACHE", "HF_MODULES_CACHE")


def keep_user_hf_cache() -> None:
    """Import tokenicer (once, before GPTQModel does) and put the user's cache variables back
    as they were, so the Hub cache stays where the user keeps it."""
    if "tokenicer" in sys.modules or importlib.util.find_spec("tokenicer") is None:
        return
    saved = {k: os.environ.get(k) for k in _HF_CACHE_VARS}
    try:
        importlib.import_module("tokenicer")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def engine_output(log: Path) -> Iterator[None]:
    """Send everything the engine prints (Python and C++, stdout and stderr: progress bars,
    tables, compiler output) to `log` instead of the console, at the file-descriptor level,
    because these engines keep their own references to the original streams."""
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "ab") as fh:
        try:
            os.dup2(fh.fileno(), 1)
            os.dup2(fh.fileno(), 2)
            yield
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def cpu_workers() -> None:
    """GPTQModel's loader pool asks for 2 CPU workers but sizes the parent pool to half the
    cores, so on a 2-core machine it refuses to start ("requests 2 workers but parent 'cpu'
    only has 1"); it reads GPTQMODEL_CPU_WORKERS when the pool is first built."""
    default = ((os.cpu_count() or 1) + 1) // 2
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(2, default)))


def require_loader(quant_method: str) -> None:
    """Raise a clear error when transformers cannot load a native checkpoint here: it loads
    them through GPTQModel's kernels (and optimum for GPTQ)."""
    from quantize.errors import BackendUnavailable

    missing = [m for m in ("gptqmodel", "optimum") if importlib.util.find_spec(m) is None]
    if missing:
        raise BackendUnavailable(
            problem=f"loading a native {quant_method} checkpoint in transformers needs "
                    f"{' and '.join(missing)}",
            hint="install with `pip install -e .[gptqmodel]`")


@contextlib.contextmanager
def native_load(quant_method: str) -> Iterator[None]:
    """Around transformers' from_pretrained of a native checkpoint: check the loader is
    installed, and keep GPTQModel's banner and kernel-selection lines off the console."""
    require_loader(quant_method)
    cpu_workers()
    quiet_imports()
    with engine_output(Path(os.devnull)):
        yield


def source_dtype(path: Path) -> Any:
    """The checkpoint's 16-bit dtype (bfloat16 when config.json names none or fp32)."""
    return torch_dtype(read_config(path))


def finish(out: Path, source: Path, logs: Path, dtype: Any) -> QuantizationJSON:
    """Make the engine's folder an export like the others: the source's tokenizer, generation
    config and model config (plus the engine's quantization block and the weights' dtype,
    quantize.model.qconfig.with_quant_config); the engine's per-layer log moves to the run's
    logs. Returns the quantization block as the engine wrote it, typed."""
    from transformers import AutoTokenizer

    for name in ("quant_log.csv",):
        if (out / name).is_file():
            logs.mkdir(parents=True, exist_ok=True)
            shutil.move(str(out / name), str(logs / name))
    for name in _TOKENIZER_FILES:
        (out / name).unlink(missing_ok=True)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    gen = source / "generation_config.json"
    if gen.is_file():
        shutil.copyfile(gen, out / "generation_config.json")
    else:  # the engine would invent one (GPTQModel sets do_sample: true)
        (out / "generation_config.json").unlink(missing_ok=True)
    qc = raw_quant_config(read_config(out))
    if qc is None:
        raise QuantizationError(path=out, problem="the engine wrote no quantization block into "
                                "config.json", hint="re-run the quantize stage")
    write_config(out, with_quant_config(read_config(source), qc,
                                        str(dtype).removeprefix("torch.")))
    return QuantizationJSON.model_validate(qc)


def check_job(job: Any, engine: str) -> None:
    """What the pipeline can ask that these engines do not do here: refuse, never ignore."""
    from quantize.errors import NotImplementedFeature

    fix = "or use backend: llmcompressor"
    if job.world_size > 1:
        raise NotImplementedFeature(problem=f"backend {engine} runs in one process here",
                                    hint=f"drop --gpus {job.world_size} {fix}")
    if job.host_tier == "disk":
        raise NotImplementedFeature(
            problem=f"the model does not fit in host RAM and backend {engine} keeps it there "
                    "(no offload to disk here)",
            hint=f"free memory {fix}")


def require_packed_samples(samples: list[list[int]], engine: str) -> None:
    """Engines that re-cut the calibration stream need equal-length (packed) samples to see
    exactly the windows the calibration stage made."""
    from quantize.errors import NotImplementedFeature

    if len({len(s) for s in samples}) > 1:
        raise NotImplementedFeature(
            problem=f"backend {engine} concatenates calibration samples and cuts equal "
                    "windows, so samples of different lengths would change what it calibrates on",
            hint="use a calibration spec with packing: true")
