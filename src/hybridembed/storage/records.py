"""The records of a dynamic tiered table (:mod:`hybridembed.storage.tiered_hash`): their layout (a
row and its optimizer state as bytes: :func:`record_parts`, :func:`pack`, :func:`unpack`) and
their index (:class:`Homes`): (table, id) -> record, for every row that was ever spilled to disk,
and each record's pair.

Its arrays are files of the table's directory mapped into memory (:func:`~hybridembed.storage.mapped.mapped`):
an index larger than the memory a process may use stays on disk, its pages in the kernel's page
cache. Probing it is random access, so it is written in the order of its positions, never a
fault at a time: the records made since it was last written are kept in a small index in memory
(up to two million, looked up after the big one) and then written all at once, sorted by home
position, the index read ahead in one sweep (``MADV_WILLNEED``) a span at a time; a rebuild
sorts the records by window of positions (a counting sort into a mapped array) and fills a
window at a time while the next is read ahead. The positions' mappings are read at random
(``MADV_RANDOM``: a lookup's fault reads its own page); the records' pairs, scanned in order,
keep the kernel's read-ahead.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..kernels import cpu_hash
from .hashed import _EMPTY, _FIND_WINDOW, _PROBES, HashStorage
from .mapped import _PAGE, grown, mapped, willneed

__all__ = ["Homes", "record_parts", "record_bytes", "pack", "unpack"]


# --- a record: a row and its optimizer state, as bytes ------------------------------------------
def record_parts(held: dict[str, torch.Tensor]) -> list[tuple[str, torch.dtype, tuple[int, ...], int, int]]:
    """A record's parts for the cache's ``{"weight": rows, state...}`` ((C, ...) each): (name, dtype,
    one row's shape, first byte, end byte), the row, then each optimizer state (one file, one read
    a record: measured 2.3x -> 2.0x the step in memory against a file each)."""
    parts, at = [], 0
    for name, t in held.items():
        n = t.dtype.itemsize * math.prod(t.shape[1:])
        parts.append((name, t.dtype, tuple(t.shape[1:]), at, at + n))
        at += n
    return parts


def record_bytes(parts: list) -> int:
    return parts[-1][4]


def pack(data: dict[str, torch.Tensor], parts: list) -> torch.Tensor:
    """Rows and their state (each (K, ...)) -> records (K, record bytes) uint8."""
    k = data["weight"].shape[0]
    cols = [
        data[n].to(dt).reshape(k, (b - a) // dt.itemsize).contiguous().view(torch.uint8) for n, dt, _, a, b in parts
    ]
    return torch.cat(cols, 1)


def unpack(records: torch.Tensor, parts: list) -> dict[str, torch.Tensor]:
    """Records (K, record bytes) uint8 -> their rows and state (copies, each (K, ...))."""
    k, width = records.shape
    out = {}
    for n, dt, shape, a, b in parts:  # (typed before the copy where the bytes allow: fewer, wider moves)
        part = records[:, a:b]
        typed = width % dt.itemsize == 0 and a % dt.itemsize == 0 and records.data_ptr() % dt.itemsize == 0
        out[n] = (part.view(dt).contiguous() if typed else part.contiguous().view(dt)).view(k, *shape)
    return out


class Homes:
    """(table, id) -> home record: :class:`HashStorage`'s index (its find and insert: the Numba
    loops where Numba imports, else the torch ops) over records; insert-only, rebuilt twice as
    large when half full. Its arrays are :func:`mapped` in ``where`` (the table's directory; None:
    in memory). The torch ops' insert needs a claim (4 bytes) beside each position; the Numba
    loops insert in order and need none (16 bytes a position instead of 20)."""

    kernels = "auto"
    _hash = HashStorage._hash
    _window = HashStorage._window
    find = HashStorage._find
    _insert = HashStorage._insert
    _REINDEX = 1 << 20  # records put back in the index a call (a rebuild's temporaries stay small)
    _WINDOW_BYTES = 32 << 20  # a rebuild, or a batch writing much of it, goes this much of the index at a time
    _SWEEP = 16  # (a batch of records at least 1/16 of the index's pages: the reads in one sweep pay)
    # records made since the index was last written, kept in memory up to this many (~104 MiB: the
    # same 4M positions as a million's 92 MiB; docs/benchmarks.md "Two million recent records")
    _RECENT = 1 << 21
    _BYTES = 16  # a position: its pair (and, with the torch ops, a claim of 4 more)

    def __init__(self) -> None:
        self.where: Path | None = None
        self.weight = torch.zeros(0)  # (the kernel choice reads its device: the CPU)
        self.key = torch.zeros(0, dtype=torch.int64)  # (>= n,) the pair of each record
        self.tab = torch.zeros(0, dtype=torch.int32)
        self.n = 0  # records made
        self._merged = 0  # records 0 .. _merged - 1 are in the index; the rest in ``_recent``
        self._recent: Homes | None = None  # (mapped files only: records made since, in memory)
        self._reset(16)

    def _reset(self, positions: int) -> None:
        self._mask = positions - 1
        self._hrow = mapped(self.where, (positions, 2), torch.int64, _EMPTY, random=True)
        eager = not cpu_hash.runs_on(self.kernels, self.weight)
        self._claim = mapped(self.where, (positions,) if eager else (0,), torch.int32, -1, random=True)
        self._probe_offsets = torch.arange(_PROBES)
        self._find_offsets = torch.arange(_FIND_WINDOW)

    def _reindex(self, positions: int) -> None:
        """A new index of ``positions`` positions holding every record (the old one kept if it
        fails). In mapped files, a window of :attr:`_WINDOW_BYTES` of positions at a time: the
        records sorted by the window of their home position first (a counting sort into a mapped
        array, written in runs), then each window's records inserted while the next window's pages
        are read ahead: every page is read and written once, in order, whatever the page cache."""
        old = self._mask, self._hrow, self._claim
        n, step = self.n, self._REINDEX
        windows = 1 if self.where is None else max(1, positions * self._BYTES // self._WINDOW_BYTES)
        try:
            self._reset(positions)
            if windows == 1:
                for lo, hi in ((lo, min(lo + step, n)) for lo in range(0, n, step)):
                    self._insert(self.key[lo:hi], self.tab[lo:hi], torch.arange(lo, hi))
            else:
                self._rebuild(positions, windows)
        except BaseException:
            self._mask, self._hrow, self._claim = old
            raise
        self._merged, self._recent = n, None if self.where is None else Homes()

    def _rebuild(self, positions: int, windows: int) -> None:
        """Every record into the new (empty) index, a window of positions at a time."""
        n, step = self.n, self._REINDEX
        counts = torch.zeros(windows, dtype=torch.int64)
        for lo in range(0, n, step):
            counts += torch.bincount(self._home_window(lo, lo + step, windows), minlength=windows)
        starts = torch.cumsum(counts, 0) - counts
        rows = mapped(self.where, (n, 3), torch.int64)  # (key, table, record) by window: a counting sort
        end = starts.clone()
        for lo in range(0, n, step):  # (hashed again: this pass reads the pairs anyway, a stored window would be I/O)
            w = self._home_window(lo, lo + step, windows)
            order = torch.argsort(w, stable=True)
            w = w.index_select(0, order)
            c = torch.bincount(w, minlength=windows)
            at = end.index_select(0, w) + torch.arange(w.numel()) - (torch.cumsum(c, 0) - c).index_select(0, w)
            recs = order + lo
            rows.index_copy_(
                0, at, torch.stack([self.key.index_select(0, recs), self.tab.index_select(0, recs).long(), recs], 1)
            )
            end += c
        edge = [min(w, windows) * positions // windows for w in range(windows + 2)]
        for w in range(windows):  # (the next window's pages read while this one's are written)
            self._ahead(edge[w + 1] if w else 0, edge[w + 2])
            for lo in range(int(starts[w]), int(end[w]), step):
                part = rows[lo : min(lo + step, int(end[w]))]
                self._insert(part[:, 0], part[:, 1].to(torch.int32), part[:, 2])

    def _home_window(self, lo: int, hi: int, windows: int) -> torch.Tensor:
        """The window of each record's home position, records ``lo:hi``."""
        hi = min(hi, self.n)
        return (self._hash(self.key[lo:hi], self.tab[lo:hi]) & self._mask) * windows // (self._mask + 1)

    def lookup(self, keys: torch.Tensor, tabs: torch.Tensor) -> torch.Tensor:
        """(K,) records of (table, id) pairs; -1 where none."""
        if keys.numel() == 0 or self.n == 0:
            return torch.full((keys.numel(),), -1, dtype=torch.int64)
        recs = self.find(keys, tabs) if self._merged else torch.full((keys.numel(),), -1, dtype=torch.int64)
        if self._recent is not None and self._recent.n:
            miss = (recs < 0).nonzero().squeeze(1)
            got = self._recent.lookup(keys.index_select(0, miss), tabs.index_select(0, miss))
            recs[miss] = torch.where(got >= 0, got + self._merged, got)
        return recs

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
        if self._recent is None:  # (in memory: straight into the index)
            self._put(keys, tabs, recs)
            self._merged = self.n
            return recs
        if self._recent.n + m >= self._RECENT:  # (the index swept once for many batches' records)
            self._merge()
        else:
            self._recent.add(keys, tabs)
        return recs

    @property
    def recent_bytes(self) -> int:
        """Bytes in memory of the records made since the index was last written."""
        r = self._recent
        return 0 if r is None or not r.n else sum(t.nbytes for t in (r.key, r.tab, r._hrow, r._claim))

    def _merge(self) -> None:
        """The recent records written into the index (in one sweep, when it pays: :meth:`_put`)."""
        lo, hi = self._merged, self.n
        self._put(self.key[lo:hi], self.tab[lo:hi], torch.arange(lo, hi))
        self._merged, self._recent = hi, Homes()

    def _ahead(self, lo: int, hi: int) -> None:
        """Start reading positions ``lo:hi`` from the disk (:func:`willneed`)."""
        if self.where is not None:
            willneed(self._hrow[lo:hi])
            willneed(self._claim[lo:hi])

    def _put(self, keys: torch.Tensor, tabs: torch.Tensor, recs: torch.Tensor) -> None:
        """Insert records in the order of their home positions (a page written once, not faulted
        in again for each of its records). A batch that writes much of an index larger than
        :attr:`_WINDOW_BYTES` goes a span of positions at a time, the next span's pages read from
        the disk in one sweep while this span's are written, not a fault at a time."""
        home = self._hash(keys, tabs) & self._mask
        order = torch.argsort(home)
        keys, tabs, recs, home = (t.index_select(0, order) for t in (keys, tabs, recs, home))
        positions = self._mask + 1
        span = self._WINDOW_BYTES // self._BYTES
        if self.where is None or positions <= span or keys.numel() * self._SWEEP < positions * self._BYTES // _PAGE:
            self._insert(keys, tabs, recs)
            return
        cuts = torch.searchsorted(home, torch.arange(0, positions, span)).tolist() + [keys.numel()]
        for i in range(len(cuts) - 1):
            self._ahead((i + 1) * span if i else 0, (i + 2) * span)
            if cuts[i] < cuts[i + 1]:
                self._insert(keys[cuts[i] : cuts[i + 1]], tabs[cuts[i] : cuts[i + 1]], recs[cuts[i] : cuts[i + 1]])
