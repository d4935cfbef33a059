"""A dynamic table's hash index on the CPU through Numba (:mod:`._numba_hash`): what
:meth:`hybridembed.storage.HashStorage._find` and ``_insert`` run for a table on the CPU with
``kernels="auto"`` (when Numba is installed) or ``kernels="numba"``; the torch ops otherwise.

A lookup in torch reads a window of positions for every pair still probing, a round at a time
(about 15 small ops a round, a host sync after each); these loops probe each pair to its end in
one pass. Measured (1M pairs in an index of 2M positions, 2 threads): finding 500k pairs 89-149
-> 28 ms (one thread), rebuilding the index of 1M pairs 300 -> 70 ms. A find splits the pairs
over the fused step's threads (read-only); an insert runs on one (pairs may race for a position).
"""

from __future__ import annotations

import torch

from ..errors import HybridEmbedError
from . import cpu_fused

__all__ = ["runs_on", "find", "insert"]


def runs_on(kernels: str, weight: torch.Tensor) -> bool:
    """Whether an index of a storage whose backend is ``kernels``, rows ``weight``, runs here."""
    return kernels in ("auto", "numba") and weight.device.type == "cpu" and cpu_fused.available()


def _lost(n: int, what: str) -> None:
    if n:
        raise HybridEmbedError(f"the hash index is full: {n} pair(s) {what} (a bug: it is rebuilt before)")


def find(
    hrow: torch.Tensor, mask: int, keys: torch.Tensor, tabs: torch.Tensor, home: torch.Tensor, where: bool = False
) -> torch.Tensor:
    """(U,) int64 slots (``where``: index positions) of pairs ``keys`` (U,) int64, ``tabs`` (U,)
    whose home positions are ``home`` (U,) in index ``hrow`` (H, 2); -1 where absent."""
    from . import _numba_hash as K

    out = torch.empty(keys.shape, dtype=torch.int64)
    u = keys.numel()
    if u == 0:
        return out
    t = cpu_fused._threads(u)
    edges = [u * k // t for k in range(t + 1)]
    head = (
        hrow.numpy(),
        mask,
        keys.contiguous().numpy(),
        (tabs.to(torch.int64) << 32).numpy(),
        home.contiguous().numpy(),
        where,
        out.numpy(),
    )
    lost: list[int] = []
    cpu_fused._run(
        lambda *a: lost.append(K.find_kernel(*a)), [(a, b) for a, b in zip(edges, edges[1:]) if b > a], head, ()
    )
    _lost(sum(lost), "not found")
    return out


def insert(
    hrow: torch.Tensor,
    mask: int,
    keys: torch.Tensor,
    tabs: torch.Tensor,
    slots: torch.Tensor,
    home: torch.Tensor,
    at: torch.Tensor | None = None,
) -> None:
    """Adds absent, distinct pairs ``keys`` (U,), ``tabs`` (U,) pointing at ``slots`` (U,) to index
    ``hrow`` (H, 2) in place, each at the first empty position from ``home`` (U,) (written into
    ``at`` (U,) int64 where given)."""
    from . import _numba_hash as K

    if keys.numel():
        words = (tabs.to(torch.int64) << 32) | slots.to(torch.int64)
        out = at.numpy() if at is not None else torch.zeros(0, dtype=torch.int64).numpy()
        lost = K.insert_kernel(
            hrow.numpy(), mask, keys.contiguous().numpy(), words.numpy(), home.contiguous().numpy(), out
        )
        _lost(lost, "not placed")
