from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from quantize.errors import CalibrationError, RecipeError
from quantize.recipe.recipe import CalibrationSpec, load_recipe
from quantize.stages import calibrate


@pytest.fixture(scope="module")
def tok(default_tokenizer: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_tokenizer)


def spec(**kw: Any) -> CalibrationSpec:
    base: dict[str, Any] = {"builtin": "wiki", "num_samples": 4, "seq_len": 64}
    base.update(kw)
    return CalibrationSpec(**base)


def test_packing_gives_exact_windows_starting_with_bos(tok: Any) -> None:
    s = spec()
    samples = calibrate.tokenize(s, calibrate.read_texts(s, Path.cwd()), tok)
    assert len(samples) == 4 and all(len(x) == 64 for x in samples)
    assert all(x[0] == tok.bos_token_id for x in samples)


def test_fingerprint_is_deterministic_and_sensitive(tok: Any) -> None:
    texts = calibrate.read_texts(spec(), Path.cwd())
    a = calibrate.fingerprint(calibrate.tokenize(spec(), texts, tok))
    assert a == calibrate.fingerprint(calibrate.tokenize(spec(), texts, tok))
    assert a != calibrate.fingerprint(calibrate.tokenize(spec(seed=1), texts, tok))
    assert a != calibrate.fingerprint(calibrate.tokenize(spec(num_samples=3), texts, tok))


def test_tensors_round_trip_variable_lengths() -> None:
    samples = [[1, 2, 3], [4, 5], [6]]
    assert calibrate.from_tensors(calibrate.to_tensors(samples)) == samples


def test_too_few_tokens(tmp_path: Path, tok: Any) -> None:
    f = tmp_path / "small.txt"
    f.write_text("only a few words here\n")
    s = spec(builtin=None, path=str(f), allow_external_path=True)
    with pytest.raises(CalibrationError) as err:
        calibrate.tokenize(s, calibrate.read_texts(s, tmp_path), tok)
    assert err.value.problem is not None and err.value.problem.startswith("calibration text has ")
    assert err.value.problem.endswith(" tokens but the spec needs 256 (4 samples × 64)")
    assert err.value.hint is not None and "num_samples" in err.value.hint


def test_texts_shorter_than_needed_without_packing(tmp_path: Path, tok: Any) -> None:
    f = tmp_path / "short.txt"
    f.write_text("tiny\nlines\n")
    s = spec(builtin=None, path=str(f), allow_external_path=True, packing=False)
    with pytest.raises(CalibrationError) as err:
        calibrate.tokenize(s, calibrate.read_texts(s, tmp_path), tok)
    assert err.value.problem == "only 0 texts are long enough, the spec needs 4"
    assert err.value.hint is not None and "packing: true" in err.value.hint


@pytest.mark.parametrize(
    ("name", "content", "where", "problem", "hint"),
    [
        ("empty.txt", b"", (None, None),
         "calibration source of spec 'inline' holds no text", "a non-empty file"),
        ("latin1.txt", "caf\xe9 au lait\n".encode("latin-1"), ("f", None),
         "is not UTF-8 text (byte 3)", "UTF-8"),
        ("bad.jsonl", b'{"text": "a"}\nnot json\n', ("f", 2), "not a JSON line", "fix or remove"),
        ("field.jsonl", b'{"body": "a"}\n', ("f", 1), "no field 'text'", "set text_field"),
        ("data.csv", b"a,b\n", ("f", None), "unsupported file type", ".jsonl"),
    ],
)
def test_bad_files(tmp_path: Path, name: str, content: bytes,
                   where: tuple[str | None, int | None], problem: str, hint: str) -> None:
    f = tmp_path / name
    f.write_bytes(content)
    with pytest.raises(CalibrationError) as err:
        calibrate.read_texts(spec(builtin=None, path=name), tmp_path)
    assert err.value.problem == problem
    assert err.value.hint is not None and hint in err.value.hint
    assert (err.value.path, err.value.line) == (str(f) if where[0] else None, where[1])


def test_jsonl_and_folder_sources(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    (tmp_path / "d" / "b.txt").write_text("world\n\nagain\n")
    texts = calibrate.read_texts(spec(builtin=None, path="d"), tmp_path)
    assert texts == ["hello", "world", "again"]


def test_paths_cannot_escape_the_spec_folder(tmp_path: Path) -> None:
    for raw in ("../etc/passwd", "/etc/hostname"):
        with pytest.raises(RecipeError) as err:
            calibrate.read_texts(spec(builtin=None, path=raw), tmp_path)
        assert err.value.problem == f"calibration path {raw!r} leaves the spec's folder"
        assert err.value.hint is not None and "allow_external_path: true" in err.value.hint


def test_missing_path() -> None:
    with pytest.raises(CalibrationError) as err:
        calibrate.read_texts(spec(builtin=None, path="nope.txt"), Path.cwd())
    assert err.value.problem == f"calibration path {Path.cwd() / 'nope.txt'} does not exist"
    assert err.value.hint == "fix `path:`"


def test_dataset_override_keeps_the_recipe_sizes(tmp_path: Path) -> None:
    f = tmp_path / "my.txt"
    f.write_text("x\n")
    s, _ = calibrate.resolve_spec(load_recipe("gptq-int4"), str(f))
    assert s.path == str(f.resolve()) and (s.num_samples, s.seq_len) == (32, 512)
    s, _ = calibrate.resolve_spec(load_recipe("gptq-int4"), "hf:org/data")
    assert s.hub == "org/data"
    with pytest.raises(CalibrationError) as err:
        calibrate.resolve_spec(load_recipe("gptq-int4"), "./missing.txt")
    assert err.value.problem == "dataset './missing.txt': no such file or folder"
    assert err.value.hint is not None and "hf:<id>" in err.value.hint
    with pytest.raises(RecipeError) as unknown:
        calibrate.resolve_spec(load_recipe("gptq-int4"), "wikk")
    assert unknown.value.problem == "unknown calibration spec 'wikk'"
    assert unknown.value.hint is not None and unknown.value.hint.startswith("did you mean 'wiki'?")
