"""A tiered cache's least recently used victims (:class:`~hybridembed.storage.tiered.TieredStorage`):
a recency queue, so that choosing k victims costs about k entries (amortised, with Numba), not a
pass over the cache.

Each lookup appends its distinct slots to the queue as one segment stamped with the lookup's
clock; a slot's entry is *live* while the slot holds a row last used at that clock (a later
lookup of the slot, or its eviction, makes the older entry stale: skipped, then dropped). The
first live entries from the queue's head are therefore the least recently used slots, ties in the
order their lookup gave them. Measured on a 400,000-row cache choosing 6,000 victims a step: a
count of the whole cache by ``last_used`` took ~1 ms of a ~11 ms dense tiered step
(docs/benchmarks.md, "Tiered tables"). One Numba loop where Numba imports
(:mod:`hybridembed.kernels._numba_victims`), else torch ops choosing the same slots.
"""

from __future__ import annotations

import torch

from ..kernels import numba_loops

__all__ = ["RecencyQueue"]


def _kernel():
    return numba_loops("_numba_victims")


class RecencyQueue:
    """The slots of a cache of ``capacity`` slots in the order they were last used (see the module
    docstring). ``last_used`` (C,) int64 and ``taken`` (C,) int64 (>= 0: the slot holds a row) are the
    cache's own, passed to each call; the queue only reads them."""

    def __init__(self, capacity: int):
        self.dtype = torch.int32 if capacity < 2**31 else torch.int64  # (an entry is a slot)
        self.entries = torch.empty(2 * capacity + 1024, dtype=self.dtype)
        self.seg_end = torch.empty(1024, dtype=torch.int64)  # each segment's end in entries
        self.seg_clock = torch.empty(1024, dtype=torch.int64)
        self.n = self.nseg = 0  # entries and segments held
        self.head = self.g = 0  # the first entry that may be live, and its segment

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What the queue holds in memory."""
        return self.entries, self.seg_end, self.seg_clock

    def push(self, slots: torch.Tensor, clock: int, last_used: torch.Tensor, taken: torch.Tensor) -> None:
        """Distinct ``slots`` (U,) used at ``clock`` (``last_used[slots] == clock`` already), in order."""
        u = slots.numel()
        if u == 0:
            return
        if self.n + u > self.entries.numel() or self.nseg == self.seg_end.numel():
            self._compact(last_used, taken)  # (leaves at most one live entry a cached slot)
            if self.n + u > self.entries.numel():  # (n <= C and u <= C after it: only a buffer made smaller)
                grown = torch.empty(max(2 * self.entries.numel(), self.n + u), dtype=self.dtype)
                grown[: self.n] = self.entries[: self.n]
                self.entries = grown
            if 2 * self.nseg >= self.seg_end.numel():  # (half full still: doubled, or it compacts every few lookups)
                self.seg_end = torch.cat([self.seg_end, torch.empty_like(self.seg_end)])
                self.seg_clock = torch.cat([self.seg_clock, torch.empty_like(self.seg_clock)])
        self.entries[self.n : self.n + u] = slots
        self.n += u
        self.seg_end[self.nseg] = self.n
        self.seg_clock[self.nseg] = clock
        self.nseg += 1

    def victims(
        self, k: int, last_used: torch.Tensor, taken: torch.Tensor, protect: torch.Tensor
    ) -> tuple[torch.Tensor | None, int]:
        """The ``k`` (>= 1) least recently used slots that hold a row and are not ``protect`` (C,)
        bool, and the head the queue may take once they are evicted (:meth:`advance`); (None, head)
        where fewer than ``k`` are eligible. Changes nothing."""
        K = _kernel()
        if K is not None:
            out = torch.empty(k, dtype=torch.int64)
            found, head = K.queue_victims(
                self.entries.numpy(), self.seg_end.numpy(), self.seg_clock.numpy(), self.head, self.g, self.n,
                last_used.numpy(), taken.numpy(), protect.numpy(), k, out.numpy(),
            )  # fmt: skip
            return (out, int(head)) if found == k else (None, self.head)
        e, live = self._live(last_used, taken)
        elig = (live & ~protect.index_select(0, e)).nonzero().squeeze(1)
        if elig.numel() < k:
            return None, self.head
        stop = int(elig[k - 1]) + 1
        kept = (live[:stop] & protect.index_select(0, e[:stop])).nonzero()
        return e.index_select(0, elig[:k]), self.head + (int(kept[0]) if kept.numel() else stop)

    def advance(self, head: int) -> None:
        """Entries before ``head`` are stale (their slots were evicted or used again)."""
        self.head = head
        self.g = int(torch.searchsorted(self.seg_end[: self.nseg], head, right=True))

    def _live(self, last_used: torch.Tensor, taken: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The entries from the head (E,) int64 and whether each is live (E,) bool."""
        e = self.entries[self.head : self.n].long()
        ends = self.seg_end[self.g : self.nseg]
        starts = torch.cat([torch.tensor([self.head]), ends[:-1]])
        clocks = torch.repeat_interleave(self.seg_clock[self.g : self.nseg], ends - starts)
        return e, (taken.index_select(0, e) >= 0) & (last_used.index_select(0, e) == clocks)

    def _compact(self, last_used: torch.Tensor, taken: torch.Tensor) -> None:
        K = _kernel()
        if K is not None:
            args = (self.entries.numpy(), self.seg_end.numpy(), self.seg_clock.numpy(), self.head, self.g, self.n)
            n, nseg = K.queue_compact(*args, self.nseg, last_used.numpy(), taken.numpy())
        else:
            e, live = self._live(last_used, taken)
            ends = self.seg_end[self.g : self.nseg]
            counts = torch.diff(ends, prepend=torch.tensor([self.head]))
            seg_of = torch.repeat_interleave(torch.arange(counts.numel()), counts)
            per_seg = torch.bincount(seg_of[live], minlength=counts.numel())
            nonempty = per_seg > 0
            n, nseg = int(live.sum()), int(nonempty.sum())
            self.entries[:n] = e[live].to(self.dtype)
            self.seg_clock[:nseg] = self.seg_clock[self.g : self.nseg][nonempty].clone()
            self.seg_end[:nseg] = torch.cumsum(per_seg[nonempty], 0)
        self.n, self.nseg, self.head, self.g = int(n), int(nseg), 0, 0
