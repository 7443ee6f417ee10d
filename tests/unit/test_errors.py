"""QuantizeError's fields (problem, hint, path, line) and the one line composed from them."""

from __future__ import annotations

from pathlib import Path

import pytest

from quantize.errors import DiskError, QuantizeError, RecipeError, compose


def test_the_line_is_composed_from_the_fields() -> None:
    err = RecipeError(problem="bits: unknown field", hint="remove it", path="r.yaml", line=6)
    assert str(err) == "r.yaml:6: bits: unknown field; remove it"
    assert (err.problem, err.hint, err.path, err.line) == ("bits: unknown field", "remove it",
                                                           "r.yaml", 6)
    assert str(QuantizeError(problem="no layer matches")) == "no layer matches"
    assert str(QuantizeError(problem="p", hint="h")) == "p; h"
    assert str(QuantizeError(problem="has no config.json", hint="fix it", path=Path("/m"),
                             path_sep=" ")) == "/m has no config.json; fix it"


def test_a_whole_message_keeps_its_text_and_may_carry_fields() -> None:
    err = DiskError("full; free space", problem="full", hint="free space", path="/x")
    assert str(err) == "full; free space" and err.path == "/x" and err.problem == "full"
    plain = QuantizeError("as before")
    assert str(plain) == "as before" and plain.problem is plain.hint is plain.path is None
    assert compose("p", None, "f", None) == "f: p"


def test_an_error_needs_a_message_or_a_problem() -> None:
    with pytest.raises(TypeError):
        QuantizeError()
