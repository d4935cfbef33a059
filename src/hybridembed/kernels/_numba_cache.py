"""Numba loops of a dense tiered table's misses (:class:`hybridembed.storage.tiered.TieredStorage`,
where its files are mapped; imported only when Numba is): a step's evicted rows copied into the
files' pages and its missed rows copied from them, each row once, straight between the cache and
the mapping, and the cache's bookkeeping of both in one pass each. Torch's ops take a temporary of
the rows between the two and a pass per bookkeeping array: measured on the dense tiered step of
``benchmarks/bench_tiered.py --part speed`` (6,000 rows evicted and read a step), ~1.1 ms a step
more (docs/benchmarks.md, "Tiered tables").

The codes of ``slot_of`` (a row's cache slot, or where it is when not cached) are the caller's,
passed in.
"""

from __future__ import annotations

from numba import njit

__all__ = ["changed_of", "write_rows", "evicted", "loaded", "read_rows", "read_state"]


@njit(nogil=True, cache=True)
def changed_of(victims, row_of_slot, dirty, w_slots, w_rows):  # pragma: no cover
    """The ``victims`` (slots) holding a changed row, and those rows, into ``w_slots`` / ``w_rows``
    (in the victims' order): how many. Changes nothing else."""
    k = 0
    for i in range(victims.size):
        s = victims[i]
        if dirty[s]:
            w_slots[k] = s
            w_rows[k] = row_of_slot[s]
            k += 1
    return k


@njit(nogil=True, cache=True)
def write_rows(dst, dst_at, src, src_at, k):  # pragma: no cover
    """``dst[dst_at[i]] = src[src_at[i]]`` for the first ``k`` (rows of 2-D arrays of one width)."""
    w = dst.shape[1]
    for i in range(k):
        a, b = dst_at[i], src_at[i]
        for j in range(w):
            dst[a, j] = src[b, j]


@njit(nogil=True, cache=True)
def evicted(victims, row_of_slot, dirty, origin, slot_of, written):  # pragma: no cover
    """Slots ``victims`` freed: a changed row's place becomes ``written`` (on disk: its row and state
    were written), an unchanged one's the place it was read from (``origin``)."""
    for i in range(victims.size):
        s = victims[i]
        r = row_of_slot[s]
        slot_of[r] = written if dirty[s] else origin[s]
        row_of_slot[s] = -1
        dirty[s] = False


@njit(nogil=True, cache=True)
def loaded(rows, slots, slot_of, row_of_slot, origin, dirty):  # pragma: no cover
    """Rows ``rows`` now held in free ``slots`` (copied there already): the bookkeeping of a row
    read in unchanged (its place before, ``slot_of``, is what it goes back to)."""
    for i in range(rows.size):
        r, s = rows[i], slots[i]
        row_of_slot[s] = r
        origin[s] = slot_of[r]
        slot_of[r] = s
        dirty[s] = False


@njit(nogil=True, cache=True)
def read_rows(dst, dst_at, src, src_at, where, fresh):  # pragma: no cover
    """``dst[dst_at[i]] = src[src_at[i]]`` for each ``i`` whose row is on disk (``where[i] != fresh``)."""
    w = dst.shape[1]
    for i in range(dst_at.size):
        if where[i] != fresh:
            a, b = dst_at[i], src_at[i]
            for j in range(w):
                dst[a, j] = src[b, j]


@njit(nogil=True, cache=True)
def read_state(dst, dst_at, src, src_at, where, with_state, fill):  # pragma: no cover
    """An optimizer state's rows: read where the row's state is on disk (``where[i] == with_state``),
    else its initial value ``fill``."""
    w = dst.shape[1]
    for i in range(dst_at.size):
        a = dst_at[i]
        if where[i] == with_state:
            b = src_at[i]
            for j in range(w):
                dst[a, j] = src[b, j]
        else:
            for j in range(w):
                dst[a, j] = fill
