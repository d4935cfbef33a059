"""The hot-row cache of a remote storage (asynchronous mode): see :mod:`hybridembed.ps.remote`."""

from __future__ import annotations

from typing import Any

import torch

from ..storage import RowStorage
from ..storage.protocol import LookupPlan
from .client import Pull

__all__ = ["RowCache"]


class RowCache:
    """The hot-row cache of one remote storage (asynchronous mode; see the module docstring).

    Slots ``0..C-1`` of the storage's ``weight`` are the cache; rows a step needs beyond them
    are staged after (pulled, pushed and dropped with the step)."""

    def __init__(self, storage: RowStorage, size: int):
        self.st, self.size = storage, int(size)
        c, d = self.size, storage.dim
        self.key = torch.zeros(c, dtype=torch.int64)
        self.id = torch.zeros(c, dtype=torch.int64)
        self.tab = torch.zeros(c, dtype=torch.int64)
        self.fetched = torch.full((c,), -1, dtype=torch.int64)  # step pulled; -1: free
        self.used = torch.full((c,), -1, dtype=torch.int64)
        self.grad = torch.zeros(c, d, dtype=storage.compute_dtype)
        self.dirty = torch.zeros(c, dtype=torch.bool)
        self.sorted_keys = torch.zeros(0, dtype=torch.int64)
        self.sorted_slots = torch.zeros(0, dtype=torch.int64)
        self.flush: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (ids, tabs, grads) to write back
        self.lookups = 0
        with torch.no_grad():  # (the rows on the model's device; the index and gradients in host memory)
            storage.weight.data = torch.zeros(c, d, dtype=storage.dtype, device=storage.weight.device)
        storage._staged_ids = torch.zeros(c, dtype=torch.int64)
        storage._staged_tabs = torch.zeros(c, dtype=torch.int64)

    def clear(self) -> None:
        self.fetched.fill_(-1)
        self.dirty.fill_(False)
        self.grad.zero_()
        self.flush = []
        self._reindex()

    def _reindex(self, added: torch.Tensor | None = None) -> None:
        """The sorted index after entries left (their slots free or given other keys) and the
        slots ``added`` got new keys: a filter and a merge, no sort of the whole index."""
        ks, ss = self.sorted_keys, self.sorted_slots
        if ss.numel():
            ok = (self.fetched.index_select(0, ss) >= 0) & (self.key.index_select(0, ss) == ks)
            if not bool(ok.all()):
                ks, ss = ks[ok], ss[ok]
        if added is not None and added.numel():
            nk, order = torch.sort(self.key.index_select(0, added))
            ns = added.index_select(0, order)
            m, k = ks.numel(), nk.numel()
            at_new = torch.searchsorted(ks, nk) + torch.arange(k)  # (keys are distinct)
            at_old = torch.arange(m) + torch.searchsorted(nk, ks)
            keys, slots = torch.empty(m + k, dtype=torch.int64), torch.empty(m + k, dtype=torch.int64)
            keys.index_copy_(0, at_old, ks).index_copy_(0, at_new, nk)
            slots.index_copy_(0, at_old, ss).index_copy_(0, at_new, ns)
            ks, ss = keys, slots
        self.sorted_keys, self.sorted_slots = ks, ss

    def _take_out(self, slots: torch.Tensor) -> None:
        """Entries ``slots`` leave the cache; their summed gradients are queued for write-back."""
        d = slots.index_select(0, self.dirty.index_select(0, slots).nonzero().squeeze(1))
        if d.numel():
            self.flush.append((self.id.index_select(0, d), self.tab.index_select(0, d), self.grad.index_select(0, d)))
            self.grad.index_fill_(0, d, 0)
            self.dirty.index_fill_(0, d, False)
        self.fetched.index_fill_(0, slots, -1)

    def resolve(self, keys, inv, uid, utab, seen) -> LookupPlan:
        st, client = self.st, self.st.client
        step = client.step
        u = keys.numel()
        self.lookups += u
        m = self.sorted_keys.numel()
        slot = torch.full((u,), -1, dtype=torch.int64)
        if m:
            pos = torch.searchsorted(self.sorted_keys, keys).clamp_(max=m - 1)
            found = self.sorted_keys.index_select(0, pos) == keys
            slot = torch.where(found, self.sorted_slots.index_select(0, pos), slot)
        held = slot >= 0
        fresh = held.clone()
        fresh[held] = (step - self.fetched.index_select(0, slot[held])) < st.staleness
        st.counters["cache_hits"] += int(fresh.sum())
        expired = slot[held & ~fresh]
        if expired.numel():  # pulled again into the same slot; their gradients written back first
            self._take_out(expired)
        self.used.index_fill_(0, slot[held], step)  # (this lookup's rows are no eviction victims)
        new = (~held).nonzero().squeeze(1)
        added = None
        if new.numel():
            free = (self.fetched < 0) & (self.used < step)
            free[expired] = False  # (refreshed in place)
            free_slots = free.nonzero().squeeze(1)
            if free_slots.numel() < new.numel():  # least recently used out (not those of this step)
                cand = ((self.fetched >= 0) & (self.used < step)).nonzero().squeeze(1)
                need = min(new.numel() - free_slots.numel(), cand.numel())
                if need:  # (the `need` least recently used: a selection, not a sort of all)
                    oldest = torch.topk(self.used.index_select(0, cand), need, largest=False, sorted=False)[1]
                    victims = cand.index_select(0, oldest)
                    self._take_out(victims)
                    free_slots = torch.cat([free_slots, victims])
            got = min(free_slots.numel(), new.numel())
            slot[new[:got]] = free_slots[:got]
            added = free_slots[:got]
        miss = (~fresh).nonzero().squeeze(1)
        cached_miss = miss.index_select(0, (slot.index_select(0, miss) >= 0).nonzero().squeeze(1))
        if cached_miss.numel():
            s = slot.index_select(0, cached_miss)
            self.key.index_copy_(0, s, keys.index_select(0, cached_miss))
            self.id.index_copy_(0, s, uid.index_select(0, cached_miss))
            self.tab.index_copy_(0, s, utab.index_select(0, cached_miss))
            self.fetched.index_fill_(0, s, step)
        self.used.index_fill_(0, slot[slot >= 0], step)
        self._reindex(added)
        pull = Pull(
            st,
            uid.index_select(0, miss),
            utab.index_select(0, miss),
            None if seen is None else seen.index_select(0, miss),
            True,
            step,
        )
        if miss.numel():
            client.queue(pull)

        def commit() -> tuple[torch.Tensor, None]:
            out = slot.clone()
            if miss.numel():
                rows = client.complete(pull).to(st.weight.dtype)
                st.counters["pulled"] += miss.numel()
                ms = slot.index_select(0, miss)
                in_cache = ms >= 0
                with torch.no_grad():
                    dev = st.weight.device
                    st.weight.data.index_copy_(0, ms[in_cache].to(dev), rows[in_cache].to(dev))
                extra = (~in_cache).nonzero().squeeze(1)
                if extra.numel():  # beyond the cache: staged for this step
                    x = (rows.index_select(0, extra), pull.ids.index_select(0, extra), pull.tabs.index_select(0, extra))
                    base = st.append(*x)
                    out[miss.index_select(0, extra)] = torch.arange(base, base + extra.numel())
            return out.index_select(0, inv), None

        def rollback() -> None:
            client.drop(pull)

        return LookupPlan(commit, rollback)

    def take(self, rows) -> tuple:
        """The step's gradient: cached rows' summed here; staged rows', expired entries' and
        evicted entries' returned for pushing."""
        st, step = self.st, self.st.client.step
        ids, tabs, grads = [], [], []
        if rows is not None:
            slots, g = rows[0].cpu(), rows[1].to("cpu", self.grad.dtype)
            c = slots < self.size
            cs = slots[c]
            self.grad.index_add_(0, cs, g[c])
            self.dirty.index_fill_(0, cs, True)
            tail = (~c).nonzero().squeeze(1)
            if tail.numel():
                ts = slots.index_select(0, tail)
                ids.append(st._staged_ids.index_select(0, ts))
                tabs.append(st._staged_tabs.index_select(0, ts))
                grads.append(g.index_select(0, tail))
        old = ((self.fetched >= 0) & (step + 1 - self.fetched >= st.staleness)).nonzero().squeeze(1)
        if old.numel():  # (written back now: at most `staleness` steps late)
            self._take_out(old)
            self._reindex()
        for i, t, g in self.flush:
            ids.append(i)
            tabs.append(t)
            grads.append(g)
        self.flush = []
        if not ids:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), None
        return torch.cat(ids), torch.cat(tabs), torch.cat(grads)

    def write_back(self) -> tuple:
        """Every cached gradient, for pushing now (before a checkpoint or bye)."""
        self._take_out((self.fetched >= 0).nonzero().squeeze(1))
        self._reindex()
        out = self.flush
        self.flush = []
        if not out:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), None
        return tuple(torch.cat([x[k] for x in out]) for k in range(3))

    def stats(self) -> dict[str, Any]:
        return {
            "cache_rows": self.size,
            "cache_held": int((self.fetched >= 0).sum()),
            "cache_lookups": self.lookups,
            "cache_hit_rate": self.st.counters["cache_hits"] / self.lookups if self.lookups else 0.0,
        }
