"""Strict YAML: duplicate keys are errors, and every value keeps its line number so that
schema errors can point at the line to fix.

Every YAML file the product reads (recipes, calibration specs, eval suites, GPU catalogs, the
speed table, the question set) comes through `load_yaml`, which bounds what a document may
cost before anything is built from it: its size (MAX_BYTES, MAX_LINES), its nesting
(MAX_DEPTH) and its values (MAX_NODES). Aliases stay allowed (`&name` ... `*name` reuses a
value), but an alias counts as every value its anchor holds, so nested aliases (a "billion
laughs" bomb, whose expansion the line map, pydantic and the hash would each walk) hit
MAX_NODES at the alias that crosses it, before any expansion; an alias inside its own anchor
(a recursive document) is refused. Merge keys (`<<:`) are refused: they never loaded here,
and they would let a merged key silently lose to a written one (a hidden duplicate key)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import AfterValidator, BaseModel, ValidationError
from pydantic_core import PydanticCustomError

from quantize.errors import QuantizeError, RecipeError, compose, first_line

Loc = tuple[str | int, ...]
M = TypeVar("M", bound=BaseModel)
E = TypeVar("E", bound=QuantizeError)

# The largest file read here is a few KB (quantize/data/gpus.yaml: 4.5 KB, 273 values; a
# `quantize fit` recipe of a 405B model: ~1,000 targets); these are far above any real one,
# and each is reached in well under a second.
MAX_BYTES = 1 << 20  # 1 MiB
MAX_LINES = 100_000
MAX_NODES = 10_000  # every scalar, list and mapping, each alias as the values it stands for
MAX_DEPTH = 64  # lists and mappings inside each other
MAX_INT_CHARS = 80  # an integer literal (then: it must fit in 64 bits)
MAX_LISTED = 5  # the schema problems one error lists; the rest are counted
_MERGE_TAG = "tag:yaml.org,2002:merge"
_LIMIT_HINT = ("a recipe, calibration spec, eval suite or GPU file is a few KB: check that "
               "this is the file you meant")


class _Refused(yaml.YAMLError):
    """A document over one of the limits: the problem, its fix and the line (1-based)."""

    def __init__(self, problem: str, hint: str, mark: Any) -> None:
        super().__init__(problem)
        self.problem, self.hint = problem, hint
        self.line = mark.line + 1 if mark is not None else None


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate mapping keys (PyYAML silently keeps the last one) and
    merge keys, and counts what it composes against the limits above."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.nodes = 0  # values composed so far, each alias as the values of its anchor
        self.aliased = False  # whether an alias was met
        self.depth = 0
        self.sizes: dict[str, int] = {}  # anchor -> values under it (its aliases expanded)

    def _count(self, n: int, mark: Any, alias: bool = False) -> None:
        self.nodes += n
        self.aliased = self.aliased or alias
        if self.nodes > MAX_NODES:
            raise _Refused(
                f"the document holds more than {MAX_NODES:,} values (the limit)"
                + (", each alias counted as the values it stands for" if self.aliased else ""),
                "an alias (*name) repeats everything under its anchor, so nested aliases "
                "multiply; write the values out" if self.aliased else _LIMIT_HINT, mark)

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            size = self.sizes.get(event.anchor or "")
            if size is None and event.anchor in self.anchors:
                raise _Refused(f"alias *{event.anchor} is inside the value &{event.anchor} it "
                               "names (a recursive document)", "remove the alias",
                               event.start_mark)
            self._count(size or 0, event.start_mark, alias=True)  # undefined: PyYAML's
            node: Any = super().compose_node(parent, index)
            return node
        anchor = getattr(event, "anchor", None)
        if anchor is not None and anchor in self.anchors:  # PyYAML says only "second occurrence"
            first = self.anchors[anchor].start_mark.line + 1
            raise _Refused(f"anchor &{anchor} is defined twice (first at line {first})",
                           "rename one of them", event.start_mark)
        self._count(1, event.start_mark)
        start = self.nodes
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _Refused(f"the document nests more than {MAX_DEPTH} lists or mappings deep "
                           "(the limit)", "flatten it", event.start_mark)
        node = super().compose_node(parent, index)
        self.depth -= 1
        if anchor is not None:
            self.sizes[anchor] = self.nodes - start + 1
        return node

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, OverflowError) as exc:  # e.g. a date 2024-13-45: not a YAMLError
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read this value ({first_line(exc)})",
                node.start_mark) from None


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == _MERGE_TAG:
            raise _Refused("merge keys (<<) are not supported: a merged key would silently "
                           "lose to one written beside it", "write the keys out",
                           key_node.start_mark)
        if not isinstance(key_node, yaml.ScalarNode):
            raise _Refused("a mapping key must be a plain value, not a list or mapping",
                           "write the key as text", key_node.start_mark)
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


def _construct_int(loader: _StrictLoader, node: yaml.ScalarNode) -> int:
    """YAML's int, bounded: a long literal (a 5,000-digit number, a base-60 `1:2:3:...`)
    costs CPU to convert and no setting takes one; the value must fit in 64 bits."""
    text = str(node.value)
    if len(text) > MAX_INT_CHARS:
        raise _Refused(f"an integer of {len(text):,} characters (the limit is "
                       f"{MAX_INT_CHARS})", "write a number that fits in 64 bits",
                       node.start_mark)
    value: int = yaml.constructor.SafeConstructor.construct_yaml_int(loader, node)
    if not -(1 << 63) <= value < (1 << 63):
        raise _Refused(f"integer {text} does not fit in 64 bits",
                       "write a smaller number", node.start_mark)
    return value


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_StrictLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
# YAML 1.2's floats without a dot (`1e-5`, `2E+3`): PyYAML (YAML 1.1) reads them as text, which
# the strict models would refuse where a number is due (lr: 1e-5). After PyYAML's own resolvers,
# so an int or a 1.1 float is still resolved as before.
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def _line_map(node: yaml.Node | None, path: Loc = ()) -> dict[Loc, int]:
    """Map every key path in the document to the 1-based line it starts on (an alias's
    values at its anchor's lines)."""
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


def _clip(text: str, n: int = 80) -> str:
    return text if len(text) <= n else f"{text[:n - 3]}..."


def _too_big(source: str, size: int) -> RecipeError:
    return RecipeError(problem=f"the file is {size:,} bytes, over the limit of {MAX_BYTES:,} "
                       "(1 MiB)", hint=_LIMIT_HINT, path=source)


def _check_size(text: str, source: str) -> None:
    if (size := len(text.encode("utf-8", "surrogatepass"))) > MAX_BYTES:
        raise _too_big(source, size)
    if (n := text.count("\n")) > MAX_LINES:
        raise RecipeError(problem=f"the file has {n:,} lines, over the limit of {MAX_LINES:,}",
                          hint=_LIMIT_HINT, path=source)


def load_yaml(text: str, source: str) -> tuple[Any, dict[Loc, int]]:
    """Parse text strictly and within the limits; return the data and a map from key path to
    line number."""
    _check_size(text, source)
    loader = None
    try:
        loader = _StrictLoader(text)  # reads the text: a control character fails here
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except _Refused as exc:
        raise RecipeError(problem=exc.problem, hint=exc.hint, path=source,
                          line=exc.line) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        what = exc.problem or exc
        if exc.context and str(what).startswith("but "):  # "expected a single document..."
            what = f"{exc.context}, {what}"
        problem, hint = _split(f"invalid YAML: {_one_line(what)}")
        raise RecipeError(problem=problem, hint=hint, path=source,
                          line=mark.line + 1 if mark else None) from None
    except yaml.reader.ReaderError as exc:  # a control character (NUL...): no mark, a position
        what = f"character #x{exc.character:04x}" if isinstance(exc.character, int) else \
            "character"
        raise RecipeError(problem=f"invalid YAML: unacceptable {what} ({exc.reason})",
                          hint="remove it", path=source,
                          line=text.count("\n", 0, exc.position) + 1) from None
    except yaml.YAMLError as exc:
        problem, hint = _split(f"invalid YAML: {_one_line(exc)}")
        raise RecipeError(problem=problem, hint=hint, path=source) from None
    except RecursionError:  # not reached within MAX_DEPTH; never a traceback if it were
        raise RecipeError(problem="invalid YAML: nested too deeply", hint="flatten it",
                          path=source) from None
    finally:
        if loader is not None:
            loader.dispose()
    return data, _line_map(node)


def read_text(path: Path) -> str:
    """A YAML file's text (UTF-8), refused unread when over MAX_BYTES; a device or pipe is
    read only up to the limit."""
    try:
        size = path.stat().st_size
        if path.is_file() and size > MAX_BYTES:
            raise _too_big(str(path), size)
        with path.open(encoding="utf-8") as f:
            text = f.read(MAX_BYTES + 1)
    except UnicodeDecodeError:
        raise RecipeError(problem="not UTF-8 text", hint="save it as UTF-8", path=path) from None
    except OSError as exc:
        raise RecipeError(problem=f"cannot read ({exc.strerror})", path=path) from None
    if len(text) > MAX_BYTES:
        raise _too_big(str(path), len(text.encode("utf-8", "surrogatepass")))
    return text


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


# pydantic's type errors, which strict models raise for a value of YAML's other types (a
# quoted "yes" for a boolean, `true` or 2.0 for an integer): the value got and how to write it
_TYPE_HINTS = {
    "bool_type": "write true or false, without quotes",
    "int_type": "write a whole number, without quotes or a decimal point",
    "float_type": "write a number, without quotes",
    "finite_number": "write a finite number (not .inf or .nan)",
    "string_type": "put the value in quotes to make it text",
}


def _got(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return f"got {'null' if value is None else str(value).lower()}"
    if isinstance(value, str):
        return f"got the text {_clip(repr(value), 40)}"
    if isinstance(value, int | float):
        return f"got {_clip(repr(value), 40)}"
    kinds: dict[type, str] = {list: "a list", dict: "a mapping"}
    return f"got {kinds.get(type(value), type(value).__name__)}"


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
        field = _clip(".".join(str(p) for p in data_loc) or "(document)", 120)
        msg, hint = _split(_one_line(err["msg"]))
        if err["type"] == "extra_forbidden":
            msg, hint = "unknown field", "remove it or check its spelling"
        elif err["type"] == "missing":
            msg, hint = "required field is missing", "add it"
        elif err["type"] in _TYPE_HINTS:
            msg, hint = f"{msg}, {_got(err.get('input'))}", _TYPE_HINTS[err["type"]]
        parts.append((line, f"{field}: {msg}", hint))
    return parts


def _listed(parts: list[tuple[int | None, str, str | None]], source: str) -> str:
    """Several problems in one line: the first MAX_LISTED, then how many more (5,000 bad
    fields are one short line, not 384 KB)."""
    shown = "; ".join(compose(problem, hint, source, line)
                      for line, problem, hint in parts[:MAX_LISTED])
    more = len(parts) - MAX_LISTED
    return f"{shown}; ... and {more:,} more problem{'s' if more > 1 else ''}" if more > 0 \
        else shown


def format_validation_error(exc: ValidationError, source: str, lines: dict[Loc, int],
                            data: Any = None) -> str:
    """One message listing each schema problem as `file:line: field: problem` (the first
    MAX_LISTED of them, then how many more)."""
    return _listed(validation_problems(exc, lines, data), source)


def validation_error(cls: type[E], exc: ValidationError, source: str, lines: dict[Loc, int],
                     data: Any = None) -> E:
    """The error to raise for a schema failure: one problem as its fields (the usual case),
    several as one message listing each (see format_validation_error)."""
    parts = validation_problems(exc, lines, data)
    if len(parts) == 1:
        line, problem, hint = parts[0]
        return cls(problem=problem, hint=hint, path=source, line=line)
    return cls(_listed(parts, source), path=source)


def parse_model(model: type[M], text: str, source: str) -> M:
    """Strictly parse YAML text into a pydantic model, with line-precise errors: strict
    types too (no text for a boolean or number, no boolean or 2.0 for an integer), whatever
    the model's own config says."""
    data, lines = load_yaml(text, source)
    if not isinstance(data, dict):
        raise RecipeError(problem="expected a YAML mapping at the top level", path=source)
    try:
        return model.model_validate(data, strict=True)
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
