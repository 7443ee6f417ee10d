"""The GPU catalog for `quantize plan`: memory as CUDA reports it, FP8/INT8 support and
compute capability. Shipped in quantize/data/gpus.yaml; a user file extends or overrides it
(--gpu-file, QUANTIZE_GPUS, or ~/.config/quantize/gpus.yaml)."""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from quantize.errors import PlanError
from quantize.recipe.paths import DATA_DIR
from quantize.recipe.yamlio import load_yaml, read_text, validation_error

DATA = DATA_DIR / "gpus.yaml"
USER_FILE = Path("~/.config/quantize/gpus.yaml").expanduser()


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


class Gpu(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9.-]*$")]
    aliases: list[str] = Field(default_factory=list)
    label: str = ""
    memory_gib: float = Field(gt=0, le=4096, description="total memory as CUDA reports it")
    memory_source: str = ""
    compute_capability: Annotated[str, Field(pattern=r"^\d+\.\d+$")]
    fp8: bool = Field(description="FP8 tensor cores (capability >= 8.9)")
    int8: bool | None = Field(default=True, description="INT8 W8A8 kernels; null = unverified")

    @property
    def capability(self) -> tuple[int, int]:
        major, minor = self.compute_capability.split(".")
        return int(major), int(minor)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * (1 << 30))

    @property
    def large_defaults(self) -> bool:
        """vLLM's larger scheduler defaults apply (>= 70 GiB and not an A100, see
        EngineArgs.get_batch_defaults in vllm/engine/arg_utils.py)."""
        return self.memory_gib >= 70 and "a100" not in self.name


class _Catalog(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gpus: list[Gpu] = Field(min_length=1)


def _read(path: Path) -> list[Gpu]:
    data, lines = load_yaml(read_text(path), str(path))
    try:
        return _Catalog.model_validate(data, strict=True).gpus
    except ValidationError as exc:
        raise validation_error(PlanError, exc, str(path), lines, data) from None


def _user_files(extra: Path | None) -> list[Path]:
    files = []
    if USER_FILE.is_file():
        files.append(USER_FILE)
    env = os.environ.get("QUANTIZE_GPUS")
    if env:
        files.append(Path(env).expanduser())
    if extra is not None:
        files.append(extra)
    for f in files:
        if not f.is_file():
            raise PlanError(problem=f"GPU file {f} does not exist",
                            hint=f"give a YAML file with a `gpus:` list in the format of {DATA}")
    return files


def catalog(extra: Path | None = None) -> dict[str, Gpu]:
    """All known GPUs by name: the shipped catalog, then user files (later names win)."""
    gpus: dict[str, Gpu] = {}
    for path in [DATA, *_user_files(extra)]:
        for gpu in _read(path):
            gpus[gpu.name] = gpu
    return gpus


def find(name: str, extra: Path | None = None) -> Gpu:
    """A GPU by name or alias, ignoring case and punctuation (`RTX 5090` = `rtx5090`)."""
    gpus = catalog(extra)
    want = _norm(name)
    for gpu in gpus.values():
        keys = {_norm(gpu.name), *(_norm(a) for a in gpu.aliases)}
        if want in keys or want.replace("-", "") in {k.replace("-", "") for k in keys}:
            return gpu
    close = difflib.get_close_matches(want, list(gpus), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise PlanError(problem=f"unknown GPU {name!r}",
                    hint=f"{hint}known: {', '.join(sorted(gpus))}; add yours with --gpu-file "
                         "(see quantize/data/gpus.yaml for the format)")
