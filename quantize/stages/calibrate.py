"""calibrate: read the dataset spec's text and turn it into a tokenized, fingerprinted set.

Output (in the stage folder): `calibration.safetensors` (`input_ids` int64 [n, L] padded with
0, `lengths` int64 [n]) and `calibration.json` (fingerprint = sha256 of the token ids, counts,
source). Two runs whose fingerprints match provably calibrated on the same tokens.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantize.errors import CalibrationError, first_line
from quantize.recipe.paths import contained
from quantize.recipe.recipe import CalibrationSpec, Recipe, load_calibration, resolve
from quantize.recipe.texts import BUILTIN_TEXT, hub_texts
from quantize.run.files import atomic_write_json, sha256_file
from quantize.run.results import CalibrationSummary

if TYPE_CHECKING:
    import torch

NAME = "calibrate"
_TEXT_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")


# --- which spec -----------------------------------------------------------------------------
def resolve_spec(recipe: Recipe, dataset: str | None) -> tuple[CalibrationSpec, Path]:
    """The recipe's calibration spec, or the one --dataset names.

    --dataset accepts a spec name from calibration/, a spec YAML path, a data file or folder
    (.txt/.jsonl/.parquet), or `hf:<dataset id>`; data paths keep the recipe's sample count
    and length.
    """
    if dataset is None:
        if isinstance(recipe.calibration, CalibrationSpec):
            return recipe.calibration, Path.cwd()
        return load_calibration(recipe.calibration)
    base, _ = (
        (recipe.calibration, Path.cwd()) if isinstance(recipe.calibration, CalibrationSpec)
        else load_calibration(recipe.calibration))
    if dataset.startswith("hf:"):
        return _cli_spec(base, hub=dataset[3:]), Path.cwd()
    p = Path(dataset)
    if p.suffix in (".yaml", ".yml") or (not p.exists() and "/" not in dataset):
        return load_calibration(str(resolve("calibration", dataset)))
    if not p.exists():
        raise CalibrationError(problem=f"dataset {dataset!r}: no such file or folder",
                               hint="give a .txt/.jsonl/.parquet file or folder, a spec name, "
                                    "or hf:<id>")
    return _cli_spec(base, path=str(p.resolve())), Path.cwd()


def _cli_spec(base: CalibrationSpec, *, hub: str | None = None, path: str | None = None
              ) -> CalibrationSpec:
    """--dataset's data with the recipe's sample count, length, seed, template and packing."""
    return CalibrationSpec(name="cli", hub=hub, path=path, allow_external_path=path is not None,
                           num_samples=base.num_samples, seq_len=base.seq_len, seed=base.seed,
                           chat_template=base.chat_template, packing=base.packing)


def _data_path(spec: CalibrationSpec, base_dir: Path) -> Path:
    assert spec.path is not None
    path = contained(base_dir, spec.path, spec.allow_external_path, "calibration path",
                     "the spec's folder")
    if not path.exists():
        raise CalibrationError(problem=f"calibration path {path} does not exist",
                               hint="fix `path:`")
    return path


def _read_txt(path: Path) -> list[str]:
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise CalibrationError(path=path, path_sep=" ",
                               problem=f"is not UTF-8 text (byte {exc.start})",
                               hint="convert it to UTF-8") from None
    return [line.strip() for line in raw.splitlines() if line.strip()]


def _read_records(path: Path, field: str) -> list[str]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as exc:
            raise CalibrationError(path=path,
                                   problem=f"cannot read parquet ({first_line(exc)})") from None
        if field not in table.column_names:
            raise CalibrationError(path=path, path_sep=" ", hint="set text_field",
                                   problem=f"has no column {field!r} (columns: "
                                           f"{table.column_names})")
        return [str(x) for x in table.column(field).to_pylist() if x]
    texts = []
    for i, line in enumerate(_read_txt(path), 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise CalibrationError(path=path, line=i, problem="not a JSON line",
                                   hint="fix or remove it") from None
        if not isinstance(rec, dict) or field not in rec:
            raise CalibrationError(path=path, line=i, problem=f"no field {field!r}",
                                   hint="set text_field")
        if rec[field]:
            texts.append(str(rec[field]))
    return texts


def _read_file(path: Path, field: str) -> list[str]:
    if path.suffix == ".txt":
        return _read_txt(path)
    if path.suffix in (".jsonl", ".json", ".parquet"):
        return _read_records(path, field)
    raise CalibrationError(path=path, problem="unsupported file type",
                           hint="use .txt, .jsonl or .parquet")


def _read_hub(spec: CalibrationSpec) -> list[str]:
    assert spec.hub is not None
    return hub_texts(spec.hub, spec.subset, spec.split, spec.text_field, CalibrationError,
                     "check the id and network, or use a local file / the builtin `wiki`")


def source_files(spec: CalibrationSpec, base_dir: Path) -> list[Path]:
    if spec.builtin is not None:
        return [BUILTIN_TEXT[spec.builtin]]
    if spec.path is None:
        return []
    path = _data_path(spec, base_dir)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in _TEXT_SUFFIXES and p.is_file())
        if not files:
            raise CalibrationError(path=path, path_sep=" ",
                                   problem="holds no .txt/.jsonl/.parquet files")
        return files
    return [path]


def read_texts(spec: CalibrationSpec, base_dir: Path) -> list[str]:
    if spec.hub is not None:
        texts = _read_hub(spec)
    else:
        texts = [t for f in source_files(spec, base_dir) for t in _read_file(f, spec.text_field)]
    if not texts:
        raise CalibrationError(problem=f"calibration source of spec {spec.name!r} holds no text",
                               hint="point it at a non-empty file")
    return texts


def source_fingerprint(spec: CalibrationSpec, base_dir: Path) -> str:
    """Cheap identity of the raw source, for the stage cache key."""
    if spec.hub is not None:
        return f"hub:{spec.hub}:{spec.subset}:{spec.split}"
    return ",".join(sha256_file(f) for f in source_files(spec, base_dir))


# --- tokenizing -----------------------------------------------------------------------------
def tokenize(spec: CalibrationSpec, texts: list[str], tokenizer: Any) -> list[list[int]]:
    """Shuffle with the spec's seed, then pack into exact windows or truncate per text."""
    order = list(texts)
    random.Random(spec.seed).shuffle(order)
    if spec.chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise CalibrationError(problem="chat_template: true but the tokenizer has no chat "
                                           "template", hint="set chat_template: false")
        order = [tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                               tokenize=False) for t in order]
    need = spec.num_samples * spec.seq_len
    if spec.packing:
        ids: list[int] = []
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        for text in order:
            ids += tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"]
            if len(ids) >= need:
                break
        if len(ids) < need:
            raise CalibrationError(
                problem=f"calibration text has {len(ids)} tokens but the spec needs {need} "
                        f"({spec.num_samples} samples × {spec.seq_len})",
                hint="lower num_samples or seq_len, or add text")
        # Each window starts with BOS, as the model saw in training.
        body = spec.seq_len - len(bos)
        return [bos + ids[i * body:(i + 1) * body] for i in range(spec.num_samples)]
    samples = []
    for text in order:
        tok = tokenizer(text, add_special_tokens=True, truncation=True,
                        max_length=spec.seq_len)["input_ids"]
        if len(tok) >= min(16, spec.seq_len):
            samples.append(tok)
        if len(samples) == spec.num_samples:
            return samples
    raise CalibrationError(problem=f"only {len(samples)} texts are long enough, the spec needs "
                                   f"{spec.num_samples}",
                           hint="lower num_samples or set packing: true")


def fingerprint(samples: list[list[int]]) -> str:
    h = hashlib.sha256()
    for s in samples:
        h.update(len(s).to_bytes(8, "little"))
        for t in s:
            h.update(int(t).to_bytes(8, "little", signed=True))
    return h.hexdigest()


def to_tensors(samples: list[list[int]]) -> dict[str, torch.Tensor]:
    import torch

    longest = max(len(s) for s in samples)
    ids = torch.zeros((len(samples), longest), dtype=torch.int64)
    for i, s in enumerate(samples):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.int64)
    return {"input_ids": ids, "lengths": torch.tensor([len(s) for s in samples])}


def from_tensors(tensors: dict[str, torch.Tensor]) -> list[list[int]]:
    ids, lengths = tensors["input_ids"], tensors["lengths"]
    return [ids[i, : int(n)].tolist() for i, n in enumerate(lengths)]


def run(spec: CalibrationSpec, base_dir: Path, tokenizer: Any, out: Path
        ) -> CalibrationSummary:
    """Build the calibration set into `out`; return the summary the manifest records."""
    from safetensors.torch import save_file

    samples = tokenize(spec, read_texts(spec, base_dir), tokenizer)
    save_file(to_tensors(samples), str(out / "calibration.safetensors"))
    summary = CalibrationSummary(
        fingerprint=fingerprint(samples),
        num_samples=len(samples),
        seq_len=spec.seq_len,
        tokens=sum(len(s) for s in samples),
        spec=spec,
    )
    atomic_write_json(out / "calibration.json", summary.to_json())
    return summary


def load(stage_dir: Path) -> list[list[int]]:
    from safetensors.torch import load_file

    return from_tensors(load_file(str(stage_dir / "calibration.safetensors")))
