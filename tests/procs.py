"""A job's process tree from ``/proc`` (test and benchmark helper): the children and descendants of
a process, its command line, the ranks a ``train --max-restarts`` command forked, and killing a
whole tree (what a test started never outlives it)."""

from __future__ import annotations

import os
import signal


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for c in children(todo.pop()):
            out.append(c)
            todo.append(c)
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def forked_ranks(pid: int) -> list[int]:
    """The ranks under ``pid`` (``train --max-restarts``: the children of its forkserver, which the
    agent forks them from)."""
    servers = [c for c in children(pid) if "multiprocessing.forkserver" in cmdline(c)]
    return [r for s in servers for r in children(s)]


def kill_tree(pid: int) -> None:
    """SIGKILL to ``pid`` and every process under it (the ones already gone skipped)."""
    for p in [*descendants(pid), pid]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
