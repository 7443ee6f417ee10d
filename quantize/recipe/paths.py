"""Where the project's files live, and the one rule for paths a spec may name."""

from __future__ import annotations

import os
from pathlib import Path

from quantize.errors import RecipeError

# Where recipes/, calibration/ and eval/ live: the project checkout (editable install), or
# QUANTIZE_HOME for a relocated copy.
PROJECT_ROOT = Path(os.environ.get("QUANTIZE_HOME", Path(__file__).resolve().parents[2]))
# Data shipped inside the package (default texts, bigbench tasks, GPU catalog, configs).
DATA_DIR = Path(__file__).resolve().parents[1] / "data"


def contained(base: Path, raw: str, allowed: bool, what: str, where: str) -> Path:
    """`raw` (with `~` expanded) resolved against `base`; an absolute path or one leaving
    `base` (`..`, symlinks) is refused unless `allowed`. `where` names `base` in the error."""
    p = Path(raw).expanduser()
    path = (p if p.is_absolute() else base / p).resolve()
    if not allowed and (p.is_absolute() or not path.is_relative_to(base.resolve())):
        raise RecipeError(problem=f"{what} {raw!r} leaves {where}",
                          hint="use a path inside that folder or set allow_external_path: true")
    return path
