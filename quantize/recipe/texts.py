"""The texts a calibration or eval spec can name: the shipped ones (quantize/data/) and one
column of a Hugging Face dataset (online only)."""

from __future__ import annotations

import json

from quantize.errors import QuantizeError, first_line
from quantize.recipe.paths import DATA_DIR

BUILTIN_TEXT = {"wiki": DATA_DIR / "wiki_calibration.txt", "wiki-eval": DATA_DIR / "wiki_eval.txt"}
# what an eval metric's `builtin:` may name: the held-out wiki text and a novel
BUILTIN_EVAL_TEXT = {"wiki-eval": BUILTIN_TEXT["wiki-eval"], "novel": DATA_DIR / "novel.txt"}


def hub_texts(hub: str, subset: str | None, split: str, field: str,
              error: type[QuantizeError], hint: str) -> list[str]:
    """The non-empty values of one column of a Hugging Face dataset (online only)."""
    import datasets

    try:
        ds = datasets.load_dataset(hub, subset, split=split)
    except Exception as exc:
        raise error(problem=f"cannot load dataset {hub!r} ({first_line(exc)})",
                    hint=hint) from None
    if field not in ds.column_names:
        raise error(problem=f"dataset {hub!r} has no column {field!r} (columns: "
                            f"{ds.column_names})", hint="set text_field")
    return [t if isinstance(t, str) else json.dumps(t) for t in ds[field] if t]
