"""The records index of a dynamic tiered table (:mod:`hybridembed.storage.tiered_hash`): (table,
id) -> record, for every row that was ever spilled to disk, and each record's pair.

Its arrays are files of the table's directory mapped into memory (:func:`~hybridembed.storage.tiered.mapped`):
an index larger than the memory a process may use stays on disk, its pages in the kernel's page
cache. Probing it is random access, so it is written in the order of its positions: a batch's new
records sorted by home position, a rebuild a window of positions at a time (each window's pages
filled while they are in memory), and the positions' mappings read at random (``MADV_RANDOM``);
the records' pairs, scanned in order by a rebuild, keep the kernel's read-ahead.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .hashed import _EMPTY, _FIND_WINDOW, _PROBES, HashStorage
from .tiered import grown, mapped

__all__ = ["Homes"]


class Homes:
    """(table, id) -> home record: :class:`HashStorage`'s index (its eager find and insert) over
    records; insert-only, rebuilt twice as large when half full. Its arrays are :func:`mapped` in
    ``where`` (the table's directory; None: in memory)."""

    kernels = "eager"
    _hash = HashStorage._hash
    _window = HashStorage._window
    find = HashStorage._find
    _insert = HashStorage._insert
    _REINDEX = 1 << 20  # records put back in the index a call (a rebuild's temporaries stay small)
    _WINDOW_BYTES = 256 << 20  # a rebuild of a larger index goes a window of positions at a time

    def __init__(self) -> None:
        self.where: Path | None = None
        self.weight = torch.zeros(0)  # (the kernel choice reads its device: the CPU)
        self.key = torch.zeros(0, dtype=torch.int64)  # (>= n,) the pair of each record
        self.tab = torch.zeros(0, dtype=torch.int32)
        self.n = 0  # records made
        self._reset(16)

    def _reset(self, positions: int) -> None:
        self._mask = positions - 1
        self._hrow = mapped(self.where, (positions, 2), torch.int64, _EMPTY, random=True)
        self._claim = mapped(self.where, (positions,), torch.int32, -1, random=True)
        self._probe_offsets = torch.arange(_PROBES)
        self._find_offsets = torch.arange(_FIND_WINDOW)

    def _reindex(self, positions: int) -> None:
        """A new index of ``positions`` positions holding every record (the old one kept if it fails)."""
        old = self._mask, self._hrow, self._claim
        windows = max(1, positions * 20 // self._WINDOW_BYTES)  # (20 bytes a position: its pair and claim)
        chunks = [(lo, min(lo + self._REINDEX, self.n)) for lo in range(0, self.n, self._REINDEX)]
        try:
            self._reset(positions)
            which = mapped(self.where, (self.n if windows > 1 else 0,), torch.int32)  # each record's window
            for lo, hi in chunks if windows > 1 else ():  # (hashed once, not once a window)
                which[lo:hi] = (self._hash(self.key[lo:hi], self.tab[lo:hi]) & self._mask) * windows // positions
            for w in range(windows):
                for lo, hi in chunks:
                    keys, tabs, recs = self.key[lo:hi], self.tab[lo:hi], torch.arange(lo, hi)
                    if windows > 1:
                        at = (which[lo:hi] == w).nonzero().squeeze(1)
                        keys, tabs, recs = keys.index_select(0, at), tabs.index_select(0, at), recs.index_select(0, at)
                    self._insert(keys, tabs, recs)
        except BaseException:
            self._mask, self._hrow, self._claim = old
            raise

    def lookup(self, keys: torch.Tensor, tabs: torch.Tensor) -> torch.Tensor:
        """(K,) records of (table, id) pairs; -1 where none."""
        if keys.numel() == 0 or self.n == 0:
            return torch.full((keys.numel(),), -1, dtype=torch.int64)
        return self.find(keys, tabs)

    def reserve(self, total: int, ahead: int = 2) -> None:
        """Room for ``total`` records, the index sized for ``ahead`` times them when rebuilt (a load
        of many rows: 2, one rebuild; a batch's: 4, a doubling), before any record goes in."""
        if total > self.key.numel():
            size = max(total, (ahead // 2) * self.key.numel())
            key = grown(self.key, size, self.where, keep=self.n)  # (both made before either is replaced)
            self.key, self.tab = key, grown(self.tab, size, self.where, _EMPTY, keep=self.n)
        if 2 * total > self._mask + 1:
            self._reindex(1 << math.ceil(math.log2(ahead * total)))

    def add(self, keys: torch.Tensor, tabs: torch.Tensor) -> torch.Tensor:
        """Records for (table, id) pairs (distinct, without one): their numbers (K,)."""
        n, m = self.n, keys.numel()
        self.reserve(n + m, ahead=4)
        recs, tabs = torch.arange(n, n + m), tabs.to(torch.int32)
        self.key[n : n + m], self.tab[n : n + m] = keys, tabs
        self.n = n + m
        order = torch.argsort(self._hash(keys, tabs) & self._mask)  # (probes in position order: a page once)
        self._insert(keys.index_select(0, order), tabs.index_select(0, order), recs.index_select(0, order))
        return recs
