"""Admission (min_count, admit_probability) and eviction (lru, lfu, ttl) of dynamic tables.

Every expectation is written out by hand from the documented rules: which ids hold rows
after each step, the values of those rows (their row-keyed initial value, read from a
dense twin of the table, minus the hand-summed SGD/Adagrad updates), and the counters.
"""

from __future__ import annotations

import math

import pytest
import torch

import hybridembed as he

DIM = 2
SEED = 7


def make(dynamic: he.Dynamic, names=("a",), dim=DIM, combiner="sum", init=None):
    kw = {} if init is None else {"init": init}
    tables = [he.TableConfig(n, None, dim, combiner=combiner, dynamic=dynamic, **kw) for n in names]
    return he.EmbeddingCollection(tables, seed=SEED)


def initial_rows(ids, name="a", dim=DIM, init=None):
    """Row-keyed initial values from a dense twin (a different storage, same seed)."""
    kw = {} if init is None else {"init": init}
    n = max(ids) + 1
    twin = he.EmbeddingCollection([he.TableConfig(name, n, dim, **kw)], seed=SEED)
    return twin.weight(name)[torch.tensor(ids, dtype=torch.int64)].clone()


def ids_of(ec, name="a"):
    return ec.dynamic_rows(name)[0].tolist()


def row_of(ec, i, name="a"):
    ids, rows = ec.dynamic_rows(name)
    (pos,) = (ids == i).nonzero(as_tuple=True)
    assert pos.numel() == 1, f"id {i} has no row"
    return rows[pos[0]]


def close(got, want):
    """Hand-computed float arithmetic: equal up to float32 rounding."""
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def sgd_step(ec, opt, inputs, targets):
    """One step on loss = sum(out * target): each bag's ids get gradient ``target`` (sum)."""
    opt.zero_grad()
    outs = ec(inputs)
    sum((outs[f] * targets[f]).sum() for f in outs).backward()
    opt.step()
    return outs


def lookup(ec, ids):
    """A training lookup of one bag per id (no backward needed for eviction tests)."""
    return ec({"a": torch.tensor(ids, dtype=torch.int64)})["a"]


# --- admission: min_count --------------------------------------------------------------------
def test_min_count_admits_at_the_nth_sighting_counting_repeats_in_a_batch():
    ec = make(he.Dynamic(min_count=3, default_value=0.5))
    opt = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec)
    st = ec.storage_of("a")
    default = torch.full((DIM,), 0.5)
    init = {i: r for i, r in zip([7, 8, 9, 10], initial_rows([7, 8, 9, 10]))}

    # step 1: 7 twice (2 sightings), 8 once, 10 three times inside one bag -> only 10 admitted
    t1 = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    out = sgd_step(ec, opt, {"a": he.Jagged.from_lists([[7, 7], [8], [10, 10, 10]])}, {"a": t1})["a"]
    assert torch.equal(out[0], 2 * default)
    assert torch.equal(out[1], default)
    assert torch.equal(out[2], 3 * init[10])
    assert ids_of(ec) == [10]
    close(row_of(ec, 10), init[10] - 0.1 * (3 * t1[2]))  # 3 occurrences, one summed update
    assert torch.equal(st.weight[0].detach(), default)  # the default row never changes
    row10 = row_of(ec, 10).clone()
    assert ec.dynamic_stats()["a"]["rejected"] == 3  # 7, 7, 8
    # step 2: 7 reaches 3 sightings (row made, read and updated now); 8 at 2, 9 at 1 read the default
    t2 = torch.tensor([[1.0, -1.0], [2.0, 0.5]])
    out = sgd_step(ec, opt, {"a": he.Jagged.from_lists([[7], [8, 9]])}, {"a": t2})["a"]
    assert torch.equal(out[0], init[7])
    assert torch.equal(out[1], 2 * default)
    assert ids_of(ec) == [7, 10]
    close(row_of(ec, 7), init[7] - 0.1 * t2[0])
    assert torch.equal(row_of(ec, 10), row10)  # untouched
    assert torch.equal(st.weight[0].detach(), default)
    # step 3: 8 seen twice more (4 >= 3) -> admitted; 9 still at 2
    t3 = torch.tensor([[0.5, 0.5], [1.0, 1.0], [2.0, 2.0]])
    out = sgd_step(ec, opt, {"a": he.Jagged.from_lists([[8], [8], [9]])}, {"a": t3})["a"]
    assert torch.equal(out[0], init[8]) and torch.equal(out[1], init[8])
    assert torch.equal(out[2], default)
    assert ids_of(ec) == [7, 8, 10]
    close(row_of(ec, 8), init[8] - 0.1 * (t3[0] + t3[1]))
    stats = ec.dynamic_stats()["a"]
    assert stats["rejected"] == 3 + 2 + 1  # step 2: 8, 9; step 3: 9
    assert stats["inserted"] == 3 and stats["size"] == 3
    assert torch.equal(st.weight[0].detach(), default)


def test_rejected_ids_get_no_update_and_leave_every_row_unchanged():
    ec = make(he.Dynamic(min_count=2, default_value=-0.25), combiner="mean")
    opt = he.wrap_optimizer(torch.optim.Adagrad(ec.parameters(), lr=0.5), ec)
    st = ec.storage_of("a")
    for _ in range(2):  # ids 1 and 2 admitted at their 2nd sighting
        sgd_step(ec, opt, {"a": torch.tensor([[1, 2]])}, {"a": torch.ones(1, DIM)})
    assert ids_of(ec) == [1, 2]
    rows_before = ec.dynamic_rows("a")[1].clone()
    acc_before = opt.state_dict()["sparse"]["a"]["state"]["sum"].clone()
    # a batch of only unadmitted ids: they read the default, and nothing at all changes
    out = sgd_step(ec, opt, {"a": torch.tensor([[3, 4], [5, -1]])}, {"a": torch.ones(2, DIM)})["a"]
    assert torch.equal(out, torch.full((2, DIM), -0.25))
    assert torch.equal(ec.dynamic_rows("a")[1], rows_before)
    assert torch.equal(opt.state_dict()["sparse"]["a"]["state"]["sum"], acc_before)
    assert torch.equal(st.weight[0].detach(), torch.full((DIM,), -0.25))
    # mixed bag (mean): the known id gets its share of the gradient, the unknown one none
    target = torch.tensor([[2.0, -4.0]])
    before = row_of(ec, 1).clone()
    acc1 = acc_before[0].clone()
    out = sgd_step(ec, opt, {"a": torch.tensor([[1, 6]])}, {"a": target})["a"]
    assert torch.equal(out[0], (before + torch.full((DIM,), -0.25)) / 2)
    g = target[0] / 2
    acc1 = acc1 + g * g
    close(row_of(ec, 1), before - 0.5 * g / (acc1.sqrt() + 1e-10))
    assert torch.equal(row_of(ec, 2), rows_before[1])
    assert ids_of(ec) == [1, 2]
    assert torch.equal(st.weight[0].detach(), torch.full((DIM,), -0.25))


def test_admit_probability_admits_about_half_and_is_reproducible():
    n = 4000
    ids = torch.arange(1000, 1000 + n)

    def admitted(seed):
        ec = he.EmbeddingCollection(
            [he.TableConfig("a", None, DIM, dynamic=he.Dynamic(admit_probability=0.5))], seed=seed
        )
        for chunk in ids.split(1000):
            ec({"a": chunk})
        return ec, set(ids_of(ec))

    ec, got = admitted(1)
    assert 0.4 * n < len(got) < 0.6 * n
    assert got <= set(ids.tolist())
    stats = ec.dynamic_stats()["a"]
    assert stats["rejected"] == n - len(got) and stats["inserted"] == len(got) == stats["size"]
    assert admitted(1)[1] == got  # same seed, same draws
    assert admitted(2)[1] != got  # another seed, other draws
    # the admitted rows still hold their row-keyed initial values
    some = sorted(got)[:5]
    want = he.init.generate(he.init.uniform(), 1, "a", torch.tensor(some), DIM)
    rows = ec.dynamic_rows("a")[1][:5]
    assert torch.equal(rows, want)


# --- eviction ----------------------------------------------------------------------------------
def test_lru_evicts_least_recently_used_never_this_batch_and_counts_stats():
    ec = make(he.Dynamic(capacity=4, evict_fraction=0.25))  # evicts 1 row at a time
    for i in (1, 2, 3, 4):  # steps 1-4, one new id each
        lookup(ec, [i])
    assert ids_of(ec) == [1, 2, 3, 4]
    lookup(ec, [1, 5])  # step 5: 1 is used now; LRU of the rest is 2
    assert ids_of(ec) == [1, 3, 4, 5]
    lookup(ec, [6])  # step 6: 3 goes
    assert ids_of(ec) == [1, 4, 5, 6]
    lookup(ec, [4, 4, 7, 8])  # step 7: 4 is the least recent but used now; 2 needed: 1 and 5 go
    assert ids_of(ec) == [4, 6, 7, 8]
    lookup(ec, [9])  # step 8: 6 goes
    assert ids_of(ec) == [4, 7, 8, 9]
    stats = ec.dynamic_stats()["a"]
    # lookups: 4 + 2 + 1 + 4 + 1; hits: 1 at step 5, 4 twice at step 7
    assert stats["lookups"] == 12 and stats["hits"] == 3
    assert stats["hit_rate"] == pytest.approx(3 / 12, abs=1e-12)
    assert stats["inserted"] == 9 and stats["evicted"] == 5 and stats["size"] == 4
    assert stats["evicted"] == stats["inserted"] - stats["size"]
    assert stats["capacity"] == 4 and stats["rejected"] == 0


def test_eviction_frees_evict_fraction_of_capacity_at_once():
    ec = make(he.Dynamic(capacity=10, evict_fraction=0.3))  # 3 rows per eviction
    for i in range(10):
        lookup(ec, [i])
    assert ids_of(ec) == list(range(10))
    lookup(ec, [10])  # needs 1, frees 3: the three least recent (0, 1, 2)
    assert ids_of(ec) == list(range(3, 11))
    assert ec.dynamic_stats()["a"]["evicted"] == 3
    lookup(ec, [11])
    lookup(ec, [12])  # two free rows left: no eviction
    assert ids_of(ec) == list(range(3, 13))
    assert ec.dynamic_stats()["a"]["evicted"] == 3
    lookup(ec, [13, 14, 15, 16])  # needs 4 > 3: frees 4 (3, 4, 5, 6)
    assert ids_of(ec) == list(range(7, 17))
    stats = ec.dynamic_stats()["a"]
    assert stats["evicted"] == 7 and stats["size"] == 10 and stats["inserted"] == 17


def test_lfu_evicts_least_frequent_then_least_recent():
    ec = make(he.Dynamic(capacity=4, eviction="lfu", evict_fraction=0.25))
    lookup(ec, [4])  # step 1: freq 4 = 1
    lookup(ec, [1, 1, 1])  # step 2: freq 1 = 3 (repeats count)
    lookup(ec, [3, 3])  # step 3: freq 3 = 2
    lookup(ec, [2])  # step 4: freq 2 = 1
    lookup(ec, [5])  # freq 1: 4 (step 1) and 2 (step 4): 4 goes
    assert ids_of(ec) == [1, 2, 3, 5]
    lookup(ec, [6])  # freq 1: 2 (step 4), 5 (step 5): 2 goes
    assert ids_of(ec) == [1, 3, 5, 6]
    lookup(ec, [6, 6, 6, 6, 7])  # 6 now freq 5; freq 1: only 5
    assert ids_of(ec) == [1, 3, 6, 7]
    lookup(ec, [8, 7])  # 7 used now; 1 (3), 3 (2), 6 (5): 3 goes, though 1 is less recent
    assert ids_of(ec) == [1, 6, 7, 8]
    stats = ec.dynamic_stats()["a"]
    assert stats["evicted"] == 4 and stats["size"] == 4 and stats["inserted"] == 8


def test_lru_for_comparison_evicts_the_least_recent_where_lfu_would_not():
    ec = make(he.Dynamic(capacity=2, evict_fraction=0.5))
    lookup(ec, [1, 1, 1])
    lookup(ec, [2])
    lookup(ec, [3])  # LRU: 1 goes although it is the most frequent
    assert ids_of(ec) == [2, 3]


def test_lrfu_keeps_often_seen_rows_until_they_age_out():
    """eviction="lrfu": a row's score is its last lookup plus 8 lookups a doubling of its count
    (1 + count): an id seen 7 times (3 doublings: 24 lookups) outlives ids seen once since, until
    it has gone unseen for longer than that."""
    from hybridembed.storage.hashed import LRFU_DOUBLING, eviction_score

    assert LRFU_DOUBLING == 8
    last, freq = torch.tensor([5, 9, 30]), torch.tensor([7, 1, 0])
    assert eviction_score("lrfu", last, freq, 40).tolist() == [5 + 24, 9 + 8, 30]
    assert eviction_score("lfu", last, freq, 40).tolist() == [7 * 42 + 5, 42 + 9, 30]
    assert eviction_score("lru", last, freq, 40).tolist() == [5, 9, 30]
    ec = make(he.Dynamic(capacity=2, eviction="lrfu", evict_fraction=0.5))
    lookup(ec, [1] * 7)  # step 1: 1 seen 7 times (score 1 + 24 = 25)
    for new in range(2, 18):  # step n: the last new id (seen once at n - 1: n + 7) goes, not 1 (25)
        lookup(ec, [new])
        assert ids_of(ec) == [1, new], new
    lookup(ec, [18])  # step 18: 17 (17 + 8 = 25) ties 1 (25), the smaller id goes: 1 has aged out
    assert ids_of(ec) == [17, 18]
    lru = make(he.Dynamic(capacity=2, eviction="lru", evict_fraction=0.5))
    lookup(lru, [1] * 7), lookup(lru, [2]), lookup(lru, [3])  # (LRU: 1 goes at once)
    assert ids_of(lru) == [2, 3]
    assert make(he.Dynamic(capacity=2)).storage_of("a").config.eviction is None  # (None: lru in memory)


def test_ttl_rows_unseen_for_ttl_steps_go_at_the_end_of_that_step_even_when_not_full():
    ec = make(he.Dynamic(capacity=100, eviction="ttl", ttl_steps=2))
    lookup(ec, [1, 2])  # step 1
    lookup(ec, [2])  # step 2: 1 unseen for 1 step
    assert ids_of(ec) == [1, 2]
    lookup(ec, [3])  # step 3: 1 unseen for 2 steps (2, 3): expired now
    assert ids_of(ec) == [2, 3]
    lookup(ec, [3])  # step 4: 2 unseen for steps 3, 4
    assert ids_of(ec) == [3]
    stats = ec.dynamic_stats()["a"]
    assert stats["evicted"] == 2 and stats["size"] == 1 and stats["inserted"] == 3


def test_ttl_table_that_is_full_evicts_least_recent():
    ec = make(he.Dynamic(capacity=2, eviction="ttl", ttl_steps=50, evict_fraction=0.5))
    lookup(ec, [1])
    lookup(ec, [2])
    lookup(ec, [3])
    assert ids_of(ec) == [2, 3]


def test_an_evicted_id_comes_back_with_its_initial_row_and_fresh_optimizer_state():
    lr = 0.5
    ec = make(he.Dynamic(capacity=2, evict_fraction=0.5))
    opt = he.wrap_optimizer(torch.optim.Adagrad(ec.parameters(), lr=lr), ec)
    g = torch.tensor([[3.0, -2.0]])
    for _ in range(3):  # id 5 trained: its row and accumulator move
        sgd_step(ec, opt, {"a": torch.tensor([5])}, {"a": g})
    init5 = initial_rows([5])[0]
    assert not torch.equal(row_of(ec, 5), init5)
    sgd_step(ec, opt, {"a": torch.tensor([6])}, {"a": g})
    sgd_step(ec, opt, {"a": torch.tensor([7])}, {"a": g})  # 5 is least recent: evicted
    assert ids_of(ec) == [6, 7]
    g_back = torch.tensor([[0.5, 1.5]])
    out = sgd_step(ec, opt, {"a": torch.tensor([5])}, {"a": g_back})["a"]
    assert torch.equal(out[0], init5)  # read before the update: the row-keyed initial value
    # reference: a dense table of fresh rows, one Adagrad step on id 5
    ref = he.EmbeddingCollection([he.TableConfig("a", 8, DIM)], seed=SEED)
    ref_opt = he.wrap_optimizer(torch.optim.Adagrad(ref.parameters(), lr=lr), ref)
    sgd_step(ref, ref_opt, {"a": torch.tensor([5])}, {"a": g_back})
    assert torch.equal(row_of(ec, 5), ref.weight("a")[5])
    state = opt.state_dict()["sparse"]["a"]
    pos = state["ids"].tolist().index(5)
    assert torch.equal(state["state"]["sum"][pos], g_back[0] * g_back[0])


def test_a_batch_with_more_new_ids_than_capacity_raises_and_leaves_the_table_intact():
    ec = make(he.Dynamic(capacity=4))
    lookup(ec, [1, 2])
    ids, rows = ec.dynamic_rows("a")
    with pytest.raises(he.HybridEmbedError):
        lookup(ec, [10, 11, 12, 13, 14])
    got_ids, got_rows = ec.dynamic_rows("a")
    assert torch.equal(got_ids, ids) and torch.equal(got_rows, rows)
    with pytest.raises(he.HybridEmbedError):  # 3 new ids, 2 free rows, and the batch uses the other 2
        lookup(ec, [1, 2, 20, 21, 22])
    lookup(ec, [3, 4])  # still usable
    assert ids_of(ec) == [1, 2, 3, 4]


def test_a_batch_that_raises_leaves_counters_and_admission_state_unchanged():
    """The failed batch is refused as a whole: it is not counted as lookups, and its
    sightings do not count towards min_count."""
    ec = make(he.Dynamic(capacity=4, min_count=2))
    lookup(ec, [1, 1, 2, 2])
    stats = ec.dynamic_stats()["a"]
    with pytest.raises(he.HybridEmbedError):
        lookup(ec, [10, 10, 11, 11, 12, 12, 13, 13, 14, 14])
    assert ec.dynamic_stats()["a"] == stats
    lookup(ec, [14])  # its first sighting that counted: not admitted yet
    assert ids_of(ec) == [1, 2]


def test_capacity_bounds_each_table_of_a_group():
    """Dynamic(capacity=4) on two tables of one group: neither table may hold more than 4."""
    d = he.Dynamic(capacity=4, evict_fraction=0.25)
    ec = make(d, names=("a", "b"))
    assert len(ec.groups) == 1
    for s in range(8):
        ec({"a": torch.tensor([s]), "b": torch.tensor([0])})
        stats = ec.dynamic_stats()
        assert stats["a"]["size"] <= 4, f"step {s}: table a holds {stats['a']['size']} rows, capacity 4"
    assert ids_of(ec, "a") == [4, 5, 6, 7]
    assert ids_of(ec, "b") == [0]


def test_rows_with_a_pending_gradient_are_never_evicted():
    """Two backward passes before one step, and the second forward would need the rows the
    first one used: refused before anything changes, so no gradient is lost or misrouted."""
    ec = make(he.Dynamic(capacity=4, evict_fraction=1.0), init=he.init.zeros())
    opt = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=1.0), ec)
    opt.zero_grad()
    ec({"a": torch.tensor([0, 1, 2, 3])})["a"].sum().backward()
    before = {k: v.clone() for k, v in ec.state_dict().items()}
    with pytest.raises(he.HybridEmbedError, match="optimizer step"):
        ec({"a": torch.tensor([10, 11, 12, 13])})
    after = ec.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    opt.step()
    ids, rows = ec.dynamic_rows("a")
    assert ids.tolist() == [0, 1, 2, 3]
    assert torch.equal(rows, torch.full((4, DIM), -1.0)), rows


def test_accumulated_gradients_stay_on_their_rows_when_other_rows_are_evicted():
    """Rows stepped before are evictable; the pending gradient of this step's rows is kept."""
    ec = make(he.Dynamic(capacity=4, evict_fraction=0.5), init=he.init.zeros())
    opt = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=1.0), ec)
    ec({"a": torch.tensor([0, 1])})["a"].sum().backward()
    opt.step()
    opt.zero_grad()
    ec({"a": torch.tensor([2, 3])})["a"].sum().backward()
    ec({"a": torch.tensor([10, 11])})["a"].sum().backward()  # evicts 0 and 1, not 2 and 3
    opt.step()
    ids, rows = ec.dynamic_rows("a")
    assert ids.tolist() == [2, 3, 10, 11]
    assert torch.equal(rows, torch.full((4, DIM), -1.0)), rows


def test_evict_fraction_rounding_matches_ceil():
    cap, frac = 7, 0.2  # ceil(1.4) = 2 rows per eviction
    ec = make(he.Dynamic(capacity=cap, evict_fraction=frac))
    for i in range(cap + 1):
        lookup(ec, [i])
    assert ec.dynamic_stats()["a"]["evicted"] == math.ceil(cap * frac)
    assert ids_of(ec) == list(range(2, cap + 1))


def test_training_lookups_count_per_table_without_bincount(monkeypatch):
    """Hits, misses, rejections, new rows, sizes and evictions are counted per table with
    index_add_: on CUDA a bincount reads its largest index back to the host, a sync a lookup."""

    def refused(*args, **kwargs):
        raise AssertionError("bincount on the lookup path")

    monkeypatch.setattr(torch, "bincount", refused)
    ec = make(he.Dynamic(capacity=3, eviction="ttl", ttl_steps=1, min_count=2, sketch_width=64), names=("a", "b"))
    for ids in ([1, 1, 2, 2, 3], [4, 4, 5, 5, 6, 6], [3, 7, 7]):
        ec({"a": torch.tensor(ids), "b": torch.tensor(ids[::-1])})
    st = ec.storage_of("a")
    # 1 2 made, 3 seen once; 1 2 make room for 4 5 6; 4 5 for 3 7, and 6 expires (ttl)
    assert [st.table_stats(n)["inserted"] for n in "ab"] == [7, 7]
    assert [st.table_stats(n)["rejected"] for n in "ab"] == [1, 1]
    assert [st.table_stats(n)["evicted"] for n in "ab"] == [5, 5]
    assert [ids_of(ec, n) for n in "ab"] == [[3, 7], [3, 7]]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"default_value": float("nan")},
        {"default_value": float("inf")},
        {"default_value": "0"},
        {"capacity": 0},
        {"eviction": "fifo"},
        {"eviction": "ttl"},
        {"ttl_steps": 3},
        {"admit_probability": 0.0},
        {"min_count": 0},
    ],
)
def test_bad_dynamic_settings_are_refused(kwargs):
    with pytest.raises(he.ConfigError):
        he.Dynamic(**kwargs)
