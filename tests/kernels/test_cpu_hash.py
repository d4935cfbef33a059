"""The Numba hash-index loops (find, insert) against the torch ops of HashStorage's index.

Both must hold the same pairs and answer every find the same (only which position a pair sits
at may differ), through wrapped probe chains, tombstones and a nearly full index; a storage on
them trains as one on the torch ops: the same slots, counters and index pairs, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import hybridembed as he
from hybridembed.kernels import cpu_fused, cpu_hash

pytestmark = pytest.mark.skipif(not cpu_fused.available(), reason="needs Numba")

_INT64 = torch.iinfo(torch.int64)
_TOMB = torch.tensor([-1, ((1 << 31) - 1) << 32])  # a spilled pair's position (tiered tables)


@pytest.fixture
def calls(monkeypatch):
    """Counts the Numba path's calls (so an equivalence cannot pass on the torch ops alone)."""
    n = {"find": 0, "insert": 0}

    def counted(name):
        real = getattr(cpu_hash, name)

        def run(*args):
            n[name] += 1
            return real(*args)

        return run

    for name in n:
        monkeypatch.setattr(cpu_hash, name, counted(name))
    return n


def held(hrow: torch.Tensor) -> torch.Tensor:
    """The (key, table << 32 | slot) rows an index holds (tombstones not), ordered by slot."""
    rows = hrow[(hrow[:, 1] >= 0) & (hrow[:, 1] >> 32 != (1 << 31) - 1)]
    return rows[torch.argsort(rows[:, 1])]


def _storage(kernels: str):
    ec = he.EmbeddingCollection([he.TableConfig(n, None, 4, dynamic=he.Dynamic()) for n in "ab"], kernels=kernels)
    return ec.storage_of("a")


def _empty(st, h: int) -> None:
    st._hrow = torch.full((h, 2), -1, dtype=torch.int64)
    st._claim = torch.full((h,), -1, dtype=torch.int32)
    st._mask = h - 1


def test_find_and_insert_match_the_torch_index_nearly_full_with_tombstones(calls):
    h = 128
    eager, fast = _storage("eager"), _storage("numba")
    g = torch.Generator().manual_seed(1)
    special = torch.tensor([_INT64.min, _INT64.max, -1, 0, 1, -(2**62), 2**62])
    pool = torch.unique(torch.cat([special, torch.randint(_INT64.min, _INT64.max, (3000,), generator=g)]))
    keys = torch.cat([pool, pool])  # every key in both tables (the same id, another pair)
    tabs = torch.cat([torch.zeros_like(pool), torch.ones_like(pool)]).to(torch.int32)
    home = eager._hash(keys, tabs) & (h - 1)
    order = torch.randperm(keys.numel(), generator=g)
    near_end = order[home[order] >= h - 8][:30]  # crowd the last positions: chains wrap to 0
    chosen = torch.unique(torch.cat([near_end, order[home[order] < h - 8][:80]]))
    k, t = keys[chosen], tabs[chosen]
    slots = torch.randperm(chosen.numel(), generator=g) + 1
    for st in (eager, fast):
        _empty(st, h)
        st._insert(k, t, slots)
    assert calls["insert"] == 1
    assert torch.equal(held(fast._hrow), held(eager._hrow))  # the same pairs, maybe elsewhere
    at = (fast._hrow[:, 1] >= 0).nonzero().squeeze(1)
    assert bool((at < fast._hash(fast._hrow[at, 0], (fast._hrow[at, 1] >> 32).to(torch.int32)) & (h - 1)).any())

    # a third of the pairs made tombstones (where they sit), on both: finds probe past them
    gone = torch.randperm(chosen.numel(), generator=g)[: chosen.numel() // 3]
    for st in (eager, fast):
        pos = st._find(k[gone], t[gone], where=True)
        assert bool((pos >= 0).all()) and torch.equal(st._hrow[pos, 0], k[gone])
        st._hrow[pos] = _TOMB
    lookup = dict(zip(zip(k.tolist(), t.tolist()), slots.tolist()))
    for i in gone.tolist():
        del lookup[(k[i].item(), t[i].item())]
    absent = order[~torch.isin(order, chosen)][:40]
    qk, qt = torch.cat([k, keys[absent], k]), torch.cat([t, tabs[absent], 1 - t])
    want = torch.tensor([lookup.get(p, -1) for p in zip(qk.tolist(), qt.tolist())])
    assert 0 < int((want < 0).sum()) < qk.numel()
    for index in (eager._hrow, fast._hrow):  # each answers the same on either index
        for st in (eager, fast):
            before, st._hrow = st._hrow, index
            assert torch.equal(st._find(qk, qt), want)
            st._hrow = before
    # an insert after tombstones takes empty positions only, and finds find it
    new_k, new_t = keys[absent[:5]], tabs[absent[:5]]
    for st in (eager, fast):
        tombs = (st._hrow[:, 1] >> 32 == (1 << 31) - 1).nonzero().squeeze(1)
        st._insert(new_k, new_t, torch.arange(500, 505))
        assert bool((st._hrow[tombs, 0] == -1).all())
        assert torch.equal(st._find(new_k, new_t), torch.arange(500, 505))
    assert calls["find"] >= 4


def test_no_pairs_and_a_full_index():
    hrow = torch.full((16, 2), -1, dtype=torch.int64)
    e = torch.zeros(0, dtype=torch.int64)
    assert cpu_hash.find(hrow, 15, e, e.to(torch.int32), e).shape == (0,)
    cpu_hash.insert(hrow, 15, e, e.to(torch.int32), e, e)
    assert bool((hrow == -1).all())
    keys = torch.arange(16, dtype=torch.int64)
    tabs = torch.zeros(16, dtype=torch.int32)
    cpu_hash.insert(hrow, 15, keys, tabs, keys + 1, keys % 16)
    assert torch.equal(cpu_hash.find(hrow, 15, keys, tabs, (keys * 7) % 16), keys + 1)
    with pytest.raises(he.HybridEmbedError, match="index is full"):  # (a bug, never a hang)
        cpu_hash.find(hrow, 15, keys[:1] + 99, tabs[:1], keys[:1])
    with pytest.raises(he.HybridEmbedError, match="index is full"):
        cpu_hash.insert(hrow, 15, keys[:1] + 99, tabs[:1], keys[:1], keys[:1])


CONFIGS = {
    "growth": he.Dynamic(initial_rows=4),
    "admission": he.Dynamic(min_count=2, admit_probability=0.6, sketch_width=64, initial_rows=8),
    "lru": he.Dynamic(capacity=10, eviction="lru", evict_fraction=0.2),
    "lfu": he.Dynamic(capacity=10, eviction="lfu"),
}


def _train(dynamic: he.Dynamic, kernels: str, seed: int):
    ec = he.EmbeddingCollection([he.TableConfig(n, None, 4, dynamic=dynamic) for n in "ab"], seed=3, kernels=kernels)
    opt = he.wrap_optimizer(torch.optim.Adagrad(ec.parameters(), lr=0.1), ec)
    g = torch.Generator().manual_seed(seed)
    outs = []
    for _ in range(5):
        batch = {}
        for f in "ab":
            ids = torch.randint(-12, 12, (9,), generator=g)
            ids[torch.rand(9, generator=g) < 0.1] = _INT64.max
            batch[f] = he.Jagged.from_lengths(ids, torch.tensor([3, 0, 4, 2]))
        opt.zero_grad()
        out = ec(batch)
        sum((o * torch.randn(o.shape, generator=g)).sum() for o in out.values()).backward()
        opt.step()
        outs.append(out)
    return ec.storage_of("a"), outs


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_storage_on_the_numba_index_trains_as_on_the_torch_ops(name, calls):
    a, want = _train(CONFIGS[name], "eager", len(name))
    assert calls == {"find": 0, "insert": 0}
    b, got = _train(CONFIGS[name], "numba", len(name))
    assert calls["find"] >= 5 and calls["insert"] >= 1
    for w, o in zip(want, got):
        for f in w:
            torch.testing.assert_close(o[f], w[f], rtol=1e-5, atol=1e-6)
    for name_ in ("slot_key", "slot_table", "last_seen", "freq", "free", "counters", "size", "sketch"):
        assert torch.equal(getattr(a, name_), getattr(b, name_)), name_
    assert torch.equal(held(a._hrow), held(b._hrow))
    # (the torch ops' insert claims positions in an array of its own, made at its first insert; the
    # Numba index never makes it: 4 bytes a position less)
    assert a._claim.numel() == a._mask + 1 and b._claim.numel() == 0
