"""A tiered cache's recency queue (``storage/victims.py``): its victims are the k least recently used
eligible slots (ties in the order their lookup gave them), with the Numba loops and with the torch
ops, through lookups, evictions, compactions and growth."""

from __future__ import annotations

import pytest
import torch

from hybridembed.storage import victims as V


def _reference(order: dict, taken, protect, k):
    """By sorting: the eligible slots ordered by (their last lookup, their place in it), the first k."""
    elig = [s for s in range(taken.numel()) if taken[s] >= 0 and not protect[s]]
    return (sorted(elig, key=lambda s: order[s])[:k] if len(elig) >= k else None), len(elig)


@pytest.mark.parametrize("numba", [True, False])
@pytest.mark.parametrize("seed", range(5))
def test_the_queue_gives_the_least_recently_used_eligible_slots_both_ways(seed, numba, monkeypatch):
    """(Seed 4: entries as int64, as a cache of 2**31 slots or more holds them.)"""
    if numba and V._kernel() is None:
        pytest.skip("Numba does not import here")
    if not numba:
        monkeypatch.setattr(V, "_kernel", lambda: None)
    g = torch.Generator().manual_seed(seed)
    c = int(torch.randint(4, 120, (1,), generator=g))
    q = V.RecencyQueue(c)
    if seed == 4:
        q.dtype = torch.int64
    q.entries = q.entries[: c + 3].to(q.dtype)  # (small buffers: compactions and growth happen within the test)
    q.seg_end, q.seg_clock = q.seg_end[:2], q.seg_clock[:2]
    last_used = torch.zeros(c, dtype=torch.int64)
    taken = torch.full((c,), -1, dtype=torch.int64)
    order: dict[int, tuple[int, int]] = {}
    compared = 0
    for clock in range(1, 150):
        # a lookup of distinct slots, some already holding rows (hits), some filled now
        u = int(torch.randint(1, max(2, c // 3), (1,), generator=g))
        slots = torch.randperm(c, generator=g)[:u]
        protect = torch.zeros(c, dtype=torch.bool)
        protect[slots] = True
        protect |= torch.rand(c, generator=g) < 0.1
        k = int(torch.randint(1, c // 2 + 2, (1,), generator=g))
        got, head = q.victims(k, last_used, taken, protect)
        want, n = _reference(order, taken, protect, k)
        assert (got is None) == (want is None), (clock, k, n)
        if got is not None:
            assert got.tolist() == want, (clock, k)
            compared += 1
            if bool(torch.rand(1, generator=g) < 0.7):  # (evicted, the plan committed; or abandoned)
                taken[got] = -1
                q.advance(head)
        taken[slots] = slots
        last_used[slots] = clock
        for i, s in enumerate(slots.tolist()):
            order[s] = (clock, i)
        q.push(slots, clock, last_used, taken)
        assert q.n - q.head <= q.entries.numel()
    assert compared > 50
    assert q.entries.numel() <= 4 * c + 8


@pytest.mark.parametrize("numba", [True, False])
def test_a_cache_that_only_hits_keeps_one_entry_a_slot(numba, monkeypatch):
    """Lookups of cached rows only (nothing evicted, so the head never moves): compactions drop the
    stale entries, the queue stays within twice the cache, and its order stays right."""
    if numba and V._kernel() is None:
        pytest.skip("Numba does not import here")
    if not numba:
        monkeypatch.setattr(V, "_kernel", lambda: None)
    g = torch.Generator().manual_seed(7)
    c = 64
    q = V.RecencyQueue(c)
    last_used, taken = torch.zeros(c, dtype=torch.int64), torch.arange(c, dtype=torch.int64)
    order = {}
    for clock in range(1, 400):
        slots = torch.randperm(c, generator=g)[: int(torch.randint(1, 20, (1,), generator=g))]
        last_used[slots] = clock
        order.update({s: (clock, i) for i, s in enumerate(slots.tolist())})
        q.push(slots, clock, last_used, taken)
    assert q.entries.numel() == 2 * c + 1024 and q.n <= q.entries.numel()
    protect = torch.rand(c, generator=g) < 0.3
    got, _ = q.victims(c // 2, last_used, taken, protect)
    assert got.tolist() == _reference(order, taken, protect, c // 2)[0]


def test_a_queue_of_one_segment_a_cached_slot_compacts_rarely(monkeypatch):
    """Lookups of one row each over a 1,023-slot cache (its live segments fill the segment arrays
    after every compaction unless they grow): the queue compacts a few times, not at every lookup."""
    c = 1023
    q = V.RecencyQueue(c)
    calls = []
    real = q._compact
    monkeypatch.setattr(q, "_compact", lambda *a: calls.append(1) or real(*a))
    last_used, taken = torch.zeros(c, dtype=torch.int64), torch.arange(c, dtype=torch.int64)
    for clock in range(1, 3001):
        slot = torch.tensor([clock % c])
        last_used[slot] = clock
        q.push(slot, clock, last_used, taken)
    assert len(calls) <= 10, len(calls)
    got, _ = q.victims(3, last_used, taken, torch.zeros(c, dtype=torch.bool))
    assert got.tolist() == [3001 % c, 3002 % c, 3003 % c]  # (the least recently used)


def test_the_numba_modules_load_by_name_and_an_unknown_name_raises():
    """``kernels.numba_loops``: a module of Numba loops (None without Numba), never None for a typo."""
    from hybridembed.kernels import numba_loops

    assert numba_loops("_numba_victims") is V._kernel()
    with pytest.raises(ValueError, match="no module"):
        numba_loops("_numba_nope")
