"""A job's process tree from ``/proc`` (test and benchmark helper): the children and descendants of
a process, its command line, the ranks a ``train --max-restarts`` command forked, and killing a
whole tree (what a test started never outlives it); a gloo process group of this process alone."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import time


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


def a_forked_child_ends(failing: bool = False) -> None:
    """Forks a child that runs the exit handlers as an interpreter ending normally (a data loader's
    worker, a helper script's fork): they must leave this process's job alone (its groups, files,
    servers are not the child's) and end at once; raises when the child dies by a signal or is still
    running 20 s on (it is then killed). ``failing``: the child ends with an unhandled exception
    first (``sys.excepthook``, as the interpreter calls it)."""
    pid = os.fork()
    if pid == 0:
        try:
            if failing:
                sys.excepthook(RuntimeError, RuntimeError("a forked child failed"), None)
            atexit._run_exitfuncs()
        finally:
            os._exit(0)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0, status
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"a child forked by pid {os.getpid()} did not end within 20 s of its exit handlers")


@contextlib.contextmanager
def world_of_one():
    """The default gloo process group of this process alone (rank 0 of 1, a port from the OS), destroyed after."""
    import torch.distributed as dist

    from hybridembed.launch import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
