"""Hostile YAML (issue #47, defect 6): every document is refused or loaded within a second, as
one RecipeError line naming the file (and the line) and the limit; never a traceback, a hang or
a gigabyte. Every YAML file the product reads goes through quantize/recipe/yamlio.py, so the
matrix runs on the recipe loader and the other loaders are checked to share it."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from quantize.errors import RecipeError
from quantize.recipe import yamlio
from quantize.recipe.recipe import load_calibration, load_recipe, load_suite

HEAD = "name: r\ndescription: d\nmethod: gptq\nscheme: W4A16\n"  # lines 1-4


def _laughs(levels: int, fan: int = 9) -> str:
    """A "billion laughs" document: each level's list holds `fan` aliases of the one before."""
    out = ["a0: &a0 [" + ",".join(["lol"] * fan) + "]\n"]
    for i in range(1, levels):
        out.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * fan) + "]\n")
    return "".join(out)


# (case, document, the words of the problem, its line or None: the whole file)
MATRIX: list[tuple[str, str | bytes, str, int | None]] = [
    ("billion-laughs", HEAD + _laughs(9), "holds more than 10,000 values (the limit), each alias "
     "counted", 9),
    ("laughs-of-mappings", HEAD + "a: &a {k0: x, k1: x, k2: x, k3: x}\n" + "".join(
        f"b{i}: &b{i} {{" + ", ".join(f"k{j}: *{'a' if i == 0 else f'b{i - 1}'}"
                                      for j in range(6)) + "}\n" for i in range(8)),
     "holds more than 10,000 values", 9),
    ("alias-in-its-own-anchor", HEAD + "targets: &t [Linear, *t]\n",
     "alias *t is inside the value &t it names (a recursive document)", 5),
    ("undefined-alias", HEAD + "targets: *nowhere\n", "found undefined alias 'nowhere'", 5),
    ("anchor-twice", HEAD + "ignore: &x [lm_head]\ntargets: &x [Linear]\n",
     "anchor &x is defined twice (first at line 5)", 6),
    ("huge-document", HEAD + "description: " + "x" * (10 << 20) + "\n",
     "over the limit of 1,048,576 (1 MiB)", None),
    ("many-lines", HEAD + "\n" * 200_000, "the file has 200,004 lines, over the limit of "
     "100,000", None),
    ("many-values", HEAD + "targets: [" + ", ".join(["Linear"] * 12_000) + "]\n",
     "holds more than 10,000 values (the limit)", 5),
    ("deep-flow-nesting", HEAD + "targets: " + "[" * 100_000 + "\n",
     "nests more than 64 lists or mappings deep (the limit)", 5),
    ("deep-block-nesting", HEAD + "gptq:\n" + "".join(
        " " * (i + 1) + f"k{i}:\n" for i in range(200)), "nests more than 64", 68),
    ("merge-key", HEAD + "gptq: &g {block_size: 64}\nawq:\n  <<: *g\n  n_grid: 4\n",
     "merge keys (<<) are not supported", 7),
    ("merge-key-hides-duplicate", HEAD + "gptq:\n  <<: {block_size: 32}\n  block_size: 64\n",
     "merge keys (<<) are not supported", 6),
    ("list-as-key", HEAD + "? [a, b]\n: 1\n", "a mapping key must be a plain value", 5),
    ("python-object-tag", HEAD + "x: !!python/object/apply:os.system [echo hi]\n",
     "could not determine a constructor for the tag 'tag:yaml.org,2002:python/object", 5),
    ("local-tag", HEAD + "x: !secret y\n", "could not determine a constructor for the tag", 5),
    ("nul-byte", HEAD + "description: a\x00b\n", "unacceptable character #x0000", 5),
    ("control-character", HEAD + "description: a\x1bb\n", "unacceptable character #x001b", 5),
    ("non-utf8", HEAD.encode() + b"description: \xff\xfe\n", "not UTF-8 text", None),
    ("5000-digit-integer", HEAD + "gptq: {block_size: " + "9" * 5000 + "}\n",
     "an integer of 5,000 characters (the limit is 80)", 5),
    ("base-60-integer", HEAD + "gptq: {block_size: 1" + ":1" * 3000 + "}\n",
     "an integer of 6,001 characters", 5),
    ("integer-beyond-64-bits", HEAD + "calibration: {builtin: wiki, seed: 99999999999999999999}\n",
     "integer 99999999999999999999 does not fit in 64 bits", 5),
    ("impossible-date", HEAD.replace("description: d", "description: 2024-13-45"),
     "cannot read this value (month must be in 1..12)", 2),
    ("two-documents", HEAD + "---\nname: s\n", "expected a single document in the stream, but "
     "found another document", 5),
    ("duplicate-key", HEAD + "method: rtn\n", "duplicate key 'method' (first at line 3)", 5),
]


@pytest.fixture
def write(tmp_path: Path) -> Callable[[str | bytes], Path]:
    def _write(text: str | bytes) -> Path:
        path = tmp_path / "r.yaml"
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text, encoding="utf-8")
        return path

    return _write


@pytest.mark.parametrize(("text", "problem", "line"), [m[1:] for m in MATRIX],
                         ids=[m[0] for m in MATRIX])
def test_hostile_recipe_is_one_line_within_a_second(write: Callable[[str | bytes], Path],
                                                    text: str | bytes, problem: str,
                                                    line: int | None) -> None:
    path = write(text)
    start = time.process_time()  # CPU seconds: the machine may be shared
    with pytest.raises(RecipeError) as info:
        load_recipe(str(path))
    # refused in well under a second on an idle core; 3 CPU s leaves room for a core shared
    # with other work (1.4 s seen) and still fails a parser that expands the input
    assert time.process_time() - start < 3.0
    err = info.value
    assert (err.path, err.line) == (str(path), line)
    assert err.problem is not None and problem in err.problem, err.problem
    message = str(err)
    assert "\n" not in message and len(message) < 400, message
    assert message.startswith(f"{path}:{line}: " if line else f"{path}: ")


def test_the_bomb_through_the_cli_is_one_line_exit_2(write: Callable[[str | bytes], Path]
                                                      ) -> None:
    from quantize.cli import main

    path = write(HEAD + _laughs(9))  # ~500 bytes: ran past 120 s before the limits
    assert path.stat().st_size < 600
    start = time.process_time()
    res = CliRunner().invoke(main, ["validate", str(path), "--no-model"])
    assert time.process_time() - start < 1.0
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert lines[0].startswith(f"error: {path}:9: the document holds more than 10,000 values")
    assert "Traceback" not in res.output


@pytest.mark.parametrize("loader", ["calibration", "suite", "gpus", "text"])
def test_every_yaml_loader_shares_the_limits(tmp_path: Path, loader: str) -> None:
    """Calibration specs, eval suites and GPU files are refused as recipes are."""
    path = tmp_path / "bomb.yaml"
    path.write_text("name: bomb\n" + _laughs(9), encoding="utf-8")
    with pytest.raises(RecipeError) as info:
        if loader == "calibration":
            load_calibration(str(path))
        elif loader == "suite":
            load_suite(str(path))
        elif loader == "gpus":
            from quantize.planner.gpus import find

            find("h100", path)
        else:
            yamlio.load_yaml(path.read_text(), str(path))
    assert info.value.path == str(path) and info.value.line == 6  # a4: 9**5 values
    assert info.value.problem is not None and "10,000 values" in info.value.problem


def test_a_huge_file_is_refused_unread(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    with big.open("wb") as f:
        f.truncate(10 << 30)  # 10 GiB, sparse: reading it would take minutes
    start = time.perf_counter()
    with pytest.raises(RecipeError) as info:
        yamlio.read_text(big)
    assert time.perf_counter() - start < 0.5
    assert info.value.problem == ("the file is 10,737,418,240 bytes, over the limit of "
                                  "1,048,576 (1 MiB)")


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_an_endless_stream_is_read_up_to_the_limit() -> None:
    with pytest.raises(RecipeError) as info:
        yamlio.read_text(Path("/dev/zero"))
    assert info.value.problem is not None and "over the limit of 1,048,576" in info.value.problem


def test_small_aliases_still_load(write: Callable[[str | bytes], Path]) -> None:
    r = load_recipe(str(write(HEAD + "targets: &t [Linear]\noverrides:\n  - targets: *t\n"
                              "    scheme: W8A16\n")))
    assert r.targets == ["Linear"] and r.overrides[0].targets == ["Linear"]


def test_the_limits_are_inclusive(monkeypatch: pytest.MonkeyPatch) -> None:
    """64 levels deep and MAX_NODES values load; one more is refused."""
    lists = "[" * 62 + "[]" + "]" * 62  # 63 lists in each other, in the document's mapping
    data, _ = yamlio.load_yaml(f"x: {lists}\n", "d.yaml")
    assert isinstance(data["x"], list)
    with pytest.raises(RecipeError, match="nests more than 64"):
        yamlio.load_yaml(f"x: [{lists}]\n", "d.yaml")
    monkeypatch.setattr(yamlio, "MAX_NODES", 50)
    items = 50 - 3  # with the document's mapping, its key and the list
    ok, _ = yamlio.load_yaml("x: [" + ", ".join(["1"] * items) + "]\n", "n.yaml")
    assert len(ok["x"]) == items
    with pytest.raises(RecipeError, match="more than 50 values"):
        yamlio.load_yaml("x: [" + ", ".join(["1"] * (items + 1)) + "]\n", "n.yaml")


def test_many_problems_are_capped_in_one_short_line(write: Callable[[str | bytes], Path]
                                                     ) -> None:
    """1,000 unknown fields: the first 5 and a count (5,000 fields was a 384 KB line; it is
    now over the value limit, also one short line)."""
    path = write(HEAD + "".join(f"field{i}: 1\n" for i in range(1000)))
    with pytest.raises(RecipeError) as info:
        load_recipe(str(path))
    message = str(info.value)
    assert "\n" not in message and len(message.replace(str(path), "")) < 400, message
    assert message.count("unknown field") == yamlio.MAX_LISTED
    assert message.startswith(f"{path}:5: field0: unknown field; remove it or check its spelling")
    assert message.endswith("; ... and 995 more problems")
    few = write(HEAD + "field0: 1\nfield1: 2\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(str(few))
    assert "more problem" not in str(info.value) and str(info.value).count("unknown field") == 2
    huge = write(HEAD + "".join(f"field{i}: 1\n" for i in range(5000)))
    with pytest.raises(RecipeError) as info:
        load_recipe(str(huge))
    assert len(str(info.value)) < 400 and "10,000 values" in str(info.value)


def test_a_long_unknown_key_is_clipped(write: Callable[[str | bytes], Path]) -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe(str(write(HEAD + "? " + "k" * 100_000 + "\n: 1\n")))
    assert info.value.problem is not None and len(info.value.problem) < 200
    assert info.value.problem.endswith("...: unknown field")
