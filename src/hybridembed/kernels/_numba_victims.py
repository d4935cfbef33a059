"""Numba loops of a tiered cache's recency queue (:class:`hybridembed.storage.victims.RecencyQueue`;
imported only when Numba is): the first live entries from the queue's head, and the queue
compacted to its live entries.
"""

from __future__ import annotations

from numba import njit

__all__ = ["queue_victims", "queue_compact"]


@njit(nogil=True, cache=True)
def queue_victims(entries, seg_end, seg_clock, head, g, n, last_used, taken, protect, k, out):  # pragma: no cover
    """A recency queue's first ``k`` live, unprotected entries from ``head`` (segment ``g``) into
    ``out``: an entry (a slot) is live where the slot holds a row (``taken >= 0``) last used at its
    segment's clock. Returns (how many were found, the position the queue may start from once
    they are evicted: the first live protected entry seen, or the one after the last taken)."""
    found, keep_from = 0, -1
    i = head
    while i < n and found < k:
        while seg_end[g] <= i:
            g += 1
        s = entries[i]
        if taken[s] >= 0 and last_used[s] == seg_clock[g]:
            if protect[s]:
                if keep_from < 0:
                    keep_from = i
            else:
                out[found] = s
                found += 1
        i += 1
    return found, (keep_from if keep_from >= 0 else i)


@njit(nogil=True, cache=True)
def queue_compact(entries, seg_end, seg_clock, head, g, n, nseg, last_used, taken):  # pragma: no cover
    """The live entries from ``head`` moved to the front, in order, their segments with them
    (empty ones dropped). Returns (entries, segments) left."""
    j, h, lo = 0, 0, head
    for gg in range(g, nseg):
        hi = min(n, seg_end[gg])  # (read before this loop writes segment h <= gg)
        c = seg_clock[gg]
        start = j
        for i in range(lo, hi):
            s = entries[i]
            if taken[s] >= 0 and last_used[s] == c:
                entries[j] = s
                j += 1
        if j > start:
            seg_end[h] = j
            seg_clock[h] = c
            h += 1
        lo = hi
    return j, h
