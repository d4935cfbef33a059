"""``HashStorage``: dynamic tables keyed by any int64 id, rows made on first sight.

Shape legend: ``N`` ids in a batch, ``U`` distinct (table, id) pairs, ``C`` row slots,
``H`` hash-index positions (a power of two >= 2C), ``D`` dim.

Slot 0 of ``weight`` (C+1, D) is the default vector, read by ids without a row and never
updated. The index is collisionless open addressing over (table, id) pairs (linear probing).
In torch ops (any device) each probing round is a few vectorised ops over the ids still
unresolved, and concurrent inserts into one empty position are settled by
``scatter_reduce(amax)``. On the CPU with Numba (``kernels="auto"``) a loop probes each pair to
its end (:mod:`hybridembed.kernels.cpu_hash`); with ``kernels="triton"`` a find or an insert is
one launch that claims by compare-and-swap: where a pair sits may differ, which pairs the index
holds (every answer, every slot) not. Eviction frees many rows at once and rebuilds the index
from the live rows. Memory beyond the rows
and optimizer state: about 68 bytes per row slot (index at load <= 0.5: 2 x 20 bytes; key,
table, recency, frequency: 28 bytes) plus the admission sketch when ``min_count > 1``. A new row's initial
value is the table's row-keyed initializer at (seed, table, id), so a dynamic table fed
ids from ``[0, n)`` starts (and trains) exactly like a dense table of ``n`` rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .. import init as _init
from ..config import TableConfig
from ..errors import HybridEmbedError
from ..kernels import cpu_hash
from ..kernels.backend import uses_triton
from ..utils import advise_huge_pages, device_tensor, get_logger, kept_tensor
from .base import RowStorage, add_sparse
from .pairs import sort_pairs
from .protocol import LookupPlan, _nothing
from .slot_index import SlotIndex, lowest

__all__ = ["HashStorage", "LookupPlan", "sort_pairs"]

log = get_logger(__name__)

_EMPTY = -1
_HIGH, _LOW = -(1 << 32), (1 << 32) - 1  # the table and slot words of an index row
_PROBES = 4  # index positions read per probing round (a window of linear probing)
_FIND_WINDOW = 16  # positions a lookup reads per round after the first
_STATS = ("inserted", "evicted", "rejected", "hits", "lookups")


_MARK = "_hybridembed_distinct_rows"  # on a sparse gradient whose row ids are distinct: its nnz


LRFU_DOUBLING = 8  # eviction="lrfu": lookups of recency a doubling of a row's count is worth


def eviction_score(policy: str, last_seen: torch.Tensor, freq: torch.Tensor, clock: int) -> torch.Tensor:
    """Rows' int64 scores under ``policy`` (the lowest go first): ``lfu`` by count, then recency;
    ``lrfu`` recency plus :data:`LRFU_DOUBLING` lookups a doubling of the count; else recency."""
    if policy == "lfu":
        return freq * (clock + 2) + last_seen
    if policy == "lrfu":
        return last_seen + (LRFU_DOUBLING * torch.log2(1 + freq.to(torch.float64))).to(torch.int64)
    return last_seen


def _marked(grad: torch.Tensor, distinct: bool) -> torch.Tensor:
    """Marks ``grad`` as holding distinct rows (the optimizer then skips the reduction). The
    mark is the row count at marking, so an in-place change that adds rows voids it."""
    if distinct:
        setattr(grad, _MARK, grad._nnz())
    return grad


def _is_marked(grad: torch.Tensor) -> bool:
    return getattr(grad, _MARK, None) == grad._nnz()


class HashStorage(RowStorage):
    """Rows of a group of dynamic tables (same dim, dtype, optimizer and :class:`Dynamic`)."""

    kind = "dynamic"
    keyed = True

    def __init__(self, tables: Sequence[TableConfig], seed: int = 0, device: torch.device | str | None = None):
        super().__init__()
        self.tables = list(tables)
        self.config = self.tables[0].dynamic
        self.dim = self.tables[0].embedding_dim
        self.dtype = self.tables[0].dtype
        self.compute_dtype = self.tables[0].compute_dtype
        self.seed = int(seed)
        self.table_index = {t.name: i for i, t in enumerate(self.tables)}
        self.row_offset = {t.name: 0 for t in self.tables}  # ids are keys: not shifted
        inits: dict = {}
        for i, t in enumerate(self.tables):
            inits.setdefault((t.init, t.col_start), []).append(i)
        self._inits = list(inits.items())  # ((initializer, first column), its tables' indices)
        keys = [_init.table_key(self.seed, t.init_name) for t in self.tables]
        self.register_buffer("_table_keys", torch.tensor(keys, device=device), persistent=False)
        self.capacity = self.config.capacity  # per table; the group holds capacity x tables slots
        slots = self._initial_slots()
        weight = torch.empty(slots + 1, self.dim, dtype=self.dtype, device=device)
        advise_huge_pages(weight)
        weight[0] = self.config.default_value
        self.weight = nn.Parameter(weight)
        dev = weight.device
        self.register_buffer("slot_key", torch.zeros(slots + 1, dtype=torch.int64, device=dev), persistent=False)
        self.register_buffer(
            "slot_table", torch.full((slots + 1,), _EMPTY, dtype=torch.int32, device=dev), persistent=False
        )
        self.register_buffer("last_seen", torch.zeros(slots + 1, dtype=torch.int64, device=dev), persistent=False)
        self.register_buffer("freq", torch.zeros(slots + 1, dtype=torch.int64, device=dev), persistent=False)
        self.slot_table[0] = -2  # the default row is never free, never evicted
        self.register_buffer("free", torch.arange(slots, 0, -1, device=dev), persistent=False)  # a stack
        keep = self.config.min_count > 1  # (a sketch of the ids seen, for admission; else an empty one)
        shape = (len(self.tables), self.config.sketch_depth, self.config.sketch_width) if keep else (0,)
        sketch = torch.zeros(shape, dtype=torch.int32 if keep else torch.float32, device=dev)
        self.register_buffer("sketch", sketch, persistent=False)
        self.register_buffer(  # (tables, counters): the table_stats counters, _STATS
            "counters", torch.zeros(len(self.tables), len(_STATS), dtype=torch.int64, device=dev), persistent=False
        )
        self.register_buffer("size", torch.zeros(len(self.tables), dtype=torch.int64, device=dev), persistent=False)
        self.clock = 0  # training lookups so far: the time of LRU and TTL
        self._applied_clock = 0  # the clock at the last optimizer step
        if dev.type == "meta":  # (a table described for he.distribute: no index, no draws)
            self._gen, self._mask = None, 0
            self._hrow = self._claim = self._probe_offsets = self._find_offsets = torch.empty(0, device=dev)
            return
        self._gen = torch.Generator(device=dev).manual_seed(self.seed)  # admission draws
        self._build_index(slots)

    def _initial_slots(self) -> int:
        """Row slots made at construction (a capped group: all of them; else ``initial_rows``)."""
        return self.capacity * len(self.tables) if self.capacity is not None else self.config.initial_rows

    # --- the hash index ------------------------------------------------------------------
    def _hash(self, keys: torch.Tensor, tabs: torch.Tensor, salt: int = 0) -> torch.Tensor:
        h = _init.mix64(keys ^ (tabs.to(torch.int64) * _init._GOLDEN + salt))
        return h & ((1 << 62) - 1)  # non-negative

    def _per_table(self, tabs: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """(tables,) int64: how many of ``tabs`` (M,) name each table (or the sum of their int64
        ``weights`` (M,)). Not ``bincount``: on CUDA that reads the largest index back to the host."""
        out = torch.zeros(len(self.tables), dtype=torch.int64, device=tabs.device)
        w = torch.ones(tabs.shape, dtype=torch.int64, device=tabs.device) if weights is None else weights
        return out.index_add_(0, tabs.long(), w)

    def _build_index(self, slots: int) -> None:
        h = 1 << max(4, math.ceil(math.log2(2 * (slots + 1))))
        dev = self.weight.device
        self._mask = h - 1
        # one (key, table << 32 | slot) row per position: a probe reads one 16-byte row, not
        # three arrays (measured 1.5x faster on 560k keys); an empty position holds -1
        self._hrow = torch.full((h, 2), _EMPTY, dtype=torch.int64, device=dev)
        self._claim = torch.empty(0, dtype=torch.int32, device=dev)  # (made by the torch ops' first insert)
        self._probe_offsets = torch.arange(_PROBES, device=dev)
        self._find_offsets = torch.arange(_FIND_WINDOW, device=dev)
        live = (self.slot_table >= 0).nonzero().squeeze(1)
        if live.numel():
            self._insert(self.slot_key[live], self.slot_table[live], live)

    def _window(self, pos: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """(A,) probe starts -> (A, W) the next W = len(offsets) positions (linear probing, wrapping)."""
        return (pos.unsqueeze(1) + offsets) & self._mask

    def _find(self, keys: torch.Tensor, tabs: torch.Tensor, where: bool = False) -> torch.Tensor:
        """(U,) slots of (table, id) pairs (``where``: their index positions); -1 where absent.

        The torch ops: the first round reads each pair's home position (most are decided there);
        the few left read the next ``_FIND_WINDOW`` positions a round, where a pair's first
        position that holds it (found) or is empty (absent; a tiered table's tombstones never
        match and never end a probe) decides: about 2 rounds of ~15 small ops. Triton
        (:func:`hybridembed.kernels.triton_hash.find`): one launch, no host sync."""
        if uses_triton(self.kernels, self.weight) and not where:
            from ..kernels import triton_hash

            return triton_hash.find(self._hrow, self._mask, keys, tabs)  # (the hash in the kernel)
        if cpu_hash.runs_on(self.kernels, self.weight):
            return cpu_hash.find(self._hrow, self._mask, keys, tabs, self._hash(keys, tabs) & self._mask, where)
        tw = tabs.to(torch.int64) << 32  # the table as stored in a row's second word
        pos = self._hash(keys, tabs) & self._mask
        row = self._hrow.index_select(0, pos)  # (U, 2): each home position read once
        word = row[:, 1]
        hit = (row[:, 0] == keys) & ((word & _HIGH) == tw)
        out = torch.where(hit, pos if where else word & _LOW, -1)
        active = (~hit & (word >= 0)).nonzero().squeeze(1)  # home held by another pair: probe on
        pos = pos.index_select(0, active) + 1
        while active.numel():
            k, t = keys.index_select(0, active).unsqueeze(1), tw.index_select(0, active).unsqueeze(1)
            win = self._window(pos, self._find_offsets)  # (A, W)
            row = self._hrow.index_select(0, win.view(-1)).view(-1, _FIND_WINDOW, 2)
            word = row[..., 1]
            hit = (row[..., 0] == k) & ((word & _HIGH) == t)  # (A, W)
            stop = hit | (word < 0)
            first = stop.to(torch.uint8).argmax(1, keepdim=True)  # (A, 1): the deciding position
            at = win.gather(1, first) if where else word.gather(1, first) & _LOW
            found = torch.where(hit.gather(1, first), at, -1).squeeze(1)
            out.index_copy_(0, active, found)
            more = (~stop.any(1)).nonzero().squeeze(1)
            active, pos = active.index_select(0, more), pos.index_select(0, more) + _FIND_WINDOW
        return out

    def _insert(
        self, keys: torch.Tensor, tabs: torch.Tensor, slots: torch.Tensor, at: torch.Tensor | None = None
    ) -> None:
        """Add absent, distinct (table, id) pairs pointing at ``slots``: each at the first empty
        position of its probe sequence (the torch ops: W positions a round; pairs that chose the
        same position go to the one with the highest index, the others probe on). Numba: in order;
        Triton: by compare-and-swap. The layout may differ, what :meth:`_find` answers not.
        ``at`` (U,) int64: each pair's position written there (not by Triton: the torch ops then)."""
        if uses_triton(self.kernels, self.weight) and at is None:
            from ..kernels import triton_hash

            triton_hash.insert(self._hrow, self._mask, keys, tabs, slots)
            return
        if cpu_hash.runs_on(self.kernels, self.weight):
            return cpu_hash.insert(self._hrow, self._mask, keys, tabs, slots, self._hash(keys, tabs) & self._mask, at)
        if self._claim.numel() != self._mask + 1:  # (the Numba and Triton inserts need no claims: 4 bytes a position)
            self._claim = torch.full((self._mask + 1,), -1, dtype=torch.int32, device=self._hrow.device)
        pending = torch.arange(keys.numel(), device=keys.device, dtype=torch.int32)
        pos = self._hash(keys, tabs) & self._mask
        word = (tabs.to(torch.int64) << 32) | slots.to(torch.int64)
        while pending.numel():
            win = self._window(pos, self._probe_offsets)  # (P, W)
            empty = self._hrow[:, 1].index_select(0, win.view(-1)).view(-1, _PROBES) < 0
            has = empty.any(1)  # (P,)
            first = empty.to(torch.uint8).argmax(1, keepdim=True)
            target = win.gather(1, first).squeeze(1)  # (P,) the first empty position (if any)
            cand_i = has.nonzero().squeeze(1)
            cand, cpos = pending.index_select(0, cand_i), target.index_select(0, cand_i)
            self._claim.scatter_reduce_(0, cpos, cand, "amax")  # one winner per empty position
            won = self._claim.index_select(0, cpos) == cand
            self._claim.index_fill_(0, cpos, -1)
            w_i = won.nonzero().squeeze(1)
            wpos, widx = cpos.index_select(0, w_i), cand.index_select(0, w_i).long()
            self._hrow.index_copy_(0, wpos, torch.stack([keys.index_select(0, widx), word.index_select(0, widx)], 1))
            if at is not None:
                at.index_copy_(0, widx, wpos)
            # losers probe on from the position they lost; pairs without an empty one, past their window
            nxt = torch.where(has, target + 1, pos + _PROBES) & self._mask
            left = torch.ones_like(has)
            left.index_fill_(0, cand_i.index_select(0, w_i), False)
            keep = left.nonzero().squeeze(1)
            pending, pos = pending.index_select(0, keep), nxt.index_select(0, keep)

    # --- rows: make, evict, grow ---------------------------------------------------------
    def _init_rows(self, slots: torch.Tensor, keys: torch.Tensor, tabs: torch.Tensor, fill: bool = True) -> None:
        """New rows ``slots`` for (id, table) pairs: initial values (``fill``; a load writes its
        own), fresh counters and optimizer state."""
        with torch.no_grad():
            # tables of one initializer in one pass: each row keyed by its table (bit-identical to per table)
            for (spec, col_start), members in self._inits if fill else ():
                if len(members) == len(self.tables):
                    sel, k = None, self._table_keys.index_select(0, tabs.long())
                else:
                    sel = torch.isin(tabs, torch.tensor(members, dtype=tabs.dtype, device=tabs.device))
                    sel = sel.nonzero().squeeze(1)
                    k = self._table_keys.index_select(0, tabs.index_select(0, sel).long())
                rows = keys if sel is None else keys.index_select(0, sel)
                if rows.numel():
                    new = _init.generate_keyed(spec, k, rows, self.dim, dtype=self.dtype, col_start=col_start)
                    self.weight.index_copy_(0, slots if sel is None else slots.index_select(0, sel), new)
        self.slot_key[slots], self.slot_table[slots] = keys, tabs.to(torch.int32)
        self.last_seen[slots], self.freq[slots] = self.clock, 0
        self._mark(slots)
        self.size += self._per_table(tabs)
        self.reset_state_rows(slots)

    def _evict(self, victims: torch.Tensor, count: bool = True) -> None:
        """Free ``victims`` (slots) in one batch, then drop them from the index (:meth:`_unindex`)."""
        if victims.numel() == 0:
            return
        keys, tabs = self.slot_key[victims], self.slot_table[victims]
        per_table = self._per_table(tabs)
        if self._changed is not None:  # (id, table) of each row dropped, for an incremental checkpoint
            self._removed.append(torch.stack([keys, tabs.long()]))
        if count:
            self.counters[:, 1] += per_table
        self.size -= per_table
        self.slot_table[victims] = _EMPTY
        self.free = torch.cat([self.free, victims.flip(0)])
        self.materialize_grad()  # (kept lookup gradients name slots: filtered below like any other)
        g = self.weight.grad
        if g is not None:  # a pending gradient must not land on the id that reuses the slot
            keep = ~torch.isin(g._indices()[0], victims)
            self._replace_grad(
                g, torch.sparse_coo_tensor(g._indices()[:, keep], g._values()[keep], g.shape, check_invariants=False)
            )
        self._unindex(keys, tabs, victims)

    def _unindex(self, keys: torch.Tensor, tabs: torch.Tensor, slots: torch.Tensor) -> None:
        self._build_index(self.weight.shape[0] - 1)  # (the pairs whose slots were freed: rebuilt without them)

    def _protected(self, batch_slots: torch.Tensor) -> torch.Tensor:
        """(C+1,) bool: rows that may not be evicted now — this batch's, and every row touched
        since the last optimizer step (their gradients may still be pending)."""
        since = self._applied_clock if self.optimizer is not None else self.clock
        protect = self.last_seen > since
        protect[batch_slots] = True
        return protect

    def _plan_evictions(self, new_tabs: torch.Tensor, batch_slots: torch.Tensor) -> torch.Tensor:
        """Slots to free so every table stays within its capacity; raises before any change."""
        if self.capacity is None or new_tabs.numel() == 0:
            return torch.zeros(0, dtype=torch.int64, device=self.weight.device)
        cap = self.capacity
        needed = self._per_table(new_tabs)
        over = (self.size + needed - cap).tolist()
        victims = []
        protect = None
        for i, excess in enumerate(over):
            if excess <= 0:
                continue
            if protect is None:
                protect = self._protected(batch_slots)
            cand = ((self.slot_table == i) & ~protect).nonzero().squeeze(1)
            if cand.numel() < excess:
                raise HybridEmbedError(
                    f"dynamic table {self.tables[i].name!r}: this batch needs {int(needed[i])} new rows; "
                    f"{int(self.size[i])} of its {cap} rows are in use and only {cand.numel()} can be evicted "
                    "(rows touched since the last optimizer step stay). Raise Dynamic(capacity=...) or step "
                    "the optimizer more often."
                )
            k = min(max(excess, math.ceil(self.config.evict_fraction * cap)), cand.numel())
            score = eviction_score(self.config.eviction or "lru", self.last_seen[cand], self.freq[cand], self.clock)
            # ties broken by id, so the victims do not depend on where rows happen to sit
            victims.append(cand.index_select(0, lowest(score, self.slot_key.index_select(0, cand), k)))
        return torch.cat(victims) if victims else torch.zeros(0, dtype=torch.int64, device=self.weight.device)

    def _grow(self, needed: int) -> None:
        """Double the row slots (unbounded tables). The Parameter object stays the same, so
        graphs and optimizers that hold it keep working; pending gradients are resized."""
        old = self.weight.shape[0] - 1
        new = old
        while new - old + self.free.numel() < needed:
            new *= 2
        dev, extra = self.weight.device, new - old
        weight = torch.empty(new + 1, self.dim, dtype=self.dtype, device=dev)
        advise_huge_pages(weight)
        weight[: old + 1] = self.weight.detach()
        grad = self.weight.grad
        self.weight.grad = None
        self.weight.data = weight
        if grad is not None:
            self._replace_grad(
                grad, torch.sparse_coo_tensor(grad._indices(), grad._values(), weight.shape, check_invariants=False)
            )
        for name in ("slot_key", "last_seen", "freq"):
            setattr(self, name, torch.cat([getattr(self, name), torch.zeros(extra, dtype=torch.int64, device=dev)]))
        self.slot_table = torch.cat([self.slot_table, torch.full((extra,), _EMPTY, dtype=torch.int32, device=dev)])
        if self.optimizer is not None:
            for name, (per_element, fill) in self.optimizer.state_spec(self.hparams).items():
                self.state[name] = torch.cat([self.state[name], self._new_state(extra, per_element, fill)])
        self.free = torch.cat([torch.arange(new, old, -1, device=dev), self.free])
        if self._changed is not None:
            self._changed = torch.cat([self._changed, torch.zeros(extra, dtype=torch.bool, device=dev)])
        self._build_index(new)

    def _allocate(self, n: int) -> torch.Tensor:
        if n == 0:  # (free[-0:] would be the whole stack)
            return self.free[:0]
        if self.free.numel() < n:
            self._grow(n)  # capped tables have freed room in _plan_evictions
        slots = self.free[-n:].flip(0)
        self.free = self.free[:-n]
        return slots

    def _admit(self, keys: torch.Tensor, tabs: torch.Tensor, counts: torch.Tensor):
        """-> (admitted (M,) bool, commit): the sketch is only updated by ``commit()``."""
        cfg, n = self.config, keys.numel()
        admitted = torch.ones(n, dtype=torch.bool, device=keys.device)
        cells = []
        if cfg.min_count > 1:  # count-min sketch: this batch's sightings added to the estimate
            est = torch.full((n,), torch.iinfo(torch.int32).max, dtype=torch.int32, device=keys.device)
            t = tabs.long()
            for d in range(cfg.sketch_depth):
                col = self._hash(keys, tabs, salt=d + 1) % cfg.sketch_width
                cells.append((d, col))
                est = torch.minimum(est, self.sketch[t, d, col] + counts.to(torch.int32))
            admitted &= est >= cfg.min_count
        gen_state = self._gen.get_state()
        if cfg.admit_probability < 1.0:
            draw = torch.rand(n, generator=self._gen, device=keys.device)
            admitted &= draw < cfg.admit_probability

        def commit() -> None:
            t = tabs.long()
            for d, col in cells:
                self.sketch[:, d].index_put_((t, col), counts.to(torch.int32), accumulate=True)

        def rollback() -> None:
            self._gen.set_state(gen_state)

        return admitted, commit, rollback

    # --- the lookup ------------------------------------------------------------------------
    def slots(self, ids: torch.Tensor, tabs: torch.Tensor, train: bool) -> torch.Tensor:
        """(N,) ids of tables ``tabs`` (N,) -> (N,) int32 row slots; 0 (the default row) for ids without one.

        In training, unknown ids are admitted (rows made, evicting if full) and recency and
        frequency are recorded; in eval nothing changes. A batch that cannot fit raises
        :class:`HybridEmbedError` before anything changes."""
        return self.lookup(ids, tabs, train)[0]

    def lookup(self, ids: torch.Tensor, tabs: torch.Tensor, train: bool) -> tuple[torch.Tensor, tuple | None]:
        """:meth:`slots`, and the batch's grouping for the gradient (None in eval):
        ``(perm (N,), segment lengths (K,), slot per segment (K,), kept segments or None)``.

        Each segment is one distinct (table, id) pair, so the slots of the kept segments are
        distinct: the lookup's backward sums each row's gradient over its segment instead of
        sorting the N slots again. Pairs without a row (not admitted) are dropped there."""
        return self.plan_lookup(ids, tabs, train).commit()

    def resolve(self, ids: torch.Tensor, tables: Sequence[int], counts: Sequence[int], train: bool) -> LookupPlan:
        """:meth:`plan_lookup` of ``ids`` (N,), the first ``counts[0]`` of table index ``tables[0]``,
        the next ``counts[1]`` of ``tables[1]``, ... (see :meth:`Storage.resolve`)."""
        nt, dev = len(self.tables), ids.device

        def make() -> torch.Tensor:  # (tables + N,) int32: each table's id count, then each id's table
            looked = [0] * nt
            for t, c in zip(tables, counts):
                looked[t] += c
            t, c = device_tensor(tables, dev, torch.int32), device_tensor(counts, dev)
            return torch.cat([device_tensor(looked, dev, torch.int32), t.repeat_interleave(c, output_size=ids.numel())])

        # the same features and counts each step: kept (a training and an evaluation batch at most)
        both = kept_tensor(self, "_tabs_cache", (tuple(tables), tuple(counts)), dev, make, most=2)
        return self.plan_lookup(ids, both[nt:], train, both[:nt])

    def plan_lookup(
        self, ids: torch.Tensor, tabs: torch.Tensor, train: bool, looked: torch.Tensor | None = None
    ) -> LookupPlan:
        """The first half of :meth:`lookup`: finds the ids' rows, draws admission and plans
        evictions, raising :class:`HybridEmbedError` if the batch cannot fit, and changes
        nothing else. ``plan.commit()`` then makes the change and returns what :meth:`lookup`
        does; ``plan.rollback()`` undoes the admission draws instead. Several storages can so
        accept or refuse one batch together. Nothing else may change the storage between.
        ``looked`` (tables,): the ids of each table, when the caller knows them (else counted here)."""
        keys, ktabs, perm, counts = sort_pairs(ids, tabs, len(self.tables))
        found = self._find(keys, ktabs)
        if not train:
            return LookupPlan(lambda: (self._per_id(found.clamp_min(0), perm, counts), None), _nothing)
        with torch.no_grad():
            miss = (found < 0).nonzero().squeeze(1)
            ok = commit_admission = None
            rollback = _nothing
            if miss.numel():
                ok, commit_admission, rollback = self._admit(keys[miss], ktabs[miss], counts[miss])
            new = miss if ok is None else miss[ok]
            try:
                # (slot 0 for the misses: the default row is never evicted; no boolean mask, no sync)
                victims = found[:0] if self.capacity is None else self._plan_evictions(ktabs[new], found.clamp_min(0))
            except HybridEmbedError:
                rollback()
                raise

        def commit() -> tuple[torch.Tensor, tuple]:
            rej = None if ok is None else miss[~ok]
            lk = self._looked(ktabs, counts, looked)
            return self._commit_lookup(keys, ktabs, perm, counts, found, miss, new, rej, victims, commit_admission, lk)

        return LookupPlan(commit, rollback)

    def _looked(self, ktabs: torch.Tensor, counts: torch.Tensor, looked: torch.Tensor | None) -> torch.Tensor:
        """(tables,) ids of each table: ``looked`` as given, or counted from the pairs."""
        return self._per_table(ktabs, counts) if looked is None else looked

    @torch.no_grad()
    def _commit_lookup(self, keys, ktabs, perm, counts, found, miss, new, rej, victims, commit_admission, looked):
        """The second half of :meth:`lookup` (see :meth:`plan_lookup`): the batch is accepted.
        ``looked`` (tables,): the ids of each table."""
        self.clock += 1
        self.counters[:, 3:5] += looked.unsqueeze(1)  # hits (less the misses, below) and lookups
        if miss.numel():
            self.counters[:, 3] -= self._per_table(ktabs[miss], counts[miss])
        if commit_admission is not None:
            commit_admission()
            self.counters[:, 2] += self._per_table(ktabs[rej], counts[rej])
        if victims.numel():
            self.last_seen[found[found >= 0]] = self.clock  # (this batch's rows, for the index rebuild)
        self._evict(victims)
        if new.numel():
            slots = self._allocate(new.numel())
            self._insert(keys[new], ktabs[new], slots)
            self._init_rows(slots, keys[new], ktabs[new])
            found[new] = slots
            self.counters[:, 0] += self._per_table(ktabs[new])
        if new.numel() == miss.numel():  # every id has a row now
            s, c = found, counts
        else:
            seen = (found >= 0).nonzero().squeeze(1)
            s, c = found.index_select(0, seen), counts.index_select(0, seen)
        self.last_seen.index_fill_(0, s, self.clock)
        self.freq.index_add_(0, s, c)
        self._mark(s)
        if self.config.eviction == "ttl":  # unseen for ttl_steps lookups, and no pending gradient
            expired = (self.slot_table >= 0) & (self.clock - self.last_seen >= self.config.ttl_steps)
            expired &= ~self._protected(s)
            self._evict(expired.nonzero().squeeze(1))  # (nothing when none expired: one sync, not two)
        every = new.numel() == miss.numel()  # (then no pair is left without a row: no -1)
        slot = found if every else found.clamp_min(0)  # (U,)
        kept = None if every else (slot > 0).nonzero().squeeze(1)
        return self._per_id(slot, perm, counts), (perm, counts, slot, kept)  # (offsets made where used)

    @staticmethod
    def _per_id(slot: torch.Tensor, perm: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Slot per distinct pair (U,) -> int32 slot per id (N,) in the input's order (slots
        are below 2**31; int32 halves this scatter, and embedding_bag takes int32 ids)."""
        per_run = slot.to(torch.int32).repeat_interleave(counts, output_size=perm.numel())
        return torch.empty_like(per_run).index_copy_(0, perm, per_run)  # (2x faster than out[perm] = ...)

    @property
    def grad_sink(self) -> Callable[..., None]:
        """The lookup hands its gradient to :meth:`accumulate_grad` (the matrix may grow after the forward)."""
        return self.accumulate_grad

    def accumulate_grad(self, grad: torch.Tensor, distinct: bool = False) -> None:
        """Receives the lookup's sparse gradient (sized to the current, possibly grown, matrix);
        ``distinct``: its row ids are distinct (summed per row already), though not sorted."""
        w = self.weight
        grad = self._fit(grad)
        if w.grad is not None:
            grad, distinct = add_sparse(w.grad, grad), False
        w.grad = _marked(grad, distinct)

    def _replace_grad(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """The pending gradient ``old`` becomes ``new`` (filtered or resized), keeping its
        distinct-rows mark."""
        self.weight.grad = _marked(new, _is_marked(old))

    def materialize_grad(self) -> None:
        """As :meth:`RowStorage.materialize_grad`, but ids without a row (slot 0, the default
        row) contribute nothing, as in the eager lookup (which drops their segments): the
        gradient's norm, which clipping reads, and ``weight.grad`` are the eager ones."""
        self._deferred = [
            (ids, grad, offsets, (ids != 0).to(grad.dtype) * (1 if psw is None else psw), one, rows_of)
            for ids, grad, offsets, psw, one, rows_of in self._deferred
        ]
        super().materialize_grad()

    def grad_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        self.materialize_grad()
        g = self.weight.grad
        if g is not None and _is_marked(g):
            return g._indices()[0], g._values()
        return super().grad_rows()

    def after_step(self) -> None:
        self._applied_clock = self.clock  # rows touched before now have no pending gradient

    def updatable(self, ids: torch.Tensor) -> torch.Tensor:
        return ids != 0  # the default row gets no update

    # --- per-table views -------------------------------------------------------------------
    def table_slots(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids ascending (K,), their slots (K,)) of table ``name``'s rows."""
        index = self.__dict__.get("_slot_index") or self.__dict__.setdefault("_slot_index", SlotIndex())
        return index.table(self.slot_table, self.slot_key, self.table_index[name], len(self.tables))

    def table_ids(self, name: str) -> torch.Tensor:
        """Ids ascending (K,) of the rows table ``name`` holds."""
        return self.table_slots(self._table(name).name)[0]

    def table_state(self, name: str) -> dict[str, torch.Tensor]:
        """Copies of table ``name``'s rows of each optimizer state tensor, in :meth:`table_ids` order."""
        _, slots = self.table_slots(name)
        return {k: v.index_select(0, slots) for k, v in self.state.items()}

    def load_table_state(self, name: str, ids: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Writes ``state`` (K,) or (K, D) per name of rows ``ids`` (K,), which the table must hold."""
        slots = self._find(ids.to(self.weight.device), torch.full_like(ids, self.table_index[name], dtype=torch.int32))
        if bool((slots < 0).any()):
            raise HybridEmbedError(
                f"table {name!r}: optimizer state for ids the table does not hold; load the model first"
            )
        for k, v in state.items():
            self.state[k].index_copy_(0, slots, v.to(self.state[k]))
        self._mark(slots)

    def table_stats(self, name: str) -> dict[str, float]:
        i = self.table_index[name]
        s = dict(zip(_STATS, self.counters[i].tolist()))
        s["size"] = int(self.size[i])
        s["capacity"] = self.config.capacity
        s["hit_rate"] = s["hits"] / s["lookups"] if s["lookups"] else 0.0
        return s

    def stats(self, table: str | None = None) -> dict[str, Any]:
        """:meth:`table_stats` with ``rows`` (held) and ``memory_bytes`` (of those rows and their
        optimizer state) of ``table``; or (None) of the whole storage: counters summed,
        ``capacity`` in row slots, ``memory_bytes`` of every slot."""
        if table is not None:
            s = self.table_stats(self._table(table).name)
            return {"rows": s["size"], "memory_bytes": s["size"] * self._row_bytes(), **s}
        s = dict(zip(_STATS, self.counters.sum(0).tolist()))
        s["size"] = s["rows"] = int(self.size.sum())
        s["capacity"] = self.capacity * len(self.tables) if self.capacity is not None else None
        s["hit_rate"] = s["hits"] / s["lookups"] if s["lookups"] else 0.0
        s["memory_bytes"] = self.memory_bytes
        return s

    def read_range(
        self, table: str, row_start: int, row_stop: int, col_start: int = 0, col_stop: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Refused: a dynamic table's rows are addressed by id (see :meth:`read_ids`)."""
        raise HybridEmbedError(
            f"table {self._table(table).name!r} is dynamic: its rows are keyed by id, not numbered; "
            "read them with read_ids(table)"
        )

    def write_range(self, table: str, row_start: int, data: dict[str, torch.Tensor], col_start: int = 0) -> None:
        """Refused: a dynamic table's rows are addressed by id (see :meth:`write_ids`)."""
        raise HybridEmbedError(
            f"table {self._table(table).name!r} is dynamic: its rows are keyed by id, not numbered; "
            "write them with write_ids(table, ids, rows, state)"
        )

    def read_ids(self, table: str) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(ids ascending (K,), rows (K, D), ``{state: (K, D) or (K,)}``) of ``table``, copies."""
        ids, slots = self.table_slots(self._table(table).name)
        return ids, self.read_rows(slots), {k: v.index_select(0, slots) for k, v in self.state.items()}

    @torch.no_grad()
    def write_ids(
        self, table: str, ids: torch.Tensor, rows: torch.Tensor, state: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Sets rows ``ids`` (K,) distinct of ``table`` to ``rows`` (K, D) (and their optimizer state
        to ``state``); ids the table does not hold get rows (initialised, fresh counters; never
        by eviction: they must fit the capacity). Other rows and every counter are left as they
        are. Checked before anything changes."""
        i = self.table_index[self._table(table).name]
        ids, data = self._check_ids_data(table, ids, rows, state)
        tabs = torch.full_like(ids, i, dtype=torch.int32)
        slots = self._find(ids, tabs)
        new = (slots < 0).nonzero().squeeze(1)
        if self.capacity is not None and int(self.size[i]) + new.numel() > self.capacity:
            raise HybridEmbedError(
                f"table {table!r}: {new.numel()} new ids do not fit: {int(self.size[i])} of its {self.capacity} rows "
                "are in use; raise Dynamic(capacity=...)"
            )
        if new.numel():
            made = self._allocate(new.numel())
            self._insert(ids[new], tabs[new], made)
            self._init_rows(made, ids[new], tabs[new])
            slots[new] = made
        for name, v in data.items():
            dst = self.weight.detach() if name == "weight" else self.state[name]
            dst.index_copy_(0, slots, v.to(dst))
        self._mark(slots)

    def save_table(self, name: str, state: Sequence[str] = ()) -> dict[str, Any]:
        """Table ``name`` as a checkpoint entry (see :mod:`hybridembed.storage.serial`): ids, rows,
        counters, clock and, where kept, the admission generator state and sketch; with ``state``
        (optimizer state names), ``"state"``: those of the same rows (one scan of the slots)."""
        i = self.table_index[name]
        ids, slots = self.table_slots(name)
        out = {
            "ids": ids,
            "weight": self.weight.detach().index_select(0, slots),
            "last_seen": self.last_seen[slots],
            "freq": self.freq[slots],
            **self._table_wide(i),
        }
        if state:
            out["state"] = {k: self.state[k].index_select(0, slots) for k in state}
        return out

    def save_changes(
        self, name: str, changed: torch.Tensor, removed: list[torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Table ``name``'s rows marked in ``changed`` (the storage's slot mask of rows changed since
        a checkpoint, see :meth:`track_changes`) as a :meth:`save_table` entry of those rows,
        plus ``removed``: the ids it dropped since (of ``removed``, those it does not hold now).
        -> (entry, their slots)."""
        i = self.table_index[name]
        ids, slots = self.table_slots(name)
        sel = changed.index_select(0, slots).nonzero().squeeze(1)
        s = slots.index_select(0, sel)
        gone = [r[0][r[1] == i] for r in removed]
        gone = torch.cat(gone).unique() if gone else ids[:0]
        out = {
            "ids": ids.index_select(0, sel),
            "weight": self.weight.detach().index_select(0, s),
            "last_seen": self.last_seen.index_select(0, s),
            "freq": self.freq.index_select(0, s),
            "removed": gone[~torch.isin(gone, ids)],
            **self._table_wide(i),
        }
        return out, s

    def _table_wide(self, i: int) -> dict[str, Any]:
        """A checkpoint entry's table-wide part of table index ``i``: its counters, the clock, the
        admission generator's state and (where kept) its sketch."""
        out = {"stats": self.counters[i].clone(), "clock": torch.tensor(self.clock), "generator": self._gen.get_state()}
        if self.sketch.numel():
            out["sketch"] = self.sketch[i].clone()
        return out

    def load_table(self, name: str, entry: dict[str, torch.Tensor]) -> None:
        """Replace table ``name``'s rows with ``entry`` (as from :meth:`save_table`; checked first with
        :func:`hybridembed.storage.serial.check_entry`)."""
        self.load_tables({name: entry})

    def load_tables(self, entries: dict[str, dict[str, torch.Tensor]]) -> None:
        """Replace the rows of several tables (``{name: entry}``) at once: their old rows are freed
        together (one rebuild of the index, not one per table) and the new ones are not
        initialised before they are written."""
        for name, entry in entries.items():  # checked before any change
            n = entry["ids"].numel()
            if self.capacity is not None and n > self.capacity:
                raise HybridEmbedError(f"table {name!r}: {n} rows do not fit the capacity {self.capacity}")
        which = torch.tensor(
            [self.table_index[n] for n in entries], dtype=self.slot_table.dtype, device=self.weight.device
        )
        old = torch.isin(self.slot_table, which).nonzero().squeeze(1)
        self._evict(old, count=False)  # a reload is not an eviction
        for name, entry in entries.items():
            i, ids = self.table_index[name], entry["ids"].to(self.weight.device, torch.int64)
            tabs = torch.full_like(ids, i, dtype=torch.int32)
            slots = self._allocate(ids.numel())
            self._insert(ids, tabs, slots)
            self._init_rows(slots, ids, tabs, fill=False)
            with torch.no_grad():
                self.weight.index_copy_(0, slots, entry["weight"].to(self.weight))
            self.last_seen[slots] = entry["last_seen"].to(self.last_seen)
            self.freq[slots] = entry["freq"].to(self.freq)
            self._load_table_wide(i, entry)
        self._applied_clock = self.clock

    def _load_table_wide(self, i: int, entry: dict) -> None:
        """:meth:`_table_wide`'s part of an entry back into table index ``i``."""
        self.counters[i] = entry["stats"].to(self.counters)
        self.clock = max(self.clock, int(entry["clock"]))
        if "generator" in entry:
            self._load_generator(entry["generator"])
        if "sketch" in entry and self.sketch.numel():
            self.sketch[i] = entry["sketch"].to(self.sketch)

    def _load_generator(self, state: torch.Tensor) -> None:
        """The admission generator's saved state; one saved on another kind of device (CPU, CUDA)
        cannot be carried over: the draws go on from a seed of the table's seed and clock."""
        if state.numel() == self._gen.get_state().numel():
            self._gen.set_state(state.cpu() if self._gen.device.type == "cpu" else state)
            return
        log.info(
            "tables %s: the admission generator was saved on another kind of device; its draws go on from a fresh seed",
            ", ".join(t.name for t in self.tables),
        )
        self._gen.manual_seed(_init.mix64(torch.tensor([self.seed ^ self.clock])).item() & ((1 << 63) - 1))

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        dev = self.weight.device
        for name in ("_hrow", "_claim", "_probe_offsets", "_find_offsets"):
            setattr(self, name, getattr(self, name).to(dev))
        if self._gen is not None and self._gen.device != dev:
            self._gen = torch.Generator(device=dev).manual_seed(self.seed)
        return out

    def extra_repr(self) -> str:
        names = ", ".join(t.name for t in self.tables)
        live = int(self.size.sum()) if self.size.device.type != "meta" else "meta"
        return f"rows={live}/{self.capacity * len(self.tables) if self.capacity else 'unbounded'}, dim={self.dim}, dtype={self.dtype}, tables=[{names}]"
