"""``TieredHashStorage``: dynamic tables (any int64 id, rows made on first sight) whose rows live on
local disk behind a bounded in-memory cache (:class:`~hybridembed.Tiered` on a dynamic table).

Shape legend: ``C`` cache slots, ``R`` records on disk, ``N`` ids of a batch, ``D`` dim.

The cache is a :class:`~hybridembed.storage.HashStorage` of ``cache_rows`` slots (its index of the
ids it holds, rows, optimizer state, recency, frequency, admission and counters). When a batch
needs room, the rows of lowest score (``Dynamic(eviction=None)``: ``lrfu``, recency with each
doubling of a row's count worth 8 lookups; ``lru``, ``lfu`` as chosen) that no pending
gradient names are *spilled*: each written with its optimizer state to its home record on disk.
A row looked up again is read back from there (it was admitted once: no admission again). So the
table keeps every row it admitted, in memory or on disk, and trains exactly as the same dynamic
table in memory without a capacity (DeepRec's multi-tier EmbeddingVariable: hot ids in DRAM, the
rest on SSD).

On disk: one file of records, each a row and its optimizer state (one read brings a row back
whole). While the file fits the page cache (:class:`~hybridembed.Tiered`'s ``mapped``), it is
read, and rows read back are written again, through a mapping, each in its record's place; a row
never spilled before is appended. A larger file is read and written by system calls (a Numba
loop of ``pread`` / ``pwrite``, :mod:`hybridembed.kernels._numba_io`), and every spill appends
its records at the end (one write; measured 4.09x -> 2.8x the step in memory against a write per
row in place), so a row's place moves. The file is compacted when most of it is dead, and grown
before anything changes (a full disk refuses the batch). A spilled row leaves a tombstone in the
cache's index.

Per record (one per row ever spilled): its (table, id), place, recency, frequency, whether it
holds the row now (``live``: the row is not cached), and HashStorage's open-addressing index
(table, id) -> record, insert-only (a row keeps its record for life): 70-100 bytes per row on disk,
in files of the table's directory mapped into memory (:mod:`hybridembed.storage.records`): page
cache, not the process's memory. A batch needs all its distinct rows in the cache at once: more
than it holds is refused before anything changes. Whole-table reads (``state_dict``, ``dynamic_rows``, export) merge the
cache and the records and hold the table's rows in memory while they run; checkpoints (``he.save``,
``he.load``) read and write a part of the rows at a time (:meth:`TieredHashStorage.save_parts`,
:meth:`TieredHashStorage.load_parts`).
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..config import TableConfig
from ..errors import ConfigError, HybridEmbedError
from .hashed import _EMPTY, HashStorage, eviction_score
from .mapped import group_stem, grown, lock_dir, map_limit, mapped
from .pairs import sort_pairs
from .protocol import LookupPlan, _nothing
from .records import Homes, pack, record_bytes, record_parts, unpack
from .tiered import _Prefetch, add_prefetch
from .tiered_file import _File

__all__ = ["TieredHashStorage"]

_NONE = -2  # slot_rec of a cached row known to have no record yet (-1: not known; else its record)
_TOMB = torch.tensor([[_EMPTY, ((1 << 31) - 1) << 32]])  # an index row of a spilled pair: no table has this number


class TieredHashStorage(HashStorage):
    """Rows of a group of dynamic tables on disk, ``cache_rows`` of them in memory (module docstring)."""

    spills = True
    streamed = True  # checkpoints: save_parts and load_parts
    COMPACT_AT = 1 << 16  # dead places (held by no record, or to be left: _dead) before compacting, at least
    slot_pos: torch.Tensor | None = None  # (C,) each cached row's position in the cache's index (see _insert)

    def __init__(self, tables: Sequence[TableConfig], seed: int = 0, device: torch.device | str | None = None):
        kind = torch.device(device).type if device is not None else "cpu"
        if kind not in ("cpu", "meta"):
            raise ConfigError(
                f"tiered tables {', '.join(t.name for t in tables)}: on {device}; a tiered table's cache lives "
                "on the CPU (tiers below a GPU are not built yet)"
            )
        super().__init__(tables, seed, device)
        self.tier = self.tables[0].tiered
        self.spill_counters = dict.fromkeys(
            ("spilled", "read_back", "disk_writes", "prefetched", "prefetch_failed", "compactions"), 0
        )
        self._homes = Homes()
        self.rec_last = torch.zeros(0, dtype=torch.int64)  # (R,) recency of each record's row
        self.rec_freq = torch.zeros(0, dtype=torch.int64)
        self.rec_live = torch.zeros(0, dtype=torch.bool)  # holds the row now (it is not cached)
        self._live = 0  # records that hold their row (kept where ``rec_live`` changes: :meth:`_set_live`)
        self.rec_changed = torch.zeros(0, dtype=torch.bool)  # changed since the last checkpoint
        self.rec_at = torch.zeros(0, dtype=torch.int64)  # where in the files its row is (-1: nowhere yet)
        self._file: _File | None = None  # (places, record bytes) uint8: each record a row and its optimizer state
        self._parts = self._parts_of()  # where in a record each of them is
        self._reserved = 0  # places the files have room for
        self._tail = 0  # the next free place: new records (and, unmapped, every spill) append; compaction reclaims
        self._placed = 0  # records with a place (``rec_at >= 0``)
        self._prefetches: list[_Prefetch] = []  # records prefetch() is reading, or read (oldest first)
        self.pinned = torch.zeros(self.weight.shape[0], dtype=torch.bool)  # a pending gradient may name it
        self.slot_rec = torch.full((self.weight.shape[0],), -1, dtype=torch.int64)  # a cached row's record (below)
        if kind == "meta":
            return
        self.dir = Path(self.tier.path)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"Tiered(path={self.tier.path!r}): cannot make the directory ({e.strerror})") from None
        self._name = group_stem(self.tables)
        weakref.finalize(self, os.close, lock_dir(self.dir / f"{self._name}.lock"))
        self._homes.where = self.dir  # (the records' arrays and index: mapped files there, from their first growth)
        self._file = _File(self.dir / f"{self._name}.rows", 0, record_bytes(self._parts), torch.uint8)
        self._map_limit = map_limit(self.tier.mapped)  # (records read through a mapping while the file is small)
        self._file.map_reads(self._map_limit)

    def _build_index(self, slots: int) -> None:
        super()._build_index(2 * slots)  # (twice the positions: room for the tombstones of spills)
        self._tombs = 0

    def _insert(
        self, keys: torch.Tensor, tabs: torch.Tensor, slots: torch.Tensor, at: torch.Tensor | None = None
    ) -> None:
        """As :meth:`HashStorage._insert`, each slot's index position kept (``slot_pos``): a spill
        makes its rows' positions tombstones without a search."""
        at = torch.empty(keys.numel(), dtype=torch.int64) if at is None else at
        super()._insert(keys, tabs, slots, at)
        if self.slot_pos is None:  # (the cache's slots are fixed: made at the first insert)
            self.slot_pos = torch.full((self.weight.shape[0],), -1, dtype=torch.int64)
        self.slot_pos[slots] = at

    def _unindex(self, keys: torch.Tensor, tabs: torch.Tensor, slots: torch.Tensor) -> None:
        """Spilled (table, id) pairs' index positions made tombstones (they never match and never
        end a probe) instead of rebuilding the index (measured ~3 ms a spill of 4k rows from a
        40k-row cache); rebuilt when rows and tombstones would fill half the index."""
        live = self.weight.shape[0] - 1 - self.free.numel()
        if 2 * (live + self._tombs + keys.numel()) > self._mask + 1:
            return super()._unindex(keys, tabs, slots)
        pos = self.slot_pos.index_select(0, slots)
        self._hrow.index_copy_(0, pos, _TOMB.expand(pos.numel(), 2))
        self._tombs += keys.numel()

    def _initial_slots(self) -> int:
        return self.tables[0].tiered.cache_rows  # (fixed: rows beyond it spill to disk)

    def _grow(self, needed: int) -> None:  # pragma: no cover - the plan makes room first
        raise HybridEmbedError("a tiered dynamic table's cache does not grow (a bug: rows were not spilled first)")

    # --- the lookup ---------------------------------------------------------------------------
    def plan_lookup(
        self, ids: torch.Tensor, tabs: torch.Tensor, train: bool, looked: torch.Tensor | None = None
    ) -> LookupPlan:
        """As :meth:`HashStorage.plan_lookup`; ids with a row on disk are read back into the cache
        (in eval too), making room by spilling. Refused (nothing changed) when the batch's rows
        do not fit the cache or the disk."""
        keys, ktabs, perm, counts = sort_pairs(ids, tabs, len(self.tables))
        found = self._find(keys, ktabs)
        with torch.no_grad():
            miss = (found < 0).nonzero().squeeze(1)
            recs = self._homes.lookup(keys.index_select(0, miss), ktabs.index_select(0, miss))
            on_disk = recs >= 0
            on_disk[on_disk.clone()] = self.rec_live.index_select(0, recs[on_disk])
            back, absent, dead = miss[on_disk], miss[~on_disk], recs[~on_disk]  # (dead: a record not holding it, or -1)
            recs = recs[on_disk]
            ok = commit_admission = None
            rollback = _nothing
            new = absent[:0]
            if train and absent.numel():
                ok, commit_admission, rollback = self._admit(keys[absent], ktabs[absent], counts[absent])
                new, dead = (absent, dead) if ok is None else (absent[ok], dead[ok])
            try:
                victims = self._plan_spills(back.numel() + new.numel(), found.clamp_min(0))
                self._reserve(victims)
            except HybridEmbedError:
                rollback()
                raise

        def commit() -> tuple[torch.Tensor, tuple | None]:
            with torch.no_grad():
                self._spill(victims)
                if back.numel():
                    found[back] = self._read_back(keys[back], ktabs[back], recs)
            if not train:
                return self._per_id(found.clamp_min(0), perm, counts), None
            rej = None if ok is None else absent[~ok]
            lk = self._looked(ktabs, counts, looked)
            out = self._commit_lookup(
                keys, ktabs, perm, counts, found, absent, new, rej, victims[:0], commit_admission, lk
            )
            self.slot_rec[found[new]] = torch.where(dead >= 0, dead, _NONE)  # (new rows: their record known)
            if torch.is_grad_enabled() and self.weight.requires_grad:  # (until the optimizer's step)
                self.pinned[found[found > 0]] = True
            return out

        return LookupPlan(commit, rollback)

    def _protected(self, batch_slots: torch.Tensor) -> torch.Tensor:
        """As :meth:`HashStorage._protected`, and every row a training lookup handed out since the
        last step of ``he.wrap_optimizer`` (a table stepped by another optimizer keeps them: its
        cache fills and is refused, not corrupted)."""
        return super()._protected(batch_slots) | self.pinned

    def _evict(self, victims: torch.Tensor, count: bool = True) -> None:
        super()._evict(victims, count)
        self.slot_rec[victims] = -1  # (a freed slot's next row is another's)

    def after_step(self) -> None:
        super().after_step()
        self.pinned.zero_()

    def _plan_spills(self, needed: int, batch_slots: torch.Tensor) -> torch.Tensor:
        """Slots to spill so ``needed`` rows fit (``evict_fraction`` of the cache at least, as
        eviction in memory): the least recently (or often) used that no pending gradient names."""
        short = needed - self.free.numel()
        if short <= 0:
            return torch.zeros(0, dtype=torch.int64)
        cand = ((self.slot_table >= 0) & ~self._protected(batch_slots)).nonzero().squeeze(1)
        if cand.numel() < short:
            raise HybridEmbedError(
                f"tiered dynamic tables {', '.join(t.name for t in self.tables)}: this batch needs {needed} rows in "
                f"the cache, {self.free.numel()} of its {self.weight.shape[0] - 1} slots are free and {cand.numel()} "
                "can be spilled (rows looked up since the last optimizer step stay); raise Tiered(cache_rows=...) "
                "above a step's distinct rows. Nothing was changed"
            )
        k = min(max(short, math.ceil(self.config.evict_fraction * (self.weight.shape[0] - 1))), cand.numel())
        score = eviction_score(self.config.eviction or "lrfu", self.last_seen[cand], self.freq[cand], self.clock)
        if k == cand.numel():
            return cand
        # the k lowest by (score, id) without sorting every candidate: those below the k-th score,
        # then the k-th score's ties by id (victims do not depend on slots)
        kth = torch.kthvalue(score, k).values
        below, tied = (score < kth).nonzero().squeeze(1), (score == kth).nonzero().squeeze(1)
        tied = tied.index_select(0, torch.argsort(self.slot_key.index_select(0, cand.index_select(0, tied))))
        return cand.index_select(0, torch.cat([below, tied[: k - below.numel()]]))

    def _reserve(self, victims: torch.Tensor) -> None:
        """Room in the files for the victims' rows (before any change: a full disk refuses the
        batch); the files compacted first when most of them is dead (rows read back or moved)."""
        if victims.numel() == 0:
            return
        self._file.make_room()  # (a failed earlier write raises here: nothing changed yet)
        live = self._live
        if self._dead() > max(live, self.COMPACT_AT):
            self._compact()
        self._room(self._tail + victims.numel())
        self._records(self._homes.n + victims.numel())  # (and the records' arrays and index: mapped files)
        self._homes.reserve(self._homes.n + victims.numel(), ahead=4)

    def _in_place(self) -> bool:
        """A spilled row goes back into its record's place: the file mapped, the page cache holding it."""
        return self._file.map is not None and self._file.fits

    def _dead(self) -> int:
        """Places no record will use again: written in place, those no record holds (a row read
        back goes to disk again in its place); otherwise every place but the live records' (a row
        read back is appended when it next goes to disk)."""
        return self._tail - (self._placed if self._in_place() else self._live)

    def _room(self, places: int) -> None:
        if places <= self._reserved:
            return
        size = max(places, 2 * self._reserved, 1024)
        self._file.reserve(size)
        self._reserved = size

    def _append(self, n: int) -> torch.Tensor:
        """``n`` consecutive free places at the end of the files (reserved already)."""
        self._room(self._tail + n)
        at = torch.arange(self._tail, self._tail + n)
        self._tail += n
        return at

    def _compact(self, parts: list | None = None) -> None:
        """The records on disk rewritten to the start of a new file in the order of their places
        (few calls: rows spilled together sit together), which then replaces the old one. Changes
        no row. ``parts``: a new record layout (an optimizer attached: the rows, with initial state)."""
        self.drop_prefetch()
        self._file.settle_writes()
        old, new, n, chunk = self._file, None, self._homes.n, self._homes._REINDEX
        width = record_bytes(parts or self._parts)
        try:  # (place -> its live record, -1: dead; a mapped file: memory bounded by a chunk of records)
            owner = mapped(self._homes.where, (self._tail,), torch.int64, -1)
            for lo in range(0, n, chunk):
                live = self.rec_live[lo : lo + chunk].nonzero().squeeze(1) + lo
                owner.index_copy_(0, self.rec_at.index_select(0, live), live)
            new = _File(old.path.with_name(old.path.name + ".new"), self._live, width, torch.uint8)
            step, at = max(1, (64 << 20) // max(old.row_bytes, width)), 0
            for lo in range(0, self._tail, step):
                part = owner[lo : lo + step]
                part = part.index_select(0, (part >= 0).nonzero().squeeze(1))
                records = old.read(self.rec_at.index_select(0, part))
                if parts is not None:
                    fresh = self._initial(part.numel(), parts) | {"weight": unpack(records, self._parts)["weight"]}
                    records = pack(fresh, parts)
                new.write(torch.arange(at, at + part.numel()), records)
                at += part.numel()
        except (OSError, HybridEmbedError, ConfigError) as e:
            if new is not None:
                new.path.unlink(missing_ok=True)
            raise HybridEmbedError(
                f"tiered dynamic tables {', '.join(t.name for t in self.tables)}: rewriting their file failed "
                f"({e}); nothing was changed: free room on that disk"
            ) from None
        os.replace(new.path, old.path)
        new.path, self._file = old.path, new
        new.map_reads(self._map_limit)
        self._parts = parts or self._parts
        self.rec_at.fill_(-1)
        at = 0
        for lo in range(0, self._tail, chunk):  # (each live record's new place: its rank in the old order)
            part = owner[lo : lo + chunk]
            part = part.index_select(0, (part >= 0).nonzero().squeeze(1))
            self.rec_at.index_copy_(0, part, torch.arange(at, at + part.numel()))
            at += part.numel()
        self._tail = self._reserved = self._placed = at
        self.spill_counters["compactions"] += parts is None

    # --- records: a row and its optimizer state, as bytes (storage.records' layout) ------------
    def _parts_of(self) -> list[tuple[str, torch.dtype, tuple[int, ...], int, int]]:
        return record_parts({"weight": self.weight, **self.state})

    def _initial(self, k: int, parts: list | None = None) -> dict[str, torch.Tensor]:
        """Initial optimizer state of ``k`` rows, by name (no weight)."""
        spec = self.optimizer.state_spec(self.hparams) if self.optimizer is not None else {}
        return {n: torch.full((k, *shape), spec[n][1], dtype=dt) for n, dt, shape, _, _ in (parts or self._parts)[1:]}

    def _read_records(self, recs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows and state of records ``recs`` (K,) on disk, by name."""
        return unpack(self._file.read(self.rec_at.index_select(0, recs)), self._parts)

    def _records(self, total: int) -> None:
        """Room in the per-record arrays for ``total`` records, made before the index holds them
        (a full disk refuses here: nothing changed)."""
        self._settle()
        if self.rec_last.numel() >= total:
            return
        size, where = max(total, 2 * self.rec_last.numel(), 1024), self._homes.where
        names = ("rec_last", "rec_freq", "rec_live", "rec_changed", "rec_at")
        new = {name: grown(getattr(self, name), size, where, -1 if name == "rec_at" else 0) for name in names}
        for name, t in new.items():
            setattr(self, name, t)

    def _home(self, keys: torch.Tensor, tabs: torch.Tensor) -> torch.Tensor:
        """The records of (table, id) pairs, made for those without one."""
        self._settle()
        recs = self._homes.lookup(keys, tabs)
        fresh = (recs < 0).nonzero().squeeze(1)
        if fresh.numel():
            self._records(self._homes.n + fresh.numel())
            recs[fresh] = self._homes.add(keys.index_select(0, fresh), tabs.index_select(0, fresh))
        return recs

    def _spill(self, victims: torch.Tensor) -> None:
        """Rows ``victims`` (slots) written to their records, then freed from the cache."""
        self._settle()
        if victims.numel() == 0:
            return
        n = victims.numel()
        recs = self.slot_rec.index_select(0, victims)  # (rows read back or made by a lookup know theirs: no lookup)
        self._records(self._homes.n + n)
        for which, make in ((recs == _NONE, self._homes.add), (recs == -1, self._home)):  # (none yet; not known)
            at = which.nonzero().squeeze(1)
            if at.numel():
                slots = victims.index_select(0, at)
                recs[at] = make(self.slot_key.index_select(0, slots), self.slot_table.index_select(0, slots))
        rows = {"weight": self.weight.detach().index_select(0, victims)}
        records = pack(rows | {k: v.index_select(0, victims) for k, v in self.state.items()}, self._parts)
        self._write_spill(recs, records)
        self.rec_last[recs], self.rec_freq[recs] = self.last_seen[victims], self.freq[victims]
        self._set_live(recs, True)
        changed, self._changed = self._changed, None  # (a spilled row is kept: not removed)
        if changed is not None:
            self.rec_changed[recs] = changed.index_select(0, victims)
            changed[victims] = False
        try:
            self._evict(victims, count=False)
        finally:
            self._changed = changed
        self.spill_counters["spilled"] += n
        self.spill_counters["disk_writes"] += n

    def _write_spill(self, recs: torch.Tensor, records: torch.Tensor) -> None:
        """``records`` (K, record bytes) of ``recs`` (K,) written. :meth:`_in_place`: a record with a
        place is written there again, the others appended, all through the mapping (its pages then
        made huge by its faults): no place dies as rows go back and forth (appending every spill,
        ``bench_tiered.py --part dynamic --steps 2500 --cache-frac 0.01`` compacted ~1 GB every ~8
        s, 12.5 s of a 60 s run: docs/benchmarks.md). Otherwise (in place, a row's page might be
        read from disk first) every record is appended, one write by the writer thread."""
        had = self.rec_at.index_select(0, recs)
        in_place = self._in_place()
        at = had.clone() if in_place else torch.full_like(recs, -1)
        new = (at < 0).nonzero().squeeze(1)
        if new.numel():
            self._placed += int((had.index_select(0, new) < 0).sum())  # (a record given a new place leaves its old one)
            at[new] = self._append(new.numel())  # (may grow the file past what is mapped)
            self.rec_at[recs.index_select(0, new)] = at.index_select(0, new)
        if new.numel() < recs.numel():
            self._written(at)
        if in_place and self._file.write_mapped(at, records):
            return
        if new.numel() == recs.numel():
            self._file.write_behind(at, records)  # (consecutive places: one write)
        else:  # (in place, the mapping not holding them all: by system calls now)
            self._file.write(at, records)

    def _read_back(self, keys: torch.Tensor, tabs: torch.Tensor, recs: torch.Tensor) -> torch.Tensor:
        """Rows of records ``recs`` (K,) into free slots (with their state, recency, frequency): the slots."""
        self._settle()
        n = keys.numel()  # (read first, into temporaries: a failed read changes nothing)
        got = self._from_prefetch(recs)  # ((K,) bool: records the prefetch had read, their rows and state)
        if got is None:
            data = self._read_records(recs)
        else:
            taken, data = got
            rest = (~taken).nonzero().squeeze(1)
            if rest.numel():
                for k, v in self._read_records(recs.index_select(0, rest)).items():
                    data[k].index_copy_(0, rest, v)
        slots = self._allocate(n)
        self.slot_rec[slots] = recs
        self._insert(keys, tabs, slots)
        self.weight.detach().index_copy_(0, slots, data["weight"])
        for k, v in self.state.items():
            v.index_copy_(0, slots, data[k])
        self.slot_key[slots], self.slot_table[slots] = keys, tabs.to(torch.int32)
        self.last_seen[slots], self.freq[slots] = self.rec_last[recs], self.rec_freq[recs]
        self.size += self._per_table(tabs)
        if self._changed is not None:
            self._changed[slots] = self.rec_changed.index_select(0, recs)
        self.rec_changed[recs] = False
        self._set_live(recs, False)
        self.spill_counters["read_back"] += keys.numel()
        return slots

    # --- prefetch -------------------------------------------------------------------------------
    def prefetch_ids(self, ids: torch.Tensor, tabs: torch.Tensor) -> None:
        """Start reading, in a background thread, the rows on disk of (table index ``tabs``, id
        ``ids``) pairs (a later batch's), with their optimizer state; a lookup that reads them
        back takes them from memory. A hint: rows cached or never seen are skipped, a record
        written meanwhile is read again, a failed read is dropped. Two at a time (the next batch's
        and the one after it: a third call drops the first one's rows). Nothing while the file is
        read through a mapping (as :meth:`TieredStorage.prefetch`)."""
        add_prefetch(self._prefetches, None)
        if self._file is None or self._file.map is not None or ids.numel() == 0:
            return
        ids, tabs = ids.to(torch.int64), tabs.to(torch.int32)

        def find() -> torch.Tensor:  # (in the thread: the records index is not changed until it is done)
            keys, ktabs, _, _ = sort_pairs(ids, tabs, len(self.tables))
            recs = self._homes.lookup(keys, ktabs)
            on_disk = recs >= 0
            on_disk[on_disk.clone()] = self.rec_live.index_select(0, recs[on_disk])
            return torch.sort(self.rec_at.index_select(0, recs[on_disk]))[0]  # (read by place, whole records)

        add_prefetch(self._prefetches, _Prefetch(None, None, {}, self._file, find=find, counters=self.spill_counters))

    def _settle(self) -> None:
        """Before the records index or the records' places change: the prefetches have found their rows."""
        for pf in self._prefetches:
            pf.settle()

    def _written(self, at: torch.Tensor) -> None:
        """Places ``at`` are written again in place now: a prefetched copy of them is old."""
        for pf in self._prefetches:
            pf.stale[pf.positions(at)[1]] = True

    def drop_prefetch(self) -> None:
        """Forget the rows prefetched (waits for the reads in progress)."""
        while self._prefetches:
            self._prefetches.pop(0).ready()

    def _from_prefetch(self, recs: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        """Records ``recs`` (K,) the prefetch holds (fresh): ((K,) bool which, their rows and state
        by name (K, ...) where taken), or None (none)."""
        taken, out = torch.zeros(recs.numel(), dtype=torch.bool), None
        places = self.rec_at.index_select(0, recs) if self._prefetches else None
        for pf in self._prefetches:  # (oldest first)
            found, at = pf.positions(places)
            want = (~taken).index_select(0, found)
            found, at = found[want], at[want]
            if found.numel() == 0 or not pf.worth_waiting(found.numel()) or not pf.ready():
                continue
            got = unpack(pf.weight.index_select(0, at), self._parts)
            if out is None:
                out = {k: v.new_empty((recs.numel(), *v.shape[1:])) for k, v in got.items()}
            for k, v in got.items():
                out[k].index_copy_(0, found, v)
            taken[found] = True
            self.spill_counters["prefetched"] += found.numel()
        return None if out is None else (taken, out)

    def attach_optimizer(self, optimizer, hparams: dict) -> None:
        """The optimizer's state beside the cached rows, and its files beside the rows' file (every
        row's state starts afresh: rows on disk keep their values, not their old state)."""
        super().attach_optimizer(optimizer, hparams)
        self._applied_clock = self.clock  # (rows looked up so far may go: ``pinned`` keeps those a gradient may name)
        if self._file is None:
            self._parts = self._parts_of()
            return
        self._compact(self._parts_of())  # (the rows on disk rewritten beside their initial state)
        if self._changed is not None:  # (every row's state is new, on disk too: the next delta holds them all)
            self.rec_changed |= self.rec_live

    # --- whole tables: the cache and the records merged ----------------------------------------
    def _rows_of(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids ascending (K,), their cache slots (-1: on disk), their records (-1: cached))."""
        i = self.table_index[self._table(name).name]
        ids, slots = super().table_slots(self.tables[i].name)
        n = self._homes.n
        d = (self.rec_live[:n] & (self._homes.tab[:n] == i)).nonzero().squeeze(1)
        ids = torch.cat([ids, self._homes.key.index_select(0, d)])
        order = torch.argsort(ids)
        none_s, none_r = torch.full((d.numel(),), -1, dtype=torch.int64), torch.full((slots.numel(),), -1)
        return ids[order], torch.cat([slots, none_s])[order], torch.cat([none_r, d])[order]

    def _read(self, slots: torch.Tensor, recs: torch.Tensor, state: Sequence[str]) -> dict[str, Any]:
        """Copies of rows (cached at ``slots`` >= 0, else on disk at ``recs``): weight, recency,
        frequency and ``state`` (a dict)."""
        c, d = (slots >= 0).nonzero().squeeze(1), (recs >= 0).nonzero().squeeze(1)
        cs, dr = slots.index_select(0, c), recs.index_select(0, d)
        disk = self._read_records(dr) if d.numel() else None
        out: dict[str, Any] = {"weight": torch.empty(slots.numel(), self.dim, dtype=self.dtype)}
        out["weight"].index_copy_(0, c, self.weight.detach().index_select(0, cs))
        if disk is not None:
            out["weight"].index_copy_(0, d, disk["weight"])
        for name, mem, rec in (("last_seen", self.last_seen, self.rec_last), ("freq", self.freq, self.rec_freq)):
            out[name] = torch.empty(slots.numel(), dtype=torch.int64)
            out[name].index_copy_(0, c, mem.index_select(0, cs)).index_copy_(0, d, rec.index_select(0, dr))
        st = {k: self.state[k].new_empty((slots.numel(), *self.state[k].shape[1:])) for k in state}
        for k in state:
            st[k].index_copy_(0, c, self.state[k].index_select(0, cs))
            if disk is not None:
                st[k].index_copy_(0, d, disk[k])
        out["state"] = {k: st[k] for k in state}
        return out

    def table_slots(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        raise HybridEmbedError(
            f"table {self._table(name).name!r} is tiered: its rows on disk have no slot; read them with read_ids"
        )

    def rows_by_id(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.read_ids(name)[:2]

    def table_ids(self, name: str) -> torch.Tensor:
        return self._rows_of(name)[0]

    def table_state(self, name: str) -> dict[str, torch.Tensor]:
        _, slots, recs = self._rows_of(name)
        return self._read(slots, recs, list(self.state))["state"]

    def read_ids(self, table: str) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        ids, slots, recs = self._rows_of(table)
        got = self._read(slots, recs, list(self.state))
        return ids, got["weight"], got["state"]

    def save_table(self, name: str, state: Sequence[str] = ()) -> dict[str, Any]:
        out = next(self.save_parts(name, state))
        return out if state else {k: v for k, v in out.items() if k != "state"}

    def save_parts(self, name: str, state: Sequence[str] = (), rows: int | None = None, changes=None):
        """Table ``name`` as checkpoint entries of at most ``rows`` rows each (None: one entry), ids
        ascending, each read through the tiers when it is asked for: a table larger than memory is
        saved with the memory of one part. All its rows (``changes`` None), or those changed since
        the last checkpoint (``changes``: :meth:`track_changes`' (mask, removed); every part has a
        ``removed``, the first the ids dropped since). The first part holds the table-wide counters,
        clock, generator and sketch; every part its rows' optimizer ``state`` (under ``"state"``)."""
        i = self.table_index[name]
        ids, slots, recs = self._rows_of(name)
        wide = self._table_wide(i)
        if changes is not None:
            (changed, removed), c = changes, self.weight.shape[0]
            mem, disk = changed[:c], changed[c:]
            pick = torch.zeros(ids.numel(), dtype=torch.bool)
            cached = slots >= 0
            pick[cached] = mem.index_select(0, slots[cached])
            held = (recs >= 0) & (recs < disk.numel())
            pick[held] = disk.index_select(0, recs[held])
            gone = [r[0][r[1] == i] for r in removed]
            gone = torch.cat(gone).unique() if gone else ids[:0]
            wide["removed"] = gone[~torch.isin(gone, ids)]
            sel = pick.nonzero().squeeze(1)
            ids, slots, recs = ids.index_select(0, sel), slots.index_select(0, sel), recs.index_select(0, sel)
        step = max(1, rows or ids.numel())
        for lo in range(0, max(ids.numel(), 1), step):
            got = self._read(slots[lo : lo + step], recs[lo : lo + step], state)
            part = {"ids": ids[lo : lo + step].clone(), **got}  # (its own: a view would save all the ids)
            yield part | (wide if lo == 0 else {"removed": torch.zeros(0, dtype=torch.int64)} if changes else {})

    def track_changes(self) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """As :meth:`RowStorage.track_changes`; the mask counts the cache's slots, then the records."""
        old, removed = super().track_changes()
        recs = self.rec_changed[: self._homes.n].clone()
        self.rec_changed.zero_()
        return (None if old is None else torch.cat([old, recs])), removed

    def restore_changes(self, changed: torch.Tensor | None, removed: list[torch.Tensor]) -> None:
        slots = self.weight.shape[0]
        super().restore_changes(None if changed is None else changed[:slots], removed)
        if changed is not None and self._changed is not None:
            recs = changed[slots:]
            self.rec_changed[: recs.numel()] |= recs
        elif self._changed is not None:
            self.rec_changed.fill_(True)

    def save_changes(self, name, changed, removed) -> tuple[dict[str, Any], torch.Tensor]:
        """As :meth:`HashStorage.save_changes` (``changed``: :meth:`track_changes`' mask), the rows'
        optimizer state in the entry's ``"state"``; -> (entry, the changed rows' ids)."""
        out = next(self.save_parts(name, list(self.state), None, (changed, removed)))
        return out, out["ids"]

    @torch.no_grad()
    def load_table_state(self, name: str, ids: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Writes ``state`` of rows ``ids`` (K,), which the table must hold (cached or on disk)."""
        i = self.table_index[name]
        ids = ids.to(torch.int64)
        tabs = torch.full_like(ids, i, dtype=torch.int32)
        slots = self._find(ids, tabs)
        recs = self._homes.lookup(ids, tabs)
        disk = slots < 0
        held = recs >= 0
        live = torch.zeros_like(held)
        live[held] = self.rec_live.index_select(0, recs[held])
        if bool((disk & ~live).any()):
            raise HybridEmbedError(
                f"table {name!r}: optimizer state for ids the table does not hold; load the model first"
            )
        c = (~disk).nonzero().squeeze(1)
        for k, v in state.items():
            self.state[k].index_copy_(0, slots.index_select(0, c), v.index_select(0, c).to(self.state[k]))
        self._mark(slots.index_select(0, c))
        d = disk.nonzero().squeeze(1)
        if d.numel():
            dr = recs.index_select(0, d)
            at = self.rec_at.index_select(0, dr)  # (in place: the row stays where it is)
            cur = self._read_records(dr)
            cur |= {k: v.index_select(0, d).to(cur[k].dtype).view_as(cur[k]) for k, v in state.items() if k in cur}
            self._written(at)
            self._file.write(at, pack(cur, self._parts))
            self.rec_changed[dr] = True

    @torch.no_grad()
    def write_ids(
        self, table: str, ids: torch.Tensor, rows: torch.Tensor, state: dict[str, torch.Tensor] | None = None
    ) -> None:
        """As :meth:`HashStorage.write_ids`: rows cached are written there, others to their records
        (ids the table does not hold get records: initial state where none is given)."""
        i = self.table_index[self._table(table).name]
        ids, data = self._check_ids_data(table, ids, rows, state)
        tabs = torch.full_like(ids, i, dtype=torch.int32)
        slots = self._find(ids, tabs)
        c, d = (slots >= 0).nonzero().squeeze(1), (slots < 0).nonzero().squeeze(1)
        if d.numel():  # (first: a full disk refuses the call before anything is written)
            self._write_records(
                ids.index_select(0, d), tabs.index_select(0, d), {k: v.index_select(0, d) for k, v in data.items()}
            )
        cs = slots.index_select(0, c)
        for name, v in data.items():
            dst = self.weight.detach() if name == "weight" else self.state[name]
            dst.index_copy_(0, cs, v.index_select(0, c).to(dst))
        self._mark(cs)

    def _write_records(self, keys, tabs, data: dict[str, torch.Tensor], last=None, freq=None) -> None:
        """Rows (and the state given) of (table, id) pairs not cached written to disk: a row on disk
        in place (its state and counters kept unless given), others appended as new rows (initial
        state, recency now, frequency 0, unless given)."""
        recs = self._home(keys, tabs)  # (which waits for a prefetch's search of the records)
        k = recs.numel()
        had = self.rec_live.index_select(0, recs)
        fresh = (~had).nonzero().squeeze(1)
        self._room(self._tail + fresh.numel())  # (before any write: a full disk changes nothing)
        at = self.rec_at.index_select(0, recs)
        cur = self._initial(k)
        kept = had.nonzero().squeeze(1)
        if kept.numel() and any(n not in data for n in cur):  # (their state on disk, kept)
            for n, v in self._read_records(recs.index_select(0, kept)).items():
                if n in cur:
                    cur[n].index_copy_(0, kept, v)
        cur |= {n: v.to(dt).reshape(k, *shape) for n, dt, shape, _, _ in self._parts if (v := data.get(n)) is not None}
        if fresh.numel():
            self._placed += int((at.index_select(0, fresh) < 0).sum())  # (others leave a place for a new one)
            at[fresh] = self._append(fresh.numel())
            self.rec_at[recs.index_select(0, fresh)] = at.index_select(0, fresh)
            self.rec_last[recs.index_select(0, fresh)] = self.clock
            self.rec_freq[recs.index_select(0, fresh)] = 0
        self._written(at)
        self._file.write(at, pack(cur, self._parts))
        if last is not None:
            self.rec_last[recs], self.rec_freq[recs] = last, freq
        self._set_live(recs, True)
        self.rec_changed[recs] = True

    def load_tables(self, entries: dict[str, dict[str, torch.Tensor]]) -> None:
        """Replace the rows of several tables: their cached rows dropped, their records emptied, the
        entries' rows written to records (read into the cache when looked up)."""
        self._drop_tables(list(entries), {self.table_index[n]: e["ids"].to(torch.int64) for n, e in entries.items()})
        for name, entry in entries.items():
            i = self.table_index[name]
            self._write_rows(i, {k: entry[k] for k in ("ids", "weight", "last_seen", "freq")})
            self._load_table_wide(i, entry)
        self._applied_clock = self.clock

    def load_parts(self, name: str, entry: dict[str, Any], parts) -> None:
        """Replace table ``name``'s rows with those of ``parts`` (an iterable of checked entries: ids,
        weight, last_seen, freq, optimizer ``state``), written to records a part at a time (a table
        larger than memory loads with the memory of one part). ``entry``: every id the parts hold
        (``ids``, distinct) and the table-wide counters and clock (generator and sketch where saved)."""
        i = self.table_index[name]
        self._drop_tables([name], {i: entry["ids"]})
        for part in parts:
            self._write_rows(i, part)
        self._load_table_wide(i, entry)
        self._applied_clock = self.clock

    def _write_rows(self, i: int, part: dict[str, Any]) -> None:
        """Rows of table index ``i`` (ids, weight, last_seen, freq and, where given, optimizer
        ``state``) written to their records (the table emptied before: see :meth:`_drop_tables`)."""
        ids = part["ids"].to(torch.int64)
        tabs = torch.full_like(ids, i, dtype=torch.int32)
        data = {"weight": part["weight"], **part.get("state", {})}
        self._write_records(ids, tabs, data, part["last_seen"].to(torch.int64), part["freq"].to(torch.int64))

    def _drop_tables(self, names: list[str], ids: dict[int, torch.Tensor]) -> None:
        """Tables ``names`` emptied (their cached rows dropped, their records dead) after the files
        were grown for the rows ``ids`` ({table index: ids}) about to be written (a full disk:
        nothing changed), and the records index for those of them without a record yet."""
        self.drop_prefetch()  # (records are rewritten)
        self._room(self._tail + sum(int(v.numel()) for v in ids.values()))
        new = sum(  # (a million ids at a time: the lookup's probes take several times the ids)
            int((self._homes.lookup(c, torch.full_like(c, i, dtype=torch.int32)) < 0).sum())
            for i, v in ids.items()
            for c in v.split(1 << 20)
        )
        self._records(self._homes.n + new)
        self._homes.reserve(self._homes.n + new)
        which = torch.tensor([self.table_index[n] for n in names], dtype=torch.int32)
        old = torch.isin(self.slot_table, which.to(self.slot_table.device)).nonzero().squeeze(1)
        self._evict(old, count=False)  # (a reload is not an eviction)
        n = self._homes.n
        theirs = torch.isin(self._homes.tab[:n], which)
        mine = (theirs & self.rec_live[:n]).nonzero().squeeze(1)
        if self._changed is not None and mine.numel():  # (their rows on disk dropped too: an incremental save says so)
            self._removed.append(torch.stack([self._homes.key[mine], self._homes.tab[mine].long()]))
        self._set_live(mine, False)
        placed = (theirs & (self.rec_at[:n] >= 0)).nonzero().squeeze(1)  # (their places dead: none is kept)
        self.rec_at[placed] = -1
        self._placed -= placed.numel()

    # --- accounting ---------------------------------------------------------------------------
    def _set_live(self, recs: torch.Tensor, value: bool) -> None:
        """Records ``recs`` (distinct) hold their row now (``value``) or not, counted."""
        was = int(self.rec_live.index_select(0, recs).sum())
        self.rec_live[recs] = value
        self._live += recs.numel() - was if value else -was

    def _disk_rows(self, i: int | None = None) -> int:
        if i is None:
            return self._live
        n = self._homes.n
        return int((self.rec_live[:n] & (self._homes.tab[:n] == i)).sum())

    def table_stats(self, name: str) -> dict[str, float]:
        s = super().table_stats(name)
        s["size"] += self._disk_rows(self.table_index[name])
        return s

    def stats(self, table: str | None = None) -> dict[str, Any]:
        """As :meth:`HashStorage.stats` (``rows``: cached and on disk), with ``disk_rows``,
        ``cache_rows``, ``disk_bytes``, and rows ``spilled`` / ``read_back`` / ``prefetched`` so far (and
        prefetches that failed: ``prefetch_failed``)."""
        s = super().stats(table)  # (of a table: its size counts its records already, see table_stats)
        disk = self._disk_rows(None if table is None else self.table_index[self._table(table).name])
        if table is None:
            s["rows"] = s["size"] = s["rows"] + disk
        s["disk_rows"], s["cache_rows"] = disk, self.weight.shape[0] - 1
        s["disk_bytes"] = os.path.getsize(self._file.path) if self._file is not None else 0
        s["memory_bytes"], s["index_bytes"] = self.memory_bytes, self._index_bytes(memory=False)
        return s | dict(self.spill_counters)

    @property
    def memory_bytes(self) -> int:
        """The cache's bytes (rows, state, index); the records' arrays and index are files mapped
        into memory (``stats()["index_bytes"]``), in memory only for a table without a directory."""
        pos = 0 if self.slot_pos is None else self.slot_pos.numel() * 8
        return (
            super().memory_bytes
            + self.slot_rec.numel() * 8
            + pos
            + self.pinned.numel()
            + self._index_bytes(memory=True)
        )

    def _index_bytes(self, memory: bool) -> int:
        """Bytes of the per-record arrays and index held in memory (``memory``: with the records made
        since the index was last written) or in mapped files."""
        h = self._homes
        arrays = (self.rec_last, self.rec_freq, self.rec_live, self.rec_changed, self.rec_at, h.key, h.tab, h._hrow)
        recent = h.recent_bytes if memory else 0
        return recent + (0 if (h.where is None) != memory else sum(t.nbytes for t in (*arrays, h._claim)))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, on disk: {self._disk_rows()} rows, path={str(self.tier.path)!r}"
