"""Which row slots of a dynamic group each table holds: one scan of the slots for every table.

A checkpoint reads every table of a group (:meth:`HashStorage.table_slots` per table); scanning
all the group's slots once per table made a save cost tables x slots (26 tables of 100,000
rows: 26 scans of 2.6M slots, 0.2 s a save). :class:`SlotIndex` scans them once, groups the
live slots by table, and sorts a table's by id when it is asked for. It holds while neither
``slot_table`` nor ``slot_key`` changes: the same tensors (not replaced by a grown group or a
move) at the same version (``Tensor._version``, which every in-place write bumps), so nothing
that writes them needs to know of it.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["SlotIndex", "lowest"]


class SlotIndex:
    """The live slots of a group's ``slot_table`` (each slot's table index, < 0: free) grouped
    by table; :meth:`table` -> (ids ascending, their slots) of one table. Holds weak references
    to the tensors it indexed; a copy or an unpickled one starts empty."""

    def __init__(self) -> None:
        # (weak references to slot_table and slot_key, their versions, live slots by table, offsets,
        # {table index: (ids ascending, slots)}): one tuple, replaced whole (a save's thread may read it)
        self._state: tuple | None = None

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._state = None

    def table(self, slot_table: torch.Tensor, slot_key: torch.Tensor, i: int, tables: int) -> tuple:
        """(ids ascending (K,), their slots (K,)) of table index ``i`` of ``tables``: new tensors
        each call (a caller may write them)."""
        st = self._state
        versions = (slot_table._version, slot_key._version)
        if st is None or st[0]() is not slot_table or st[1]() is not slot_key or st[2] != versions:
            live = (slot_table >= 0).nonzero().squeeze(1)
            tabs = slot_table.index_select(0, live)
            by_table = live.index_select(0, torch.argsort(tabs, stable=True))
            counts = torch.zeros(tables, dtype=torch.int64, device=tabs.device)
            counts.index_add_(0, tabs.long(), torch.ones_like(tabs, dtype=torch.int64))
            offsets = [0, *torch.cumsum(counts, 0).tolist()]
            st = self._state = (weakref.ref(slot_table), weakref.ref(slot_key), versions, by_table, offsets, {})
        done = st[5]
        if i not in done:
            slots = st[3][st[4][i] : st[4][i + 1]]
            keys = slot_key.index_select(0, slots)
            order = torch.argsort(keys)
            done[i] = (keys.index_select(0, order), slots.index_select(0, order))
        keys, slots = done[i]
        return keys.clone(), slots.clone()


def lowest(score: torch.Tensor, keys: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``k`` lowest of ``score`` (M,) by (score, key), in that order (``keys``
    (M,) distinct: a total order): what sorting all M by key, then stably by score, puts first,
    found without sorting all M (the k-th score by ``kthvalue``; the rows below it and its ties
    are the ones sorted)."""
    m = score.numel()
    if k <= 0:
        return torch.zeros(0, dtype=torch.int64, device=score.device)
    if k < m:
        kth = torch.kthvalue(score, k).values
        pick = (score <= kth).nonzero().squeeze(1)  # (the k-th score's ties beyond k: cut below)
    else:
        pick = torch.arange(m, device=score.device)
    order = torch.argsort(keys.index_select(0, pick), stable=True)
    order = order.index_select(0, torch.argsort(score.index_select(0, pick).index_select(0, order), stable=True))
    return pick.index_select(0, order[:k])
