# ruff: noqa: F811  (session fixtures imported from fixtures.convert_models)
"""quantize.pipeline.input_model: an FP8-block source is converted to bf16 once, into the
cache keyed by the source, and reused; other sources pass through untouched."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.convert_models import bf16_dir, bf16_mtp_dir, fp8_dir  # noqa: F401

from quantize.model.formats import Format, detect
from quantize.pipeline import input_model


def test_fp8_block_is_converted_once_and_cached(fp8_dir: tuple, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTIZE_CACHE", str(tmp_path / "cache"))
    ref = input_model.converted_model(str(fp8_dir[0]))
    assert ref is not None and ref.name == "m"
    assert ref.path.parent == tmp_path / "cache" / "models"
    assert detect(ref.path).format is Format.HF_BF16

    import quantize.convert.run as run

    def no_second_conversion(*_a: object, **_k: object) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(run, "convert", no_second_conversion)
    again = input_model.converted_model(str(fp8_dir[0]))
    assert again is not None and again.path == ref.path


def test_other_sources_are_not_converted(bf16_dir: Path) -> None:
    assert input_model.converted_model(str(bf16_dir)) is None
    assert input_model.converted_model(None) is None
    assert input_model.converted_model("default") is None
