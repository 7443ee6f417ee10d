"""Byte counts and markdown tables, written one way (quantize/textfmt.py)."""

from __future__ import annotations

from quantize.textfmt import human_bytes, md_table


def test_human_bytes_units_top_and_digits() -> None:
    assert human_bytes(512) == "512 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 * 2**40) == "3.0 TiB"
    assert human_bytes(3 * 2**40, top="GiB") == "3072.0 GiB"
    assert human_bytes(1.5 * 2**30, top="GiB", digits=2) == "1.50 GiB"


def test_md_table_aligns_numbers_right() -> None:
    assert md_table(("a", "n"), [("x", 1), ("y", 22)], right=(1,)) == [
        "| a | n |", "| --- | ---: |", "| x | 1 |", "| y | 22 |"]
