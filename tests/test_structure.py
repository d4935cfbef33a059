"""The shape of the source tree: imports run one way (no circle between files, lazy imports inside
functions included) and no module grows past what one reader holds (about 800 lines)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "hybridembed"
MAX_LINES = 800


def _modules() -> dict[str, Path]:
    """{dotted module name: file} of every module of the package."""
    out = {}
    for path in (SRC / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in it (not under ``if TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    skip: set[int] = set()
    for node in ast.walk(tree):  # type-only imports run nothing
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
            missing = [t for t in targets if t.startswith(PACKAGE + ".") and t not in modules]
            assert not missing, f"{name} (line {node.lineno}) imports {missing[0]}, which is not a module here"
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            if (stem == PACKAGE or stem.startswith(PACKAGE + ".")) and stem not in modules:
                raise AssertionError(f"{name} (line {node.lineno}) imports from {stem}, which is not a module here")
            # `from pkg import sub` imports the submodule; `from mod import name` the module
            targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # (a name inside a module: the module)
                t = t.rpartition(".")[0]
            if t.startswith(PACKAGE) and t != name:
                out.add(t)
    return out


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_circle_and_every_import_is_there():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # a package's __init__ re-exports its modules: an import of the package by one of its own
    # modules is an import of what it re-exports, so __init__ edges to its children are the
    # package's, not circles through it
    for name in modules:
        for dep in list(graph[name]):
            if (modules[dep].name == "__init__.py" and name.startswith(dep + ".")) or dep == PACKAGE:
                graph[name].discard(dep)
    circles = _circles(graph)
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_the_walk_finds_the_imports_it_must():
    modules = _modules()
    got = _imports("hybridembed.distributed.runtime", modules["hybridembed.distributed.runtime"], modules)
    assert {"hybridembed.distributed.exchange", "hybridembed.distributed.health", "hybridembed.modules"} <= got
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_is_longer_than_a_reader_holds():
    long = {
        str(p.relative_to(SRC)): n
        for p in (SRC / PACKAGE).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


# the floors, top down: a module imports only from its own floor or below (docs/distributed.md)
FLOORS = [
    {"train", "bench", "launch", "cli"},
    {"api"},
    {"ps"},
    {"checkpoint"},
    {"distributed"},
    {"modules", "optim"},
    {"storage"},
    {"kernels"},
    {"input"},
]
# the one import up, by name only: hybridembed.distributed.distribute, kept for code written before
# the verb moved to hybridembed.api (a lazy module __getattr__)
KEPT_FOR_OLD_NAMES = {("hybridembed.distributed", "hybridembed.api.distribute")}


def test_imports_run_down_the_floors():
    modules = _modules()
    floor = {sub: i for i, subs in enumerate(FLOORS) for sub in subs}
    up = []
    for name, path in modules.items():
        here = floor.get(name.split(".")[1] if name.count(".") else "")
        for dep in _imports(name, path, modules):
            there = floor.get(dep.split(".")[1] if dep.count(".") else "")
            if here is not None and there is not None and there < here and (name, dep) not in KEPT_FOR_OLD_NAMES:
                up.append(f"{name} -> {dep}")
    assert not up, "imports up a floor: " + ", ".join(sorted(up))
