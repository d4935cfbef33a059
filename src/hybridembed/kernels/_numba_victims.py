"""Numba loop choosing a tiered cache's least recently used victims
(:func:`hybridembed.storage.victims.least_recent`; imported only when Numba is): a count of the
eligible slots by ``last_used`` in one pass, then the victims collected in a second, instead of
~8 torch passes over the cache (a mask, ``nonzero``, a gather, ``topk``). Measured on a 400,000-row
cache choosing 6,000 victims: 2.2 ms of a dense tiered step in torch ops.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["least_recent"]


@njit(nogil=True, cache=True)
def least_recent(last_used, taken, protect, k, now, out):  # pragma: no cover (compiled)
    """The ``k`` eligible slots (``taken[s] >= 0`` and not ``protect[s]``) of smallest
    ``last_used`` into ``out[:k]``: those below the k-th value in slot order, then that value's in
    slot order. ``last_used`` <= ``now``. Returns the eligible slots' count, or -1 where their
    ``last_used`` span more than ``out``'s room allows a count of (the caller sorts instead)."""
    lo, n = now, 0
    for s in range(last_used.shape[0]):
        if taken[s] >= 0 and not protect[s]:
            n += 1
            if last_used[s] < lo:
                lo = last_used[s]
    if n < k:
        return n
    span = now - lo + 1
    if span > 4 * last_used.shape[0] + 1024:
        return -1
    hist = np.zeros(span, dtype=np.int64)
    for s in range(last_used.shape[0]):
        if taken[s] >= 0 and not protect[s]:
            hist[last_used[s] - lo] += 1
    below, t = 0, 0
    while below + hist[t] < k:
        below += hist[t]
        t += 1
    i, j = 0, below
    for s in range(last_used.shape[0]):
        if taken[s] >= 0 and not protect[s]:
            v = last_used[s] - lo
            if v < t:
                out[i] = s
                i += 1
            elif v == t and j < k:
                out[j] = s
                j += 1
    return n
