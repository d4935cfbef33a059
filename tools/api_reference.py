"""Writes docs/api.md, the API reference, from the public names' docstrings and signatures.

    python tools/api_reference.py            # (re)writes docs/api.md
    python tools/api_reference.py --check    # exit 1 when docs/api.md is not what it would write

The public API is what each module below lists in ``__all__``: every class (with its public
methods and properties), function and constant, in that order. The text is the docstrings as
written (they are Markdown-friendly reStructuredText: ``code`` reads fine either way).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "api.md"
MODULES = [  # (module, what it is)
    ("hybridembed", "the package: converting, distributing, saving and exporting models; tables and inputs"),
    ("hybridembed.optim", "sparse row-wise optimizers and the wrapped optimizer"),
    ("hybridembed.init", "row-keyed initializers"),
    ("hybridembed.distributed", "sharded tables, plans and the planner"),
    ("hybridembed.input", "the canonical sparse input"),
]


def _signature(obj) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def _doc(obj) -> str:
    text = inspect.getdoc(obj)  # (a method that overrides one inherits its docstring)
    return text if text else "(no docstring)"


def _value(obj) -> str:
    """A constant, shown without addresses (a registry of functions: their names)."""
    if isinstance(obj, dict):
        shown = {k: (v.__name__ if callable(v) else v) for k, v in obj.items()}
        return f"`{shown!r}`"[:400]
    return f"`{obj!r}`"[:400]


def _members(cls) -> list[tuple[str, object]]:
    out = []
    for name, member in cls.__dict__.items():
        if (name.startswith("_") and name != "__call__") or name in ("extra_repr",):
            continue
        if (
            isinstance(member, property)
            or inspect.isfunction(member)
            or isinstance(member, (classmethod, staticmethod))
        ):
            out.append((name, member))
    return out


def render() -> str:
    lines = [
        "# API reference",
        "",
        "Generated from the docstrings by `python tools/api_reference.py` (do not edit by hand; a test",
        "checks that this page is what the generator writes).",
        "",
    ]
    for modname, what in MODULES:
        mod = importlib.import_module(modname)
        lines += [f"## `{modname}`", "", f"{what[0].upper()}{what[1:]}.", ""]
        for name in mod.__all__:
            obj = getattr(mod, name)
            qual = f"{modname}.{name}"
            if inspect.ismodule(obj):
                lines += [f"### `{qual}` (module)", "", _doc(obj).split("\n\n")[0], ""]
            elif inspect.isclass(obj):
                kind = "exception" if issubclass(obj, BaseException) else "class"
                lines += [f"### `{qual}{_signature(obj)}` ({kind})", "", _doc(obj), ""]
                for mname, member in _members(obj):
                    if isinstance(member, property):
                        lines += [f"#### `{name}.{mname}` (property)", "", _doc(member), ""]
                    else:
                        fn = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
                        lines += [f"#### `{name}.{mname}{_signature(fn)}`", "", _doc(fn), ""]
            elif callable(obj):
                lines += [f"### `{qual}{_signature(obj)}`", "", _doc(obj), ""]
            else:
                lines += [f"### `{qual}`", "", _value(obj), ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write docs/api.md from the docstrings")
    p.add_argument("--check", action="store_true", help="exit 1 when docs/api.md is out of date")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT.relative_to(ROOT)} is out of date: run python tools/api_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
