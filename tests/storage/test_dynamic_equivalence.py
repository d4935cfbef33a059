"""A dynamic table fed ids from ``[0, n)`` is the same model as a dense table of ``n`` rows.

Row-keyed init gives both the same initial rows, and the lazy optimizers touch only the
rows a batch uses, so outputs and weights must agree exactly at every step: with SGD,
Adagrad, Adam and RowWiseAdagrad, several tables in one group, a table shared by two
features, sum and mean combiners, per-id weights, a sequence (``combiner="none"``) table,
ids first seen at later steps, half-precision storage, a capped table that never fills,
gradient accumulation, and a table that starts at 4 rows and doubles many times. The reference is always the
dense ``EmbeddingCollection`` trained side by side on the same batches.
"""

from __future__ import annotations

import pytest
import torch

import hybridembed as he

# name, rows of the dense twin, dim, combiner. a, b and s share a dim (one group), c does not.
TABLES = (("a", 40, 4, "sum"), ("b", 30, 4, "mean"), ("c", 20, 3, "sum"), ("s", 25, 4, "none"))
FEATURES = {"f1": "a", "f2": "a", "f3": "b", "f4": "c", "f5": "s"}  # f1 and f2 share table a
STEPS = 6
BATCH = 5


def make_pair(dynamic: he.Dynamic, tables=TABLES, features=FEATURES, seed=3, dtype=torch.float32):
    dense = he.EmbeddingCollection(
        [he.TableConfig(n, rows, d, combiner=c, dtype=dtype) for n, rows, d, c in tables],
        features=dict(features),
        seed=seed,
    )
    dyn = he.EmbeddingCollection(
        [he.TableConfig(n, None, d, combiner=c, dtype=dtype, dynamic=dynamic) for n, _, d, c in tables],
        features=dict(features),
        seed=seed,
    )
    return dense, dyn


def make_batches(steps, seed, tables=TABLES, features=FEATURES, batch=BATCH):
    """``steps`` batches ``{feature: list of lists of ids}`` plus targets.

    Step ``s`` draws ids from a range that widens with ``s`` (so ids appear for the first
    time at later steps); the table's last id first appears at the last step. Every
    batch repeats an id inside a bag and across bags, and has an empty bag.
    """
    gen = torch.Generator().manual_seed(seed)
    rows_of = {n: r for n, r, _, _ in tables}
    dim_of = {n: d for n, _, d, _ in tables}
    out = []
    for s in range(steps):
        bags, targets = {}, {}
        for f, t in features.items():
            hi = max(2, (rows_of[t] - 1) * (s + 1) // steps)  # ids in [0, hi)
            lengths = torch.randint(0, 4, (batch,), generator=gen).tolist()
            b = [torch.randint(0, hi, (k,), generator=gen).tolist() for k in lengths]
            dup = int(torch.randint(0, hi, (1,), generator=gen))
            b[0] = [dup, dup] + b[0]
            b[1] = b[1] + [dup]
            b[-1] = []
            if s == steps - 1:
                b[2] = b[2] + [rows_of[t] - 1]
            bags[f] = b
            targets[f] = torch.randn(batch, dim_of[t], generator=gen)
        out.append((bags, targets))
    return out


def to_input(f, bags):
    """Alternate input forms: padded 2-D ids for f1/f3, weighted Jagged for f2, Jagged else."""
    if f in ("f1", "f3"):
        width = max(1, max(len(b) for b in bags))
        return torch.tensor([b + [-1] * (width - len(b)) for b in bags], dtype=torch.int64)
    if f == "f2":  # per-id weights, a function of the id
        return he.Jagged.from_lists(bags, weights=[[0.5 + 0.25 * (i % 3) for i in b] for b in bags])
    return he.Jagged.from_lists(bags)


def loss_of(outs, targets):
    total = 0.0
    for f in sorted(outs):
        if isinstance(outs[f], he.Jagged):  # sequence output: one row per id
            total = total + ((outs[f].values - 0.1) ** 2).sum()
        else:
            total = total + ((outs[f] - targets[f]) ** 2).sum()
    return total


def assert_same_output(got, want, where):
    if isinstance(want, he.Jagged):
        assert torch.equal(got.offsets, want.offsets), where
        got, want = got.values, want.values
    assert torch.equal(got, want), where


def seen_ids(batches, table, features=FEATURES):
    return sorted({i for bags, _ in batches for f, t in features.items() if t == table for b in bags[f] for i in b})


def assert_same_model(dense, dyn, batches_so_far, tables=TABLES, features=FEATURES):
    for name, _, _, _ in tables:
        ids, rows = dyn.dynamic_rows(name)
        assert ids.tolist() == seen_ids(batches_so_far, name, features), name
        want = dense.weight(name)[ids]
        assert torch.equal(rows, want), f"table {name}: max diff {(rows - want).abs().max()}"


OPTIMIZERS = [
    pytest.param(lambda p: torch.optim.SGD(p, lr=0.1), None, id="sgd"),
    pytest.param(lambda p: torch.optim.Adagrad(p, lr=0.1), None, id="adagrad"),
    pytest.param(lambda p: torch.optim.Adam(p, lr=0.02, betas=(0.8, 0.9)), None, id="adam"),
    pytest.param(lambda p: torch.optim.SGD(p, lr=0.1), lambda: he.optim.RowWiseAdagrad(lr=0.2), id="rowwise_adagrad"),
]


def wrap(make_opt, make_sparse, model):
    sparse = make_sparse() if make_sparse is not None else None
    return he.wrap_optimizer(make_opt(model.parameters()), model, sparse=sparse)


DYNAMIC = [
    pytest.param(he.Dynamic(initial_rows=8), id="unbounded"),
    pytest.param(he.Dynamic(capacity=64, eviction="lfu"), id="capped-never-full"),
]


@pytest.mark.parametrize("dynamic", DYNAMIC)
@pytest.mark.parametrize("make_opt,make_sparse", OPTIMIZERS)
def test_dynamic_trains_exactly_like_dense(make_opt, make_sparse, dynamic):
    run_side_by_side(make_opt, make_sparse, dynamic, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_dynamic_trains_exactly_like_dense(dtype):
    run_side_by_side(lambda p: torch.optim.Adagrad(p, lr=0.1), None, he.Dynamic(initial_rows=8), dtype)


def run_side_by_side(make_opt, make_sparse, dynamic, dtype):
    dense, dyn = make_pair(dynamic, dtype=dtype)
    assert len(dyn.groups) == 2 and len(dense.groups) == 2  # a, b and s share a storage, c has its own
    assert dyn.storage_of("a") is dyn.storage_of("b") is dyn.storage_of("s") is not dyn.storage_of("c")
    opt_dense, opt_dyn = wrap(make_opt, make_sparse, dense), wrap(make_opt, make_sparse, dyn)
    batches = make_batches(STEPS, seed=11)
    initial = {n: dense.weight(n).clone() for n, _, _, _ in TABLES}
    for s, (bags, targets) in enumerate(batches):
        losses = []
        for model, opt in ((dense, opt_dense), (dyn, opt_dyn)):
            opt.zero_grad()
            outs = model({f: to_input(f, bags[f]) for f in FEATURES})
            loss = loss_of(outs, targets)
            loss.backward()
            opt.step()
            losses.append((outs, loss))
        (out_dense, loss_dense), (out_dyn, loss_dyn) = losses
        for f in FEATURES:
            assert_same_output(out_dyn[f], out_dense[f], f"step {s} feature {f}")
        assert torch.equal(loss_dyn, loss_dense)
        assert_same_model(dense, dyn, batches[: s + 1])
    for n, rows, _, _ in TABLES:  # the test trained something, and touched the late last id
        assert not torch.equal(dense.weight(n), initial[n])
        assert not torch.equal(dense.weight(n)[rows - 1], initial[n][rows - 1])


@pytest.mark.parametrize("make_opt,make_sparse", OPTIMIZERS[:3])
def test_gradient_accumulation_with_growth_between_backward_passes(make_opt, make_sparse):
    """Two forward+backward passes, then one step; the second pass brings new ids that make
    the dynamic storage grow after the first gradient exists."""
    dense, dyn = make_pair(he.Dynamic(initial_rows=2))
    opt_dense, opt_dyn = wrap(make_opt, make_sparse, dense), wrap(make_opt, make_sparse, dyn)
    batches = make_batches(6, seed=12)
    storage = dyn.storage_of("a")
    grew_between = 0
    for k in range(3):
        micro = batches[2 * k : 2 * k + 2]
        for model, opt in ((dense, opt_dense), (dyn, opt_dyn)):
            opt.zero_grad()
            slots = []
            for bags, targets in micro:
                loss_of(model({f: to_input(f, bags[f]) for f in FEATURES}), targets).backward()
                slots.append(storage.weight.shape[0])
            opt.step()
        grew_between += slots[1] > slots[0]
        assert_same_model(dense, dyn, batches[: 2 * k + 2])
    assert grew_between >= 1  # the case under test happened


def test_two_forwards_before_one_backward_with_growth_in_between():
    """The collection called twice in one graph (e.g. two towers) before one backward: the
    second call makes the storage grow. Both calls' gradients must reach the rows."""
    dense, dyn = make_pair(he.Dynamic(initial_rows=4), tables=(("a", 50, 4, "sum"),), features={"a": "a"})
    opts = [he.wrap_optimizer(torch.optim.SGD(m.parameters(), lr=0.1), m) for m in (dense, dyn)]
    first, second = torch.tensor([[0, 1], [2, 3]]), torch.tensor([[4, 5], [6, 7], [8, 9]])
    for model, opt in zip((dense, dyn), opts):
        opt.zero_grad()
        loss = model({"a": first})["a"].square().sum() + model({"a": second})["a"].square().sum()
        loss.backward()
        opt.step()
    ids, rows = dyn.dynamic_rows("a")
    assert ids.tolist() == list(range(10))
    want = dense.weight("a")[ids]
    assert torch.equal(rows, want), f"rows that differ from dense: {ids[(rows != want).any(1)].tolist()}"


def test_unbounded_growth_doubles_many_times_and_matches_dense():
    n = 1500
    tables = (("u", n, 2, "sum"),)
    dense, dyn = make_pair(he.Dynamic(initial_rows=4), tables=tables, features={"u": "u"})
    opt_dense = he.wrap_optimizer(torch.optim.Adagrad(dense.parameters(), lr=0.3), dense)
    opt_dyn = he.wrap_optimizer(torch.optim.Adagrad(dyn.parameters(), lr=0.3), dyn)
    gen = torch.Generator().manual_seed(5)
    order = torch.randperm(n, generator=gen)
    storage = dyn.storage_of("u")
    sizes, seen = [storage.weight.shape[0] - 1], set()
    start = 0
    while start < n:
        width = max(3, len(seen) // 2)  # at most one doubling per step, so every size shows
        new = order[start : start + width]
        old = torch.tensor(sorted(seen)[:7], dtype=torch.int64)  # some known ids again
        ids = torch.cat([new, old, new[:1]])
        bags = he.Jagged.from_lengths(ids, torch.tensor([ids.numel() // 2, ids.numel() - ids.numel() // 2]))
        target = torch.randn(2, 2, generator=gen)
        outs = []
        for model, opt in ((dense, opt_dense), (dyn, opt_dyn)):
            opt.zero_grad()
            outs.append(model({"u": bags})["u"])
            ((outs[-1] - target) ** 2).sum().backward()
            opt.step()
        assert torch.equal(outs[1], outs[0])
        seen.update(new.tolist())
        sizes.append(storage.weight.shape[0] - 1)
        start += width
    got_ids, rows = dyn.dynamic_rows("u")
    assert got_ids.tolist() == list(range(n))
    assert torch.equal(rows, dense.weight("u"))
    assert sorted(set(sizes)) == [4 * 2**k for k in range(10)]  # 4 -> 8 -> ... -> 2048, one doubling at a time
    stats = dyn.dynamic_stats()["u"]
    assert stats["size"] == n and stats["inserted"] == n and stats["evicted"] == 0


def test_grouping_dynamic_tables_share_a_storage_dense_never_with_dynamic():
    dyn = he.Dynamic(capacity=100)
    ec = he.EmbeddingCollection(
        [
            he.TableConfig("d1", None, 8, dynamic=dyn),
            he.TableConfig("d2", None, 8, combiner="mean", dynamic=he.Dynamic(capacity=100)),  # equal config
            he.TableConfig("d3", None, 4, dynamic=dyn),
            he.TableConfig("s1", 10, 8),
            he.TableConfig("s2", 20, 8),
            he.TableConfig("s3", 20, 4),
            he.TableConfig("d4", None, 8, dynamic=he.Dynamic(capacity=50)),  # another Dynamic: own storage
        ]
    )
    assert len(ec.groups) == 5
    groups = sorted(sorted(g) for g in ec.groups)
    assert groups == [["d1", "d2"], ["d3"], ["d4"], ["s1", "s2"], ["s3"]]
    assert ec.storage_of("d1") is ec.storage_of("d2")
    assert ec.storage_of("d1") is not ec.storage_of("s1")
    assert all(ec.storage_of(t).kind == "dynamic" for t in ("d1", "d2", "d3", "d4"))
    assert all(ec.storage_of(t).kind == "dense" for t in ("s1", "s2", "s3"))
