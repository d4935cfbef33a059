"""``TieredStorage``: the rows of a group of dense tables in files on local disk, the rows a batch
needs in a bounded in-memory cache (:class:`~hybridembed.Tiered`).

Shape legend: ``R`` rows of the group's tables (on disk), ``C`` cache rows (in memory), ``N``
ids of a batch, ``U`` distinct rows of a batch, ``D`` dim.

To the collection it is a dense storage (ids in ``[0, num_embeddings)``, shifted by each table's
``row_offset``); :meth:`TieredStorage.resolve` turns those rows into cache slots, so the kernels,
the fused step and the optimizers work on ``weight`` (C, D) and ``state`` (C, ...) exactly as on a
table in memory. Per row (``slot_of``, (R,) int32): ``>= 0`` its cache slot; :data:`FRESH` never
written (its value is the row-keyed initializer's, computed again when next needed; a mapped file
gets every row's initial value when it is built, as the table in memory does); :data:`ON_DISK`
on disk with its optimizer state; :data:`ON_DISK_NO_STATE` on disk, state at its initial value (the
row was written before an optimizer was attached).

A lookup's misses take free slots, or evict the least recently used rows that no pending gradient
names (rows looked up since the last optimizer step stay): a changed victim's row and state are
written to the files (``pwrite``, a run of consecutive rows per call, or copied into the files'
mapping: :class:`~hybridembed.storage.tiered_file._File`), then the misses are read from the files
(or initialised). A batch needs all its distinct rows at
once: more than the cache holds is refused before anything changes.

The files are scratch working memory, like swap: made afresh (and reserved on disk with
``posix_fallocate``, so a full disk fails here with a clear error, not later in a write) when the
storage is built. Checkpoints (``he.save``) and ``state_dict`` read the whole tables
through :meth:`read_range`: what keeps a table is a checkpoint.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import init as _init
from ..config import TableConfig
from ..errors import ConfigError, HybridEmbedError
from ..kernels import numba_loops
from ..utils import advise_huge_pages, get_logger
from .base import RowStorage
from .dense import DenseStorage
from .mapped import group_stem, lock_dir, map_limit
from .protocol import LookupPlan, _nothing
from .tiered_file import _File
from .victims import RecencyQueue

__all__ = ["TieredStorage", "FRESH", "ON_DISK", "ON_DISK_NO_STATE", "prefetch_rows"]

FRESH, ON_DISK, ON_DISK_NO_STATE = -1, -2, -3  # slot_of of a row not in the cache
_PREFETCH_DEPTH = 2  # prefetches held at once (the next batch's and the one after it)
_failed_lock = threading.Lock()
_LOOP_DTYPES = (torch.float32, torch.float64)  # (rows and state the Numba loops copy)
_STATS = ("lookups", "hits", "misses", "disk_reads", "evictions", "disk_writes", "prefetched", "prefetch_failed")


class _Prefetch:
    """Rows (sorted, distinct, on disk when asked for) read from the files by a background thread:
    rows ``rows`` (K,) into ``weight`` (K, D), the state of those with state into ``state``.
    ``stale`` (K,) marks rows written since (their read may be torn or old: read again).
    ``find`` (instead of ``rows``): the thread first computes the rows (K,) sorted, none with state,
    and sets ``indexed``; until then the owner must change nothing ``find`` reads (:meth:`settle`).
    A failure is counted in ``counters["prefetch_failed"]`` (the owner's stats), the first one of
    those counters logged: the lookups then read their rows themselves, which only a count shows."""

    def __init__(
        self,
        rows: torch.Tensor | None,
        with_state: torch.Tensor | None,
        files: dict[str, _File],
        rows_file: _File,
        find: Callable[[], torch.Tensor] | None = None,
        counters: dict[str, int] | None = None,
    ):
        self.rows = rows if rows is not None else torch.zeros(0, dtype=torch.int64)  # (K,) int64 ascending
        self.with_state = with_state if with_state is not None else torch.zeros(0, dtype=torch.bool)  # (K,)
        self.stale = torch.zeros(self.rows.numel(), dtype=torch.bool)
        self.weight: torch.Tensor | None = None
        self.state: dict[str, torch.Tensor] = {}
        self.error: BaseException | None = None
        self.indexed = threading.Event()
        self._counters = counters if counters is not None else {}
        if find is None:
            self.indexed.set()
        self._thread = threading.Thread(target=self._run, args=(files, rows_file, find), name="hybridembed-prefetch")
        self._thread.daemon = True
        self._thread.start()

    def settle(self) -> None:
        """Wait until the rows to read are known (the read itself may go on)."""
        self.indexed.wait()

    def _run(self, files: dict[str, _File], rows_file: _File, find: Callable[[], torch.Tensor] | None) -> None:
        try:  # (preadv releases the GIL: the step goes on meanwhile)
            if find is not None:
                try:
                    rows = find()
                    self.rows, self.with_state = rows, torch.zeros(rows.numel(), dtype=torch.bool)
                    self.stale = torch.zeros(rows.numel(), dtype=torch.bool)
                finally:
                    self.indexed.set()
            if self.rows.numel() == 0:
                return
            self.weight = rows_file.read(self.rows)
            picked = self.rows[self.with_state]
            self.state = {name: f.read(picked) for name, f in files.items()} if picked.numel() else {}
        except BaseException as e:  # noqa: BLE001 - a failed prefetch is dropped: the lookup reads itself
            self.error = e
            c = self._counters
            with _failed_lock:  # (two prefetches may fail at once: one count each, one line)
                c["prefetch_failed"] = first = c.get("prefetch_failed", 0) + 1
            if first == 1:
                get_logger(__name__).warning(
                    "tiered table file %s: a prefetch failed (%s: %s); the lookups read their rows themselves "
                    "(stats()['prefetch_failed'] counts such failures)",
                    rows_file.path,
                    type(e).__name__,
                    e,
                )

    def positions(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions (K',) in ``rows`` found here and fresh, their positions here (K',))."""
        self.indexed.wait()
        if self.rows.numel() == 0:
            return (torch.zeros(0, dtype=torch.int64),) * 2
        at = torch.searchsorted(self.rows, rows).clamp_(max=max(self.rows.numel() - 1, 0))
        hit = (self.rows.index_select(0, at) == rows) & ~self.stale.index_select(0, at)
        found = hit.nonzero().squeeze(1)
        return found, at.index_select(0, found)

    def ready(self) -> bool:
        """Wait for the read; whether it succeeded."""
        self._thread.join()
        return self.error is None and self.weight is not None

    def worth_waiting(self, found: int) -> bool:
        """Whether a lookup that wants ``found`` of its rows should wait for this read: it is done,
        or a fair share of what it reads is wanted now (a prefetch of a later batch still reading is
        left alone: the lookup reads its few rows itself)."""
        return not self._thread.is_alive() or 4 * found >= self.rows.numel()


def add_prefetch(held: list[_Prefetch], pf: _Prefetch | None) -> None:
    """``pf`` after the prefetches ``held`` (oldest first), the oldest dropped beyond
    :data:`_PREFETCH_DEPTH` (its read waited for: its thread never outlives its place here)."""
    while len(held) >= _PREFETCH_DEPTH:
        held.pop(0).ready()
    if pf is not None:
        held.append(pf)


def prefetch_rows(features, storages, jagged: dict) -> None:
    """:meth:`EmbeddingCollection.prefetch`: each tiered group's rows of ``jagged`` (checked
    inputs by feature name; ids outside a table dropped) to its storage's :meth:`~TieredStorage.prefetch`
    (a tiered dynamic group: its ids to ``prefetch_ids``)."""
    rows: dict[int, list[torch.Tensor]] = {}
    keyed: dict[int, list[tuple[torch.Tensor, int]]] = {}
    for feat in features:
        if getattr(storages[feat.group], "spills", False) and feat.name in jagged:  # (dynamic: by id)
            keyed.setdefault(feat.group, []).append((jagged[feat.name].values.to(torch.int64), feat.table_index))
        if getattr(storages[feat.group], "tiered", False) and feat.name in jagged:
            v, n = jagged[feat.name].values.to(torch.int64), feat.table.num_embeddings
            rows.setdefault(feat.group, []).append(v[(v >= 0) & (v < n)] + feat.row_offset)
    for g, parts in rows.items():
        storages[g].prefetch(torch.cat(parts))
    for g, parts in keyed.items():
        ids = torch.cat([v for v, _ in parts])
        tabs = torch.cat([torch.full((v.numel(),), i, dtype=torch.int32) for v, i in parts])
        storages[g].prefetch_ids(ids, tabs)


def _kernel():
    """The Numba loops of :mod:`hybridembed.kernels._numba_cache`, or None (no Numba: torch's ops)."""
    return numba_loops("_numba_cache")


class TieredStorage(DenseStorage):
    """Rows of several dense tables of one dim and dtype on disk, ``cache_rows`` of them in memory."""

    tiered = True
    streamed = True

    def __init__(self, tables: Sequence[TableConfig], seed: int = 0, device: torch.device | str | None = None):
        RowStorage.__init__(self)  # (not DenseStorage's: it would allocate every row)
        offsets, total = self._lay_out(tables)
        self.config = self.tables[0].tiered
        self.seed = int(seed)
        kind = torch.device(device).type if device is not None else "cpu"
        if kind not in ("cpu", "meta"):
            raise ConfigError(
                f"tiered tables {', '.join(t.name for t in self.tables)}: on {device}; a tiered table's cache "
                "lives on the CPU (tiers below a GPU are not built yet)"
            )
        self._starts = torch.tensor([offsets[t.name] for t in self.tables])
        cache = min(self.config.cache_rows, total)
        weight = torch.empty(cache, self.dim, dtype=self.dtype, device=kind)
        advise_huge_pages(weight)  # (before the first write: rows of the cache are read and written at random)
        self.weight = nn.Parameter(weight.zero_() if kind != "meta" else weight)
        self._state_files: dict[str, _File] = {}
        self.dir, self._rows_file, self.counters = Path(self.config.path), None, dict.fromkeys(_STATS, 0)
        self.slot_of = torch.zeros(0, dtype=torch.int32)
        self.row_of_slot = torch.zeros(0, dtype=torch.int64)
        if kind == "meta":  # (a model described on meta for he.distribute: no files, no rows to look up)
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"Tiered(path={self.config.path!r}): cannot make the directory ({e.strerror})") from None
        self._name = group_stem(self.tables)
        lock = lock_dir(self.dir / f"{self._name}.lock")  # (held while this storage lives)
        weakref.finalize(self, os.close, lock)
        item = torch.empty((), dtype=self.dtype).element_size()
        # (Tiered(mapped=None): mapped where the rows take at most an eighth of the memory)
        self._mapped = total * self.dim * item <= map_limit(self.config.mapped)
        self._rows_file = _File(self.dir / f"{self._name}.rows", total, self.dim, self.dtype, self._mapped)
        self.slot_of = torch.full((total,), FRESH, dtype=torch.int32)  # (R,) see the module docstring
        self.row_of_slot = torch.full((cache,), -1, dtype=torch.int64)  # (C,) -1: free
        self.last_used = torch.zeros(cache, dtype=torch.int64)
        self.dirty = torch.zeros(cache, dtype=torch.bool)  # changed since read or initialised
        self.origin = torch.zeros(cache, dtype=torch.int32)  # what an unchanged row goes back to: FRESH, ON_DISK...
        self.pending = torch.zeros(cache, dtype=torch.bool)  # a gradient kept for the next step may name it
        self.free = torch.arange(cache - 1, -1, -1)  # a stack
        self.clock = 0  # lookups so far (the time of LRU)
        self._recency = RecencyQueue(cache)  # (the cached slots, least recently used first)
        self._prefetches: list[_Prefetch] = []  # the rows prefetch() is reading, or read (oldest first)
        if self._rows_file.map is not None:  # (mapped: every row's initial value written now, as in memory)
            step = max(1, (64 << 20) // (self.dim * item))
            for lo in range(0, total, step):
                rows = torch.arange(lo, min(total, lo + step))
                self._initial(rows, torch.arange(rows.numel()), self._rows_file.map, rows)
            self.slot_of.fill_(ON_DISK_NO_STATE)

    # --- the cache ---------------------------------------------------------------------------
    def resolve(self, ids: torch.Tensor, tables: Sequence[int], counts: Sequence[int], train: bool) -> LookupPlan:
        """Rows ``ids`` (N,) (shifted by ``row_offset``) -> their cache slots. Planned here (may raise:
        more distinct rows than the cache can give this batch), made by ``commit()``."""
        uniq, inverse = torch.unique(ids.to(torch.int64), return_inverse=True)  # (U,), (N,)
        slots = self.slot_of.index_select(0, uniq).to(torch.int64)  # (U,)
        miss = (slots < 0).nonzero().squeeze(1)
        short = miss.numel() - self.free.numel()
        victims, head = torch.zeros(0, dtype=torch.int64), None
        if short > 0:
            keep = self.pending.clone()  # (rows a gradient kept for the next step may name)
            keep.index_fill_(0, slots[slots >= 0], True)
            victims, head = self._recency.victims(short, self.last_used, self.row_of_slot, keep)
            if victims is None:
                raise HybridEmbedError(
                    f"tiered tables {', '.join(t.name for t in self.tables)}: this lookup needs {uniq.numel()} "
                    f"distinct rows, the cache holds {self.weight.shape[0]} of which {int(keep.sum())} are this "
                    "batch's or looked up in training since the last optimizer step (he.wrap_optimizer's step "
                    "frees them); raise Tiered(cache_rows=...) above a step's distinct rows. Nothing was changed"
                )

        def commit() -> tuple[torch.Tensor, None]:
            with torch.no_grad():
                self._evict(victims)
                if head is not None:
                    self._recency.advance(head)
                if miss.numel():
                    new = self.free[-miss.numel() :].flip(0)
                    self._load(uniq.index_select(0, miss), new)  # (may raise: the slots stay free)
                    self.free = self.free[: -miss.numel()]
                    slots[miss] = new
            self.clock += 1
            self.last_used.index_fill_(0, slots, self.clock)
            self._recency.push(slots, self.clock, self.last_used, self.row_of_slot)
            if train and torch.is_grad_enabled() and self.weight.requires_grad:
                # (until the optimizer's step: zero_grad may come before a backward)
                self.pending.index_fill_(0, slots, True)
            c = self.counters
            c["lookups"] += 1
            c["hits"] += uniq.numel() - miss.numel()
            c["misses"] += miss.numel()
            return slots.index_select(0, inverse), None

        return LookupPlan(commit, _nothing)

    def _loops(self):
        """The Numba loops of :mod:`hybridembed.kernels._numba_cache` where every file is mapped, no
        prefetch is held (none is, then) and the rows and state are contiguous float32 / float64,
        else None: torch's ops."""
        K = _kernel()
        files = [self._rows_file, *self._state_files.values()]
        if K is None or self._prefetches or any(f is None or f.map is None or not f.map_writes for f in files):
            return None
        held = [self.weight, *self.state.values()]
        if set(self._state_files) != set(self.state) or any(
            t.dtype not in _LOOP_DTYPES or not t.is_contiguous() for t in held
        ):
            return None
        return K

    def _evict(self, victims: torch.Tensor) -> None:
        """Free ``victims`` (slots): a changed row and its state written to the files first."""
        if victims.numel() == 0:
            return
        K = self._loops()
        if K is not None:
            self._evict_mapped(K, victims)
            return
        rows = self.row_of_slot.index_select(0, victims)
        changed = self.dirty.index_select(0, victims)
        w_slots, w_rows = victims[changed], rows[changed]
        if w_rows.numel():
            for pf in self._prefetches:  # (a prefetched copy of a row written now is old)
                pf.stale[pf.positions(w_rows)[1]] = True
            # written now, not behind the step (tiered_file._File.write_behind, which a dynamic table's
            # spills use): a row written into a page not in the page cache makes the kernel read that
            # page first, and a writer thread's reads then share the disk with the step's and a
            # prefetch's. Measured here (bench_tiered.py --part prefetch, 4M rows, uniform ids, page
            # cache dropped every 5 steps): written behind, a step 318-324 ms and with the prefetch
            # 302-323 ms (1-10% of its reads hidden); written now, 342-384 and 131-152 ms (95-99%)
            self._rows_file.write(w_rows, self.weight.detach().index_select(0, w_slots))
            for name, f in self._state_files.items():
                f.write(w_rows, self.state[name].index_select(0, w_slots).view(w_rows.numel(), -1))
            self.slot_of[w_rows] = ON_DISK if self._state_files else ON_DISK_NO_STATE
        keep = ~changed  # (unchanged: as it was read, on disk already or fresh and computed again when needed)
        self.slot_of[rows[keep]] = self.origin.index_select(0, victims[keep])
        self.row_of_slot[victims] = -1
        self.dirty[victims] = False
        self.free = torch.cat([self.free, victims.flip(0)])
        self.counters["evictions"] += victims.numel()
        self.counters["disk_writes"] += w_rows.numel()

    def _evict_mapped(self, K, victims: torch.Tensor) -> None:
        """:meth:`_evict` by the Numba loops (``K``), every file mapped: each changed row and its
        state copied once, from the cache into the files' pages."""
        maps = self._mappings()
        v, w_slots, w_rows = victims.numpy(), torch.empty_like(victims), torch.empty_like(victims)
        k = K.changed_of(v, self.row_of_slot.numpy(), self.dirty.numpy(), w_slots.numpy(), w_rows.numpy())
        for name, m in maps.items():
            K.write_rows(m, w_rows.numpy(), self._held2d(name).numpy(), w_slots.numpy(), k)
        written = ON_DISK if self._state_files else ON_DISK_NO_STATE
        K.evicted(v, self.row_of_slot.numpy(), self.dirty.numpy(), self.origin.numpy(), self.slot_of.numpy(), written)
        self.free = torch.cat([self.free, victims.flip(0)])
        self.counters["evictions"] += victims.numel()
        self.counters["disk_writes"] += k

    def _mappings(self) -> dict[str, Any]:
        """``{"weight", state...}``: each file's mapping as a NumPy array (every file's size checked
        first: a file cut short raises here, before anything changes)."""
        maps = {"weight": self._rows_file.mapping()} | {n: f.mapping() for n, f in self._state_files.items()}
        return {n: m.numpy() for n, m in maps.items()}

    def _held2d(self, name: str) -> torch.Tensor:
        """The cache's rows (``"weight"``) or optimizer state ``name`` as (C, width), as the files hold them."""
        t = self.weight.detach() if name == "weight" else self.state[name]
        return t.view(t.shape[0], -1)

    def _load(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Rows ``rows`` (U,) into free ``slots``: read from the files, or initialised."""
        K = self._loops()
        if K is not None:
            self._load_mapped(K, rows, slots)
            return
        where = self.slot_of.index_select(0, rows)
        disk = where != FRESH
        taken = self._from_prefetch(rows, slots, where, disk)  # (U,) bool: rows (and state) given by it
        disk &= ~taken
        if bool(disk.any()):
            d_rows, d_slots = rows[disk], slots[disk]
            self.weight.detach().index_copy_(0, d_slots, self._rows_file.read(d_rows))
            self.counters["disk_reads"] += d_rows.numel()
        fresh = (where == FRESH).nonzero().squeeze(1)
        self._initial(rows, fresh, self.weight.detach(), slots.index_select(0, fresh))
        if self.optimizer is not None:
            with_state = (where == ON_DISK) & ~taken
            fresh_state = slots[(where != ON_DISK)]  # (its initial value: not a change of the row)
            for name, (_, fill) in self.optimizer.state_spec(self.hparams).items():
                self.state[name].index_fill_(0, fresh_state, fill)
            for name, f in self._state_files.items():
                if bool(with_state.any()):
                    got = f.read(rows[with_state])
                    self.state[name].index_copy_(0, slots[with_state], got.view_as(self.state[name][: got.shape[0]]))
        self.row_of_slot[slots] = rows
        self.origin[slots] = where
        self.slot_of[rows] = slots.to(torch.int32)
        self.dirty[slots] = False

    def _load_mapped(self, K, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """:meth:`_load` by the Numba loops (``K``), every file mapped: each row and its state copied
        once, from the files' pages into the cache."""
        maps = self._mappings()
        r, s, where = rows.numpy(), slots.numpy(), self.slot_of.index_select(0, rows)
        K.read_rows(self._held2d("weight").numpy(), s, maps["weight"], r, where.numpy(), FRESH)
        fresh = (where == FRESH).nonzero().squeeze(1)
        self._initial(rows, fresh, self.weight.detach(), slots.index_select(0, fresh))
        if self.optimizer is not None:
            for name, (_, fill) in self.optimizer.state_spec(self.hparams).items():
                K.read_state(self._held2d(name).numpy(), s, maps[name], r, where.numpy(), ON_DISK, float(fill))
        # (the bookkeeping last: a copy that fails leaves only free slots written)
        K.loaded(r, s, self.slot_of.numpy(), self.row_of_slot.numpy(), self.origin.numpy(), self.dirty.numpy())
        self.counters["disk_reads"] += rows.numel() - fresh.numel()

    # --- prefetch -------------------------------------------------------------------------------
    def prefetch(self, rows: torch.Tensor) -> None:
        """Start reading, in a background thread, the rows ``rows`` (global, any order, repeats
        allowed) that are on disk and not cached now, with their optimizer state; a later lookup
        takes them from memory instead of the files. A hint: rows cached or never written are
        skipped, a row written back meanwhile is read again, a failed read is dropped. Two at a
        time (the next batch's and the one after it: a third call drops the first one's rows).
        Nothing where the files are mapped (:class:`~hybridembed.Tiered`'s ``mapped``): the page
        cache serves their rows at memory speed, and a thread would only take a core from the step
        (measured: a dynamic step 18-20 -> 29 ms with it)."""
        add_prefetch(self._prefetches, None)
        if self._rows_file is None or self._rows_file.map is not None:
            return
        rows = torch.unique(rows.reshape(-1).to(torch.int64))
        rows = rows[(rows >= 0) & (rows < self.num_rows)]
        where = self.slot_of.index_select(0, rows)
        on_disk = (where == ON_DISK) | (where == ON_DISK_NO_STATE)
        if bool(on_disk.any()):
            rows, where = rows[on_disk], where[on_disk]
            pf = _Prefetch(rows, where == ON_DISK, dict(self._state_files), self._rows_file, counters=self.counters)
            add_prefetch(self._prefetches, pf)

    def drop_prefetch(self) -> None:
        """Forget the rows prefetched (waits for the reads in progress)."""
        while self._prefetches:
            self._prefetches.pop(0).ready()

    def _from_prefetch(self, rows, slots, where, disk) -> torch.Tensor:
        """Rows of ``rows`` (U,) on disk that the prefetch holds, copied into ``slots``: (U,) bool."""
        taken = torch.zeros(rows.numel(), dtype=torch.bool)
        if not bool(disk.any()):
            return taken
        for pf in self._prefetches:  # (oldest first)
            found, at = pf.positions(rows)
            want = (disk & ~taken).index_select(0, found)
            found, at = found[want], at[want]
            if found.numel() == 0 or not pf.worth_waiting(found.numel()) or not pf.ready():
                continue
            # on disk still, and its state read if it has state now (a row gains state only by a write)
            ws = where.index_select(0, found) == ON_DISK
            keep = ~(ws & ~pf.with_state.index_select(0, at))
            found, at = found[keep], at[keep]
            self.weight.detach().index_copy_(0, slots.index_select(0, found), pf.weight.index_select(0, at))
            if self.optimizer is not None and pf.state:
                sel = (where.index_select(0, found) == ON_DISK).nonzero().squeeze(1)
                within = torch.cumsum(pf.with_state.long(), 0) - 1  # (K,) a row's place among those with state
                for name, got in pf.state.items():
                    src = got.index_select(0, within.index_select(0, at.index_select(0, sel)))
                    dst = self.state[name]
                    dst.index_copy_(
                        0, slots.index_select(0, found.index_select(0, sel)), src.view((-1, *dst.shape[1:]))
                    )
            taken[found] = True
            self.counters["prefetched"] += found.numel()
        return taken

    def _initial(self, rows: torch.Tensor, pick: torch.Tensor, out: torch.Tensor, at: torch.Tensor) -> None:
        """The initial values of rows ``rows[pick]`` (global) into ``out`` at ``at``: each table's
        row-keyed initializer, as the table in memory starts."""
        if pick.numel() == 0:
            return
        table = torch.searchsorted(self._starts, rows.index_select(0, pick), right=True) - 1
        for i, t in enumerate(self.tables):
            sel = (table == i).nonzero().squeeze(1)
            if sel.numel():
                local = rows.index_select(0, pick.index_select(0, sel)) - self.row_offset[t.name]
                if t.shard is not None:  # (a shard's row i is the whole table's row_start + i * row_step)
                    local = local * t.shard.row_step + t.shard.row_start
                vals = _init.generate(
                    t.init, self.seed, t.init_name, local, self.dim, dtype=self.dtype, col_start=t.col_start
                )
                out.index_copy_(0, at.index_select(0, sel), vals)

    def _mark(self, slots: torch.Tensor) -> None:
        """Rows ``slots`` (cache slots) changed: written back when evicted, and (once a checkpoint
        counts changes) their table rows marked for the next incremental checkpoint."""
        if slots.numel():
            s = slots.reshape(-1).long()
            self.dirty.index_fill_(0, s, True)
            if self._changed is not None:
                rows = self.row_of_slot.index_select(0, s)
                self._changed.index_fill_(0, rows[rows >= 0], True)

    def track_changes(self) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """As :meth:`RowStorage.track_changes`, counted by table row (R,), not by cache slot."""
        old = (self._changed, self._removed)
        self._changed, self._removed = torch.zeros(self.num_rows, dtype=torch.bool), []
        return old

    def read_table_rows(self, table: str, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """As :meth:`DenseStorage.read_table_rows`: read through the tiers (cached, on disk or initial)."""
        return self._gather(rows.to(torch.int64) + self.row_offset[table], slice(None))

    def after_step(self) -> None:
        self.pending.zero_()
        super().after_step()

    def attach_optimizer(self, optimizer, hparams: dict) -> None:
        """The optimizer's state beside the cached rows, and its files beside the rows' file (every
        row's state starts afresh: rows on disk keep their values, not their old state)."""
        super().attach_optimizer(optimizer, hparams)
        if self.weight.device.type == "meta":
            return
        self.drop_prefetch()  # (its state files are made afresh below)
        self._state_files = {
            name: _File(
                self.dir / f"{self._name}.{name}", self.num_rows, self.dim if t.dim() > 1 else 1, t.dtype, self._mapped
            )
            for name, t in self.state.items()
        }
        self.slot_of[self.slot_of == ON_DISK] = ON_DISK_NO_STATE
        self.origin[self.origin == ON_DISK] = ON_DISK_NO_STATE

    # --- whole tables: reads and writes through the tiers ----------------------------------------
    def _gather(self, rows: torch.Tensor, cols: slice) -> dict[str, torch.Tensor]:
        """Rows ``rows`` (K,) (global, ascending), columns ``cols``: ``{"weight", state...}`` as
        they are now (cached, on disk, or their initial values)."""
        where = self.slot_of.index_select(0, rows)
        out = {"weight": torch.empty(rows.numel(), self.dim, dtype=self.dtype)}
        for name, t in self.state.items():
            out[name] = t.new_empty((rows.numel(), *t.shape[1:]))
        spec = self.optimizer.state_spec(self.hparams) if self.optimizer is not None else {}
        for name, (_, fill) in spec.items():
            out[name].fill_(fill)
        fresh = (where == FRESH).nonzero().squeeze(1)
        self._initial(rows, fresh, out["weight"], fresh)
        disk = ((where == ON_DISK) | (where == ON_DISK_NO_STATE)).nonzero().squeeze(1)
        if disk.numel():
            out["weight"].index_copy_(0, disk, self._rows_file.read(rows.index_select(0, disk)))
            with_state = (where == ON_DISK).nonzero().squeeze(1)
            for name, f in self._state_files.items():
                if with_state.numel():
                    got = f.read(rows.index_select(0, with_state))
                    out[name].index_copy_(0, with_state, got.view((-1, *out[name].shape[1:])))
        cached = (where >= 0).nonzero().squeeze(1)
        if cached.numel():
            slots = where.index_select(0, cached).long()
            out["weight"].index_copy_(0, cached, self.weight.detach().index_select(0, slots))
            for name, t in self.state.items():
                out[name].index_copy_(0, cached, t.index_select(0, slots))
        return {k: (v[:, cols] if v.dim() > 1 else v) for k, v in out.items()}

    def read_range(
        self, table: str, row_start: int, row_stop: int, col_start: int = 0, col_stop: int | None = None
    ) -> dict[str, torch.Tensor]:
        """As :meth:`DenseStorage.read_range`: copies, wherever the rows are."""
        col_stop = self.dim if col_stop is None else col_stop
        self._check_range(table, (row_start, row_stop), (col_start, col_stop))
        a = self.row_offset[table]
        return self._gather(torch.arange(a + row_start, a + row_stop), slice(col_start, col_stop))

    @torch.no_grad()
    def write_range(self, table: str, row_start: int, data: dict[str, torch.Tensor], col_start: int = 0) -> None:
        """As :meth:`DenseStorage.write_range`: each row read into the cache batch by batch, written
        there (it goes to disk when evicted)."""
        k, cols = self._checked_write(table, row_start, data, col_start)
        self._write(
            self.row_offset[table] + torch.arange(row_start, row_start + k), data, slice(col_start, col_start + cols)
        )

    def _write(self, rows: torch.Tensor, data: dict[str, torch.Tensor], cols: slice) -> None:
        """``data`` (each (K, ...) in the order of ``rows``) into global ``rows`` (K,) distinct, a
        cache's worth at a time (no pending gradient may name the rows evicted: a load, not a step)."""
        step = max(1, self.weight.shape[0] // 2)
        for lo in range(0, rows.numel(), step):
            part = rows[lo : lo + step]
            slots, _ = self.resolve(part, [], [], False).commit()
            for name, v in data.items():
                dst = self.weight.detach() if name == "weight" else self.state[name]
                piece = v[lo : lo + step].to(dst.dtype)
                if dst.dim() > 1:
                    dst[slots, cols] = piece
                else:
                    dst[slots] = piece
            self._mark(slots)

    def table_rows(self, name: str) -> torch.Tensor:
        """(num_embeddings, D) rows of table ``name``: a copy (the rows are not in one matrix)."""
        start, n = self._span(name)
        return self._gather(torch.arange(start, start + n), slice(None))["weight"]

    def table_state(self, name: str) -> dict[str, torch.Tensor]:
        """Copies of table ``name``'s rows of each optimizer state tensor."""
        start, n = self._span(name)
        out = self._gather(torch.arange(start, start + n), slice(None))
        out.pop("weight")
        return out

    @torch.no_grad()
    def load_table_state(self, name: str, ids: torch.Tensor | None, state: dict[str, torch.Tensor]) -> None:
        start, n = self._span(name)
        self._write(torch.arange(start, start + n), dict(state), slice(None))

    @torch.no_grad()
    def write_ids(
        self, table: str, ids: torch.Tensor, rows: torch.Tensor, state: dict[str, torch.Tensor] | None = None
    ) -> None:
        rows_at, data = self._checked_ids(table, ids, rows, state)
        self._write(rows_at.to(torch.int64), data, slice(None))

    # --- accounting ---------------------------------------------------------------------------
    @property
    def memory_bytes(self) -> int:
        """Bytes in memory: the cached rows and state, the (R,) map of where each row is, and the
        cache's bookkeeping (a slot's row, use, origin and flags; the free slots; the recency queue)."""
        held = [self.weight, *self.state.values(), self.slot_of, self.row_of_slot]
        if self.row_of_slot.numel():
            held += [self.last_used, self.origin, self.dirty, self.pending, self.free, *self._recency.tensors()]
        return sum(t.numel() * t.element_size() for t in held)

    def stats(self, table: str | None = None) -> dict[str, Any]:
        """``rows``, ``memory_bytes``, ``disk_bytes``, ``cache_rows``, and the cache's ``hits``,
        ``misses``, ``hit_rate`` (distinct rows of lookups found cached), evictions, disk reads and writes,
        rows ``prefetched`` (taken from a prefetch by a lookup) and prefetches that failed (``prefetch_failed``)."""
        c = dict(self.counters)
        seen = c["hits"] + c["misses"]
        disk = sum(os.path.getsize(f.path) for f in (self._rows_file, *self._state_files.values()) if f is not None)
        out = {"rows": self.num_rows, "memory_bytes": self.memory_bytes, "disk_bytes": disk}
        if table is not None:
            out["rows"] = self._span(table)[1]
        return out | {"cache_rows": self.weight.shape[0], "hit_rate": c["hits"] / seen if seen else 0.0} | c

    def extra_repr(self) -> str:
        names = ", ".join(t.name for t in self.tables)
        return f"rows={self.num_rows}, cache_rows={self.weight.shape[0]}, dim={self.dim}, path={str(self.dir)!r}, tables=[{names}]"
