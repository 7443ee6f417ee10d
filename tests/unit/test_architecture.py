"""The package's shape, enforced: no import cycles (lazy and type-checking imports
included), each layer imports only from layers below it or its own, and no module grows past
the size a reader takes in at once. `make quality` runs this file too."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "quantize"
MAX_LINES = 450
# Known debt, each with its issue: removed when the module is split (never added to).
TOO_LONG_FOR_NOW: set[str] = set()

# Low to high. A module may import from its own layer and the layers before it.
LAYERS: list[tuple[str, ...]] = [
    ("quantize", "quantize.errors", "quantize.progress"),
    ("quantize.recipe", "quantize.run", "quantize.model"),  # the foundations
    ("quantize.vllm", "quantize.checks", "quantize.backends",
     "quantize.convert"),  # kernels rules, checks, engines, format converters
    ("quantize.stages", "quantize.metrics", "quantize.planner", "quantize.report",
     "quantize.fit"),
    ("quantize.pipeline",),
    ("quantize.cli",),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base if is_pkg else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("quantize"):
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imports(m, p, known) - {"quantize"} for m, p in mods.items()}


def _layer(module: str) -> int:
    best, best_len = 0, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles() -> None:
    cycles = _cycles(_graph())
    assert cycles == [], f"import cycles: {cycles}"


def _package(module: str) -> str:
    """quantize.X for anything under quantize/X/; a top-level module is its own package."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_no_package_cycles() -> None:
    """Packages import each other one way only (lazy and type-checking imports included): a
    cycle between packages is a layering the module graph alone does not show."""
    graph: dict[str, set[str]] = {}
    for m, targets in _graph().items():
        src = _package(m)
        graph.setdefault(src, set()).update(
            t for t in map(_package, targets) if t != src)
    cycles = _cycles(graph)
    assert cycles == [], f"package cycles: {cycles}"


def test_no_two_classes_share_a_name() -> None:
    """One name, one class: two `Engine`s or two `MetricRow`s make readers (and imports)
    guess which one is meant."""
    where: dict[str, list[str]] = {}
    for name, path in _modules().items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where.setdefault(node.name, []).append(name)
    dup = {k: v for k, v in where.items() if len(v) > 1}
    assert dup == {}, f"class names defined twice: {dup}"


def test_layers_import_only_downwards() -> None:
    bad = [f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
           for m, targets in sorted(_graph().items()) for t in sorted(targets)
           if _layer(t) > _layer(m)]
    assert bad == [], "\n".join(bad)


def test_no_module_is_too_long() -> None:
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES
            and str(p.relative_to(PACKAGE.parent)) not in TOO_LONG_FOR_NOW}
    assert long == {}, f"modules over {MAX_LINES} lines (split them by job): {long}"


def test_unit_tests_mirror_the_package() -> None:
    """tests/unit/<package>/test_*.py for quantize/<package>/; at the top, the tests of the
    top-level modules (test_<module>.py) and this file; basenames unique across tests/ (no
    __init__.py: pytest imports each file by its name)."""
    tests = PACKAGE.parent / "tests"
    unit = tests / "unit"
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    folders = {p.name for p in unit.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders <= packages, f"not a quantize package: {sorted(folders - packages)}"
    top = {p.name for p in unit.glob("test_*.py")}
    allowed = {"test_architecture.py"} | {f"test_{m}.py" for m in modules}
    assert top <= allowed, f"move into tests/unit/<package>/: {sorted(top - allowed)}"
    for folder in folders:
        assert not [p for p in (unit / folder).iterdir() if p.is_dir()
                    and p.name != "__pycache__"], f"tests/unit/{folder}: one level only"
    names = [p.name for p in tests.rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert not [p for d in ("unit", "integration") for p in (tests / d).rglob("__init__.py")]


def test_every_error_class_lives_in_errors_py() -> None:
    """One home for errors: a class deriving from one of quantize/errors.py's classes (or
    from Exception) anywhere else is a second home."""
    errors_py = PACKAGE / "errors.py"
    ours = {n.name for n in ast.parse(errors_py.read_text()).body if isinstance(n, ast.ClassDef)}
    elsewhere = []
    for name, path in _modules().items():
        if path == errors_py:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                         for b in node.bases}
                if bases & (ours | {"Exception", "BaseException"}):
                    elsewhere.append(f"{name}.{node.name}")
    assert elsewhere == [], f"error classes outside quantize/errors.py: {elsewhere}"
