"""The slot index of a dynamic group (:class:`hybridembed.storage.slot_index.SlotIndex`): every
table's (ids ascending, slots) from one scan of the slots, equal to a fresh scan of that table
after whatever moved rows since (admissions, evictions, a grown group, a reload, a copy)."""

from __future__ import annotations

import copy
import pickle

import torch

import hybridembed as he
from hybridembed.storage.hashed import HashStorage

TABLES = ("a", "b", "c")


def _scan(st: HashStorage, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: table ``name``'s slots found by scanning every slot for it."""
    slots = (st.slot_table == st.table_index[name]).nonzero().squeeze(1)
    keys = st.slot_key[slots]
    order = torch.argsort(keys)
    return keys[order], slots[order]


def _check(st: HashStorage) -> None:
    for name in TABLES:
        ids, slots = st.table_slots(name)
        want_ids, want_slots = _scan(st, name)
        assert torch.equal(ids, want_ids) and torch.equal(slots, want_slots), name


def _collection(**dynamic) -> tuple[he.EmbeddingCollection, HashStorage]:
    tables = [he.TableConfig(n, None, 4, dynamic=he.Dynamic(**dynamic)) for n in TABLES]
    ec = he.EmbeddingCollection(tables, seed=3)
    (st,) = [m for m in ec.modules() if isinstance(m, HashStorage)]
    return ec, st


def _train(ec, opt, g: torch.Generator, high: int) -> None:
    opt.zero_grad()
    out = ec({n: torch.randint(0, high, (24, 2), generator=g) for n in TABLES})
    sum(o.sum() for o in out.values()).backward()
    opt.step()


def test_every_table_s_slots_equal_a_fresh_scan_as_rows_come_and_go():
    g = torch.Generator().manual_seed(0)
    ec, st = _collection(capacity=64, eviction="lru")  # (evicts: up to 48 new ids a step, 64 rows a table)
    opt = he.wrap_optimizer(torch.optim.Adagrad(ec.parameters(), lr=0.1), ec)
    for _ in range(6):
        _train(ec, opt, g, 500)
        _check(st)
        ids, slots = st.table_slots("b")
        ids.fill_(-1), slots.fill_(0)  # (a caller's own tensors: the index is not written through them)
        _check(st)
    entry, c_ids = st.save_table("a"), st.table_slots("c")[0]
    st.load_tables({"a": entry})  # (a reload: table a's rows freed and written again)
    _check(st)
    assert torch.equal(st.table_slots("a")[0], entry["ids"]) and torch.equal(st.table_slots("c")[0], c_ids)
    for twin in (copy.deepcopy(st), pickle.loads(pickle.dumps(st))):
        _check(twin)
        _train(ec, opt, g, 500)  # (the original moves on; the copy keeps its own rows)
        _check(twin)
        _check(st)


def test_a_group_that_grows_is_scanned_again():
    g = torch.Generator().manual_seed(1)
    ec, st = _collection(initial_rows=8)  # (no capacity: the group grows as ids come)
    opt = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec)
    before = st.slot_table
    for _ in range(4):
        _check(st)
        _train(ec, opt, g, 10_000)
    assert st.slot_table is not before  # (grown: new tensors)
    _check(st)


def test_the_lowest_by_score_then_key_are_what_a_full_sort_puts_first():
    from hybridembed.storage.slot_index import lowest

    g = torch.Generator().manual_seed(2)
    for m, levels in ((1, 1), (7, 2), (500, 3), (500, 400), (2000, 1)):
        score = torch.randint(0, levels, (m,), generator=g)  # (few levels: many ties at the k-th score)
        keys = torch.randperm(10 * m, generator=g)[:m]
        order = torch.argsort(keys, stable=True)
        order = order[torch.argsort(score[order], stable=True)]
        for k in {0, 1, m // 3, m - 1, m}:
            assert lowest(score, keys, k).tolist() == order[:k].tolist(), (m, levels, k)
