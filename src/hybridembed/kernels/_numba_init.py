"""Numba loop of the row-keyed initializer's uniforms (:func:`hybridembed.init._uniform01`;
imported only when Numba is): each element's splitmix64 bits in one pass, instead of ~15 torch
ops over (N, D) int64 temporaries. The same integer arithmetic (wrapping multiplies, logical
shifts), so the same bits: a new row of a tiered or dynamic table starts with exactly the value
the torch ops give it (and the table in memory had).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["uniform01"]


@njit(nogil=True, cache=True, inline="always")
def _mix(x):  # pragma: no cover (compiled)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


@njit(nogil=True, cache=True)
def uniform01(rows, keys, key, col_start, out):  # pragma: no cover (compiled)
    """``out`` (N, D) float64: the uniforms in (0, 1) of rows ``rows`` (N,) int64 under ``keys``
    (N,) int64 (one a row), or, where ``keys`` is empty, ``key``; columns ``col_start ..``."""
    golden = np.uint64(0x9E3779B97F4A7C15)
    scale = 2.0**-53
    for i in range(rows.shape[0]):
        k = keys[i] if keys.shape[0] > 0 else key
        h = _mix(np.uint64(rows[i]) ^ np.uint64(k))
        for d in range(out.shape[1]):
            x = _mix(h + np.uint64(col_start + d) * golden)
            out[i, d] = (np.float64(x >> np.uint64(11)) + 0.5) * scale
