"""The sharded runtime against the single-process collection: K steps at world 2 and 4 on each
rank's slice of the batches equal K steps at world 1 on the concatenated batches."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import hybridembed as he
from hybridembed.distributed import Plan, ShardedCollection, shard_table
from hybridembed.kernels.backend import triton_available
from hybridembed.launch import SpawnError, spawn

DYN = he.Dynamic()


def _tables(dynamic: bool = True) -> list[he.TableConfig]:
    ts = [
        he.TableConfig("a", 50, 8),
        he.TableConfig("b", 40, 6, combiner="mean"),
        he.TableConfig("c", 37, 8, combiner="sqrtn", init=he.init.normal(std=0.1)),
        he.TableConfig("d", 30, 8, combiner="mean", optimizer=he.optim.Adagrad(lr=0.05)),  # its own optimizer
        he.TableConfig("f", 10, 4, combiner="mean"),
        he.TableConfig("s", 25, 8, combiner="none"),
    ]
    if dynamic:
        ts.append(he.TableConfig("e", None, 8, dynamic=DYN))
    return ts


FEATURES = {"a": "a", "a2": "a", "b": "b", "c": "c", "d": "d", "f": "f", "s": "s", "e": "e"}


def _plan(world: int, tables: list[he.TableConfig], mixed: str = "mixed", optimizer: str = "sgd") -> Plan:
    ranks = tuple(range(world))
    by = {t.name: t for t in tables}
    if mixed == "mixed":
        kinds = {
            "a": ("table_wise", (world - 1,), {}),
            "b": ("column_wise", ranks[:2], {}),
            "c": ("row_wise", ranks, {"placement": "block"}),
            "d": ("row_wise", ranks, {"placement": "mod"}),
            "e": ("row_wise", ranks, {}),
            "f": ("data_parallel", ranks, {}),
            "s": ("table_row_wise", ranks[-2:], {"placement": "mod"}),
        }
    else:  # one sharding type for every table that can take it
        kinds = {}
        for n, t in by.items():
            kind = mixed
            if t.dynamic is not None and kind in ("data_parallel", "table_wise", "column_wise"):
                kind = "row_wise"
            r = (sorted(by).index(n) % world,) if kind == "table_wise" else ranks
            kinds[n] = (kind, r, {})
    return Plan(world, tuple(shard_table(by[n], k, r, **o) for n, (k, r, o) in kinds.items() if n in by))


def _batch(step: int, n: int, features: dict[str, str], weighted: bool) -> dict[str, he.Jagged]:
    g = torch.Generator().manual_seed(1000 + step)
    rows = {"a": 50, "b": 40, "c": 37, "d": 30, "f": 10, "s": 25, "e": 10**12}
    out = {}
    for f, t in features.items():
        lengths = torch.randint(0, 4, (n,), generator=g)  # empty bags included
        k = int(lengths.sum())
        ids = torch.randint(0, rows[t], (k,), generator=g)
        if t == "e":
            ids = ids - rows[t] // 2  # negative ids too
        w = torch.rand(k, generator=g) + 0.5 if weighted and f in ("c", "a2", "d") else None
        out[f] = he.Jagged.from_lengths(ids, lengths, w)
    return out


def _slice(j: he.Jagged, lo: int, hi: int) -> he.Jagged:
    o = j.offsets
    a, b = int(o[lo]), int(o[hi])
    w = None if j.weights is None else j.weights[a:b]
    return he.Jagged(j.values[a:b], o[lo : hi + 1] - a, w)


def _loss(out: dict, projections: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    total = 0.0
    for f, x in out.items():
        rows = x.values if isinstance(x, he.Jagged) else x
        v = projections[f][: rows.shape[1]]
        total = total + (rows @ v).pow(2).sum()
    return total * scale


def _projections(features) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {f: torch.randn(8, generator=g) for f in features}


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    "rowwise": None,
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
}


def _opt(name: str, model: nn.Module):
    if name == "rowwise":
        return he.wrap_optimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model, sparse=he.optim.RowWiseAdagrad(lr=0.1)
        )
    return he.wrap_optimizer(OPTIMIZERS[name](model.parameters()), model)


def _train(ec: nn.Module, batches: list[dict], optimizer: str, scale: float, features):
    model = nn.ModuleDict({"ec": ec, "dense": nn.Linear(1, 1)})
    opt = _opt(optimizer, model)
    proj = _projections(features)
    for b in batches:
        opt.zero_grad()
        _loss(ec(b), proj, scale).backward()
        opt.step()
    return opt


def _run_sharded(rank: int, world: int, case: dict) -> dict:
    if "shared" in case:  # every rows' exchange large enough for shared memory; allowed or not
        from hybridembed.distributed import runtime, shm

        runtime.FOLD_ROWS = 0
        os.environ[shm.ENV] = "1" if case["shared"] else "0"
    tables = _tables(case["dynamic"])
    features = {f: t for f, t in FEATURES.items() if any(t == x.name for x in tables)}
    plan = _plan(world, tables, case["plan"], case["optimizer"])
    ec = ShardedCollection(
        tables,
        features,
        plan,
        reduction=case["reduction"],
        seed=3,
        dedup=case.get("dedup", False),
        kernels=case.get("kernels", "auto"),
    )
    batches = []
    for step in range(case["steps"]):
        sizes = case["sizes"]
        full = _batch(step, sum(sizes), features, case["weighted"])
        lo = sum(sizes[:rank])
        batches.append({f: _slice(j, lo, lo + sizes[rank]) for f, j in full.items()})
    scale = 1.0 / case["sizes"][rank] if case["reduction"] == "mean" else 1.0
    opt = _train(ec, batches, case["optimizer"], scale, features)
    ec.eval()
    probe = _batch(99, sum(case["sizes"]), features, case["weighted"])
    lo = sum(case["sizes"][:rank])
    mine = ec({f: _slice(j, lo, lo + case["sizes"][rank]) for f, j in probe.items()})
    return {
        "tables": {t.name: ec.gather_table(t.name) for t in tables},
        "out": {f: (x.values if isinstance(x, he.Jagged) else x) for f, x in mine.items()},
        "fused": dict(opt.fused_steps),
        "here": [local for _, _, _, local in ec.shards_here()],
        "shared": ec._shm is not None,
    }


def _reference(case: dict) -> tuple[he.EmbeddingCollection, dict]:
    tables = _tables(case["dynamic"])
    features = {f: t for f, t in FEATURES.items() if any(t == x.name for x in tables)}
    ec = he.EmbeddingCollection(tables, features, seed=3)
    total = sum(case["sizes"])
    batches = [_batch(step, total, features, case["weighted"]) for step in range(case["steps"])]
    scale = 1.0 / total if case["reduction"] == "mean" else 1.0
    _train(ec, batches, case["optimizer"], scale, features)
    ec.eval()
    out = ec(_batch(99, total, features, case["weighted"]))
    return ec, {f: (x.values if isinstance(x, he.Jagged) else x) for f, x in out.items()}


def _check(case: dict, results: list[dict]) -> None:
    ref, ref_out = _reference(case)
    for name, t in ref.tables.items():
        got = results[0]["tables"][name]
        if t.dynamic is None:
            torch.testing.assert_close(
                got, ref.weight(name), atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"table {name}: {m}"
            )
        else:
            ids, rows = ref.dynamic_rows(name)
            assert torch.equal(got[0], ids), f"table {name}: different ids"
            torch.testing.assert_close(got[1], rows, atol=1e-5, rtol=1e-5)
    for f, x in ref_out.items():  # the outputs after training, each rank its slice, in order
        got = torch.cat([r["out"][f] for r in results])
        torch.testing.assert_close(got, x, atol=1e-5, rtol=1e-5, msg=lambda m, f=f: f"output {f}: {m}")


BASE = {"dynamic": True, "plan": "mixed", "reduction": "mean", "steps": 3, "weighted": True}


def _run_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    return [_run_sharded(rank, world, case) for case in cases]  # (one job: spawning costs seconds)


def _check_all(cases: list[dict], world: int) -> list[list[dict]]:
    out = []
    for case, results in zip(cases, zip(*spawn(_run_cases, world, cases, timeout=240))):
        _check(case, list(results))
        out.append(list(results))
    return out


def test_mixed_plan_world2_equals_world1_every_optimizer():
    cases = [{**BASE, "optimizer": o, "sizes": [6, 6]} for o in OPTIMIZERS]
    cases += [{**BASE, "optimizer": o, "sizes": [6, 6], "dedup": True} for o in ("adagrad", "adam")]
    if triton_available():  # the shards' Triton kernels (interpreted on the CPU): the same as one eager process
        cases.append({**BASE, "optimizer": "adagrad", "sizes": [6, 6], "kernels": "triton", "steps": 2})
    # last (it leaves every later exchange of the job unfolded): every rows' exchange through gloo
    cases.append({**BASE, "optimizer": "adam", "sizes": [6, 6], "shared": False})
    results = _check_all(cases, 2)
    assert not any(r["shared"] for r in results.pop())
    if triton_available():  # the fused update reached the table-wise and row-wise shards, not the replicas
        for r in results[-1]:
            dense_shards = [n for n in r["here"] if n.split("@")[0] in ("a", "c", "d")]
            assert dense_shards and all(r["fused"].get(n) == 2 for n in dense_shards), (r["here"], r["fused"])
            assert "f" not in r["fused"], r["fused"]  # (data-parallel: its rows are all-reduced first)


def test_rows_through_shared_memory_equal_one_process():
    """Every rows' exchange through shared memory, world 3 (through gloo, turned off: the world-2
    test's last case)."""
    cases = [{**BASE, "optimizer": o, "sizes": [5, 5, 5], "shared": True} for o in ("sgd", "rowwise")]
    for case in _check_all(cases, 3):
        assert all(r["shared"] for r in case)


def test_world4_unequal_batches_sum_and_each_sharding_type():
    cases = [{**BASE, "optimizer": "adagrad", "sizes": [5, 0, 7, 3], "reduction": "sum", "dedup": True}]
    cases += [{**BASE, "optimizer": o, "sizes": [3, 3, 3, 3]} for o in ("sgd", "adam")]
    cases += [
        {**BASE, "optimizer": "rowwise", "sizes": [3, 3, 3, 3], "plan": kind}
        for kind in ("table_wise", "row_wise", "table_row_wise", "data_parallel")
    ]
    cases.append({**BASE, "optimizer": "rowwise", "sizes": [3, 3, 3, 3], "plan": "column_wise"})
    _check_all(cases, 4)


def test_each_sharding_type_world2():
    cases = [
        {**BASE, "optimizer": o, "sizes": [4, 4], "plan": kind}
        for kind in ("table_wise", "column_wise", "row_wise", "table_row_wise", "data_parallel")
        for o in ("adam", "rowwise")
    ]
    _check_all(cases, 2)


def _bad_input(rank: int, world: int) -> str:
    tables = _tables(False)
    features = {f: t for f, t in FEATURES.items() if t != "e"}
    ec = ShardedCollection(tables, features, _plan(world, tables))
    before = {t.name: ec.gather_table(t.name) for t in tables}
    b = _batch(0, 4, features, False)
    if rank == 1:
        b["c"] = he.Jagged(torch.tensor([0, 37]), torch.tensor([0, 1, 2, 2, 2]))
    try:
        ec(b)
    except he.InvalidInputError as e:
        msg = str(e)
    else:
        msg = "no error"
    after = {t.name: ec.gather_table(t.name) for t in tables}
    assert all(torch.equal(before[n], after[n]) for n in before)
    ec(_batch(1, 4, features, False))  # the job goes on
    small = he.TableConfig("small", 10, 4)  # only replicated tables: nothing is exchanged but the verdict
    dp = ShardedCollection([small], plan=Plan(world, (shard_table(small, "data_parallel", tuple(range(world))),)))
    try:
        dp({"small": torch.tensor([1, 10 if rank == 1 else 2])})
    except he.InvalidInputError as e:
        msg += " | " + str(e)
    return msg


def test_bad_input_on_one_rank_raises_on_every_rank_and_changes_nothing():
    msgs = spawn(_bad_input, 2, timeout=120)
    assert "out of range" in msgs[1] and "'c'" in msgs[1] and "'small'" in msgs[1].split(" | ")[1]
    assert "rank(s) 1" in msgs[0] and "rank(s) 1" in msgs[0].split(" | ")[1]


def _disagree(rank: int, world: int) -> None:
    tables = [he.TableConfig("a", 10 + rank, 4)]
    ShardedCollection(tables, plan=Plan(world, (shard_table(tables[0], "table_wise", (0,)),)))


def test_ranks_disagreeing_on_the_model_are_named():
    with pytest.raises(
        SpawnError,
        match=r"ranks disagree on the model: tables\.a\.rows: 10 on rank 0, 11 on rank 1; every rank builds the whole",
    ):
        spawn(_disagree, 2, timeout=60)


def test_without_a_process_group_is_refused():
    with pytest.raises(he.ConfigError, match="init_process_group"):
        ShardedCollection([he.TableConfig("a", 10, 4)])


def _empty_rank(rank: int, world: int) -> list:
    """Rank 1 holds no shard: its optimizer has nothing to update but joins every exchange."""
    t = he.TableConfig("a", 20, 4)
    ec = ShardedCollection([t], plan=Plan(world, (shard_table(t, "table_wise", (0,)),)))
    model = nn.ModuleDict({"ec": ec, "dense": nn.Linear(1, 1)})
    opt = he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model)
    for step in range(2):
        ids = torch.tensor([step, 3, 5]) if rank == 0 else torch.tensor([7, 3])
        opt.zero_grad()
        ec({"a": ids})["a"].pow(2).sum().backward()
        opt.step()
    return ec.gather_table("a")


def test_a_rank_without_shards_trains_with_the_others():
    got = spawn(_empty_rank, 2, timeout=120)
    ref = he.EmbeddingCollection([he.TableConfig("a", 20, 4)])
    opt = torch.optim.Adagrad(ref.parameters(), lr=0.1)
    opt = he.wrap_optimizer(opt, ref)
    for step in range(2):
        opt.zero_grad()
        (ref({"a": torch.tensor([step, 3, 5, 7, 3])})["a"].pow(2).sum() / 2).backward()
        opt.step()
    torch.testing.assert_close(got[0], ref.weight("a"))
    torch.testing.assert_close(got[1], ref.weight("a"))


class _Bags(nn.Module):
    """Five one-hot ``nn.EmbeddingBag`` layers of different sizes, each called with (B, 1) ids."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embs = nn.ModuleList(nn.EmbeddingBag(n, 4, mode="sum") for n in (30, 40, 50, 60, 70))

    def forward(self, ids: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([e(x) for e, x in zip(self.embs, ids)], 1)


def _one_hot_faults(rank: int, world: int, fold_rows: int, shared: bool = True) -> dict:
    """A converted model of one-hot bags (their ids checked in one batched pass): an id past the
    last of five tables on rank 1 only, then an owner's lookup failing on rank 1 only (its status
    in the rows' all-to-all, or with ``fold_rows`` 0 in the shared-memory meeting, or without
    ``shared`` in an all-to-all of its own): every rank raises, no row changes, the job goes on."""
    import os

    from hybridembed.distributed import runtime, shm

    runtime.FOLD_ROWS = fold_rows
    os.environ[shm.ENV] = "1" if shared else "0"
    names = [f"embs__{i}" for i in range(5)]
    tables = [he.TableConfig(n, r, 4) for n, r in zip(names, (30, 40, 50, 60, 70))]
    plan = Plan(world, tuple(shard_table(t, "table_wise", (i % world,)) for i, t in enumerate(tables)))
    model = he.distribute(_Bags(), plan)
    ec = next(m for m in model.modules() if isinstance(m, ShardedCollection))
    opt = he.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.5), model)
    before = {n: ec.gather_table(n) for n in names}
    g = torch.Generator().manual_seed(rank)
    ids = [torch.randint(0, r, (6, 1), generator=g) for r in (30, 40, 50, 60, 70)]
    errors = []
    if rank == 1:
        ids[4] = ids[4].clone()
        ids[4][5, 0] = 70  # (one past the last row, in the last feature)
    try:
        model(ids)
    except he.InvalidInputError as e:
        errors.append(str(e))
    ids[4] = ids[4].clamp_max(69)
    real = ShardedCollection._own_lookups

    def failing(self, *a, **k):
        raise RuntimeError("planted owner failure")

    if rank == 1:
        ShardedCollection._own_lookups = failing
    try:
        model(ids)
    except Exception as e:  # (the failing owner raises its own error; the others name it)
        errors.append(str(e))
    finally:
        ShardedCollection._own_lookups = real
    same = all(torch.equal(before[n], ec.gather_table(n)) for n in names)
    opt.zero_grad()
    model(ids).pow(2).sum().backward()  # the job goes on
    opt.step()
    return {"errors": errors, "same": same, "changed": not torch.equal(before[names[0]], ec.gather_table(names[0]))}


@pytest.mark.parametrize(
    "fold_rows,shared", [(1 << 18, True), (0, True), (0, False)], ids=["status-with-rows", "shared", "status-alone"]
)
def test_one_hot_bags_bad_id_and_a_failing_owner_raise_on_every_rank(fold_rows, shared):
    got = spawn(_one_hot_faults, 2, fold_rows, shared, timeout=120)
    for r in got:
        assert r["same"] and r["changed"], r
        assert len(r["errors"]) == 2, r["errors"]
    assert "embs__4" in got[1]["errors"][0] and "rank(s) 1" in got[0]["errors"][0]
    assert "lookup failed on rank(s) 1" in got[0]["errors"][1] and "planted owner failure" in got[0]["errors"][1]
    assert got[1]["errors"][1] == "planted owner failure"


def test_the_received_rows_split_into_matrices_carry_their_gradients_back():
    """The requester's pieces of the flat received rows (runs of one width split from one view):
    values and gradients equal one view per piece, for mixed widths and empty pieces."""
    from hybridembed.distributed.runtime import _matrices

    shapes = [(3, 4), (2, 4), (5, 2), (0, 2), (1, 4), (2, 3)]
    flat = torch.randn(sum(n * w for n, w in shapes), dtype=torch.float64, requires_grad=True)
    ref = flat.detach().clone().requires_grad_(True)
    got = _matrices(flat, shapes)
    want = [p.view(n, w) for p, (n, w) in zip(ref.split([n * w for n, w in shapes]), shapes)]
    assert [tuple(x.shape) for x in got] == shapes
    ups = [torch.randn(n, w, dtype=torch.float64) for n, w in shapes]
    sum((x * u).sum() for x, u in zip(got[:-1], ups)).backward()  # (the last piece unused: zero gradient)
    sum((x * u).sum() for x, u in zip(want[:-1], ups)).backward()
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    assert torch.equal(flat.grad, ref.grad) and not flat.grad[-6:].any()
