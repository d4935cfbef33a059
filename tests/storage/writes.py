"""Tiered files' writer thread held, failed or slowed by tests (``_File.write_behind``)."""

from __future__ import annotations

import threading
import time
import types


class HeldWriter:
    """The writer thread's loop held until :meth:`release` (each write waits on an event, at most 30
    s: a test that forgets to release does not hang), or made to fail (``fail``: the loop writes
    nothing and reports its first run failed, as a failed ``pwrite`` does)."""

    def __init__(self, monkeypatch, T, fail: bool = False):
        io = T._io()
        self.gate = threading.Event()

        def pwrite_runs(*a):
            self.gate.wait(30)
            return 0 if fail else io.pwrite_runs(*a)

        monkeypatch.setattr(
            T,
            "_io",
            lambda: types.SimpleNamespace(
                advise_runs=io.advise_runs, pread_runs=io.pread_runs, pwrite_runs=pwrite_runs
            ),
        )

    def release(self) -> None:
        self.gate.set()


def slow_writes(monkeypatch, T, seconds: float) -> dict:
    """Every write of the writer thread takes ``seconds`` more, so that what a step does next meets
    it in flight; counts (``waits``) the reads, writes and steps that waited for a write in flight."""
    io = T._io()
    seen = {"writes": 0, "waits": 0}

    def pwrite_runs(*a):
        seen["writes"] += 1
        time.sleep(seconds)
        return io.pwrite_runs(*a)

    real = T._File.settle_writes

    def settle_writes(self, *a, **k):
        seen["waits"] += any(not w.done.done() for w in self._behind)
        return real(self, *a, **k)

    monkeypatch.setattr(
        T,
        "_io",
        lambda: types.SimpleNamespace(advise_runs=io.advise_runs, pread_runs=io.pread_runs, pwrite_runs=pwrite_runs),
    )
    monkeypatch.setattr(T._File, "settle_writes", settle_writes)
    return seen
