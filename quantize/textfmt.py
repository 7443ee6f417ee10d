"""Text the product writes for people: byte counts and markdown tables, one way each (the
reports, the card, the CLI and the one-line errors use these)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def human_bytes(n: float, top: str = "TiB", digits: int = 1) -> str:
    """A byte count in the largest binary unit below 1024, up to `top` (B, KiB, ... TiB)."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    for unit in units[: units.index(top) + 1]:
        if abs(n) < 1024 or unit == top:
            return f"{int(n)} B" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    return f"{n:.{digits}f} {top}"


def md_table(head: Sequence[str], rows: Iterable[Sequence[object]],
             right: Iterable[int] = ()) -> list[str]:
    """A markdown table's lines: the header, the rule (columns in `right` right-aligned, for
    numbers) and one line per row."""
    align = set(right)
    rule = ["---:" if i in align else "---" for i in range(len(head))]
    out = ["| " + " | ".join(head) + " |", "| " + " | ".join(rule) + " |"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out
