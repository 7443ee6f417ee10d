"""Strict YAML: duplicate keys are errors, and every value keeps its line number so that
schema errors can point at the line to fix."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import AfterValidator, BaseModel, ValidationError
from pydantic_core import PydanticCustomError

from quantize.errors import QuantizeError, RecipeError, compose

Loc = tuple[str | int, ...]
M = TypeVar("M", bound=BaseModel)
E = TypeVar("E", bound=QuantizeError)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate mapping keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {key!r} (first at line {seen[key]}); keep one of them",
                key_node.start_mark,
            )
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _line_map(node: yaml.Node | None, path: Loc = ()) -> dict[Loc, int]:
    """Map every key path in the document to the 1-based line it starts on."""
    lines: dict[Loc, int] = {}
    if node is None:
        return lines
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            child = (*path, str(key_node.value))
            lines.update(_line_map(value_node, child))
            lines[child] = key_node.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines.update(_line_map(item, (*path, i)))
    return lines


def _one_line(obj: object) -> str:
    return " ".join(str(obj).split())


def load_yaml(text: str, source: str) -> tuple[Any, dict[Loc, int]]:
    """Parse text strictly; return the data and a map from key path to line number."""
    try:
        node = yaml.compose(text, Loader=_StrictLoader)
        data = yaml.load(text, Loader=_StrictLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem, hint = _split(f"invalid YAML: {_one_line(exc.problem or exc)}")
        raise RecipeError(problem=problem, hint=hint, path=source,
                          line=mark.line + 1 if mark else None) from None
    except yaml.YAMLError as exc:  # e.g. a control character: not a marked error
        problem, hint = _split(f"invalid YAML: {_one_line(exc)}")
        raise RecipeError(problem=problem, hint=hint, path=source) from None
    return data, _line_map(node)


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise RecipeError(problem="not UTF-8 text", hint="save it as UTF-8", path=path) from None
    except OSError as exc:
        raise RecipeError(problem=f"cannot read ({exc.strerror})", path=path) from None


def _nearest_line(lines: dict[Loc, int], loc: Loc) -> int | None:
    while True:
        if loc in lines:
            return lines[loc]
        if not loc:
            return None
        loc = loc[:-1]


def _split(message: str) -> tuple[str, str | None]:
    """A `problem; fix` sentence as (problem, fix): the fix is what follows the first "; "."""
    problem, _, hint = message.partition("; ")
    return problem, hint or None


def _data_path(loc: tuple[str | int, ...], kind: str, data: Any) -> tuple[str | int, ...]:
    """The error's path in the document: without the tag pydantic inserts after an item of a
    discriminated union (`metrics.0.perplexity.top_k` is `metrics.0.top_k` in the YAML). A
    name that is not a key where it stands is such a tag, unless it is the field a
    missing/unknown-field error is about (the last one)."""
    if data is None:
        return loc
    out: list[str | int] = []
    at = data
    for i, p in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(at, dict) and isinstance(p, str) and p not in at and not (
                last and kind in ("missing", "extra_forbidden")):
            continue
        out.append(p)
        inside = (isinstance(at, dict) and p in at) or (
            isinstance(at, list) and isinstance(p, int) and p < len(at))
        at = at[p] if inside else None
    return tuple(out)


def validation_problems(exc: ValidationError, lines: dict[Loc, int], data: Any = None
                        ) -> list[tuple[int | None, str, str | None]]:
    """Each schema problem as (line, `field: problem`, fix); `data`: the document, to read
    each error's path in it."""
    parts = []
    for err in exc.errors():
        loc = tuple(str(p) if not isinstance(p, int) else p for p in err["loc"])
        # pydantic appends the union member / validator name to loc; keep the data path
        data_loc = _data_path(tuple(p for p in loc if not (
            isinstance(p, str) and p.startswith("function-"))), err["type"], data)
        line = _nearest_line(lines, tuple(str(p) if isinstance(p, str) else p for p in data_loc))
        field = ".".join(str(p) for p in data_loc) or "(document)"
        msg = _one_line(err["msg"])
        if err["type"] == "extra_forbidden":
            msg = "unknown field; remove it or check its spelling"
        elif err["type"] == "missing":
            msg = "required field is missing; add it"
        problem, hint = _split(f"{field}: {msg}")
        parts.append((line, problem, hint))
    return parts


def format_validation_error(exc: ValidationError, source: str, lines: dict[Loc, int],
                            data: Any = None) -> str:
    """One message listing each schema problem as `file:line: field: problem`."""
    return "; ".join(compose(problem, hint, source, line)
                     for line, problem, hint in validation_problems(exc, lines, data))


def validation_error(cls: type[E], exc: ValidationError, source: str, lines: dict[Loc, int],
                     data: Any = None) -> E:
    """The error to raise for a schema failure: one problem as its fields (the usual case),
    several as one message listing each (see format_validation_error)."""
    parts = validation_problems(exc, lines, data)
    if len(parts) == 1:
        line, problem, hint = parts[0]
        return cls(problem=problem, hint=hint, path=source, line=line)
    return cls(format_validation_error(exc, source, lines, data), path=source)


def parse_model(model: type[M], text: str, source: str) -> M:
    """Strictly parse YAML text into a pydantic model, with line-precise errors."""
    data, lines = load_yaml(text, source)
    if not isinstance(data, dict):
        raise RecipeError(problem="expected a YAML mapping at the top level", path=source)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(RecipeError, exc, source, lines, data) from None


def expected(keys: Iterable[str]) -> str:
    """A table's keys as pydantic lists a Literal's values: "'a', 'b' or 'c'"."""
    names = [repr(k) for k in keys]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + f" or {names[-1]}"


def one_of(table: Mapping[str, Any]) -> Any:
    """A string field whose values are a table's keys, looked up when a document is validated
    (an entry added to the table is a valid value at once), refused as pydantic refuses a
    Literal: "Input should be 'a', 'b' or 'c'"."""
    def check(value: str) -> str:
        if value not in table:
            raise PydanticCustomError("literal_error", "Input should be {expected}",
                                      {"expected": expected(table)})
        return value

    return Annotated[str, AfterValidator(check)]
