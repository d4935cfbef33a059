"""The repository names no path outside itself (so the README's test command runs anywhere)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# an absolute path into a machine's own folders; "/usr/bin/env" (a shebang) is portable
_OUTSIDE = re.compile(r"(?<![\w.~-])/(?:" + "|".join(["work", "home", "opt", "tmp", "usr"]) + r")/(?!bin/env\b)")


def _tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to list the repository's files")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / n for n in out.decode().split("\0") if n]


def test_no_file_names_a_path_outside_the_repository():
    found = []
    for path in _tracked_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary data, or deleted in the work tree
        for n, line in enumerate(text.splitlines(), 1):
            if _OUTSIDE.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "absolute paths outside the repository (use sys.executable, tmp_path):\n" + "\n".join(found)


_DOC_REF = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.md)\b")


def test_every_markdown_file_the_code_and_docs_cite_is_in_the_repository():
    """A docstring or page that sends a reader to a Markdown page names one they can open."""
    tracked = _tracked_files()
    pages = {p.relative_to(ROOT).as_posix() for p in tracked if p.suffix == ".md"}
    names = {Path(p).name for p in pages}
    missing = []
    for path in tracked:
        if path.suffix not in (".py", ".md") or not path.exists():
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for ref in _DOC_REF.findall(line):
                if ref not in pages and Path(ref).name not in names:
                    missing.append(f"{path.relative_to(ROOT)}:{n}: {ref}")
    assert not missing, "pages cited but not in the repository:\n" + "\n".join(missing)


def test_the_package_says_it_is_typed():
    import hybridembed

    assert (Path(hybridembed.__file__).parent / "py.typed").is_file()  # (PEP 561)
    assert 'hybridembed = ["py.typed"]' in (ROOT / "pyproject.toml").read_text()


def test_the_api_reference_builds_and_is_current():
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "api_reference.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr + " (run: python tools/api_reference.py)"
