"""Which package may import which: the benchmarks sit on top of the library and of the train
command; nothing below them imports them (only the ``hybridembed`` command dispatches to them), and the bench modules import each other without cycles.

Read from the source (every import statement, those inside functions too), so a lazy import
that closes a cycle is caught as well as a top-level one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hybridembed

SRC = Path(hybridembed.__file__).parent


def _module(path: Path) -> str:
    parts = ["hybridembed", *path.relative_to(SRC).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """{module: hybridembed modules it imports} for every module of the package."""
    graph: dict[str, set[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        name = _module(path)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("hybridembed")}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.startswith("hybridembed"):
                    found.add(target)
                    found |= {f"{target}.{a.name}" for a in node.names}  # `from . import models`
        graph[name] = found
    modules = set(graph)
    return {m: {t for t in ts if t in modules and t != m} for m, ts in graph.items()}


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_nothing_below_the_benchmarks_imports_them():
    graph = _imports()
    above = ("hybridembed.bench", "hybridembed.cli")  # the `hybridembed` command dispatches to `bench`
    wrong = sorted(
        (m, t)
        for m, ts in graph.items()
        if not any(_in(m, a) for a in above)
        for t in ts
        if _in(t, "hybridembed.bench")
    )
    assert wrong == [], f"imports of hybridembed.bench from outside it: {wrong}"


def test_only_the_train_end_to_end_benchmark_imports_the_train_package():
    graph = _imports()
    users = sorted(
        m for m, ts in graph.items() if _in(m, "hybridembed.bench") and any(_in(t, "hybridembed.train") for t in ts)
    )
    assert users == ["hybridembed.bench.e2e"]


def test_bench_modules_import_each_other_without_cycles():
    graph = _imports()
    bench = {m: {t for t in ts if _in(t, "hybridembed.bench") and t != "hybridembed.bench"} for m, ts in graph.items()}
    bench = {m: ts for m, ts in bench.items() if _in(m, "hybridembed.bench") and m != "hybridembed.bench"}
    done: set[str] = set()

    def visit(m: str, path: tuple[str, ...]) -> None:
        assert m not in path, f"import cycle: {' -> '.join(path[path.index(m) :] + (m,))}"
        if m in done:
            return
        for t in sorted(bench.get(m, ())):
            visit(t, path + (m,))
        done.add(m)

    for m in sorted(bench):
        visit(m, ())
    assert "hybridembed.bench.system" in bench  # the machine and progress helpers both use
