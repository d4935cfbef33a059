"""Numba kernels of a dynamic table's hash index on the CPU (:mod:`.cpu_hash`; imported only when
Numba is). The index is :class:`hybridembed.storage.HashStorage`'s (see :mod:`.triton_hash`):
``hrow`` (H, 2) int64, a position's key and ``table << 32 | slot``, -1 in both words when
empty; ``mask`` = H - 1; linear probing from each pair's home position (its hash, computed by
the caller). A tiered table's tombstones hold a table number no table has: they never match and
never end a probe, and an insert does not reuse them (as the torch ops).

Each loop asks for the index row of the pair ``_AHEAD`` pairs on while it probes for this one:
the rows are scattered over the index, so a probe waits on memory, not arithmetic.
"""

from __future__ import annotations

from numba import njit

from ._numba_kernels import _prefetch

__all__ = ["find_kernel", "insert_kernel"]

_AHEAD = 8  # pairs ahead whose home row is prefetched
_TABLE = -(1 << 32)  # the table word of a position's second word
_SLOT = (1 << 32) - 1


@njit(nogil=True, cache=True)
def find_kernel(hrow, mask, keys, tws, home, where, out, lo, hi):  # pragma: no cover (compiled)
    """``out[i]`` for pairs ``lo <= i < hi``: the slot (``where``: the position) of ``(tws[i] >> 32,
    keys[i])`` found probing from ``home[i]``, or -1 at the first empty position. Returns the
    number of pairs whose probe met no empty position in H steps (0 unless the index is full)."""
    lost = 0
    for i in range(lo, hi):
        if i + _AHEAD < hi:
            _prefetch(hrow, home[i + _AHEAD])
        p, k, tw = home[i], keys[i], tws[i]
        out[i] = -1
        for _ in range(mask + 1):
            w = hrow[p, 1]
            if w < 0:
                break
            if hrow[p, 0] == k and (w & _TABLE) == tw:
                out[i] = p if where else w & _SLOT
                break
            p = (p + 1) & mask
        else:
            lost += 1
    return lost


@njit(nogil=True, cache=True)
def insert_kernel(hrow, mask, keys, words, home, at):  # pragma: no cover (compiled)
    """Absent, distinct pairs ``keys[i]``, ``words[i]`` (``table << 32 | slot``), each at the first
    empty position probing from ``home[i]``, in order (``at[i]``: that position, unless ``at`` is
    empty). Returns the number that found none."""
    lost = 0
    n = keys.shape[0]
    record = at.shape[0] > 0
    for i in range(n):
        if i + _AHEAD < n:
            _prefetch(hrow, home[i + _AHEAD])
        p = home[i]
        for _ in range(mask + 1):
            if hrow[p, 1] < 0:
                hrow[p, 0] = keys[i]
                hrow[p, 1] = words[i]
                if record:
                    at[i] = p
                break
            p = (p + 1) & mask
        else:
            lost += 1
    return lost
