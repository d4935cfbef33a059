"""``ec.prefetch(next batch)``: the next forward's ids sent ahead, in a background thread, while
this step computes. Trained so, a job equals one process; a rank whose next forward is not the
one prefetched, whose prefetched input is bad, or whose forward fails makes every rank raise, and
the job goes on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridembed as he
from hybridembed.distributed import Plan, ShardedCollection, shard_table, unwrap
from hybridembed.launch import spawn

from .test_runtime import FEATURES, _batch, _check, _loss, _opt, _plan, _projections, _slice, _tables


def _run_pipelined(rank: int, world: int, case: dict) -> dict:
    tables = _tables(case["dynamic"])
    features = {f: t for f, t in FEATURES.items() if any(t == x.name for x in tables)}
    plan = _plan(world, tables, case["plan"], case["optimizer"])
    ec = ShardedCollection(tables, features, plan, seed=3, dedup=case["dedup"], reduction=case["reduction"])
    sizes, lo = case["sizes"], sum(case["sizes"][:rank])
    batches = []
    for step in range(case["steps"]):
        full = _batch(step, sum(sizes), features, case["weighted"])
        batches.append({f: _slice(j, lo, lo + sizes[rank]) for f, j in full.items()})
    model = nn.ModuleDict({"ec": ec, "dense": nn.Linear(1, 1)})
    opt, proj = _opt(case["optimizer"], model), _projections(features)
    taken = []
    for i, b in enumerate(batches):
        if case.get("reorder") and ec.prefetched:  # the forward's lookups in another order than prefetched
            names = list(reversed(features))
            out = dict(zip(names, ec.lookup_many([(f, b[f]) for f in names])))
        else:
            out = ec(b)
        if i + 1 < len(batches):
            ec.prefetch(batches[i + 1])  # (the next batch's ids cross while this step computes)
        taken.append(ec.prefetched)
        opt.zero_grad()
        _loss(out, proj, 1.0 / sizes[rank] if case["reduction"] == "mean" else 1.0).backward()
        opt.step()
    ec.eval()
    probe = _batch(99, sum(sizes), features, case["weighted"])
    mine = ec({f: _slice(j, lo, lo + sizes[rank]) for f, j in probe.items()})
    return {
        "tables": {t.name: ec.gather_table(t.name) for t in tables},
        "out": {f: (x.values if isinstance(x, he.Jagged) else x) for f, x in mine.items()},
        "prefetched": taken,
    }


def _cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    return [_run_pipelined(rank, world, c) for c in cases]


BASE = {
    "dynamic": True,
    "plan": "mixed",
    "reduction": "mean",
    "steps": 4,
    "weighted": True,
    "optimizer": "adagrad",
    "dedup": False,
}


def test_a_pipelined_job_equals_one_process():
    """Every sharding type (and replicated, dynamic, weighted, mean/sqrtn/none), unequal batches
    (summed gradients); with dedup; and a forward whose lookups come in another order than
    prefetched."""
    cases = [
        {**BASE, "sizes": [3, 5], "reduction": "sum"},
        {**BASE, "sizes": [4, 4], "dedup": True, "optimizer": "rowwise"},
        {**BASE, "sizes": [4, 4], "reorder": True, "optimizer": "sgd"},
        {**BASE, "sizes": [3, 3], "plan": "data_parallel", "dynamic": False},  # nothing crosses
    ]
    for case, results in zip(cases, zip(*spawn(_cases, 2, cases, timeout=240))):
        _check(case, list(results))
        for r in results:
            assert r["prefetched"] == [True] * (case["steps"] - 1) + [False]


def _table_now(ec, name: str):
    got = ec.gather_table(name)
    return got if isinstance(got, tuple) else (got,)


def _faults(rank: int, world: int, kind: str) -> dict:
    tables = _tables(not kind.endswith("replicated"))  # (a dynamic table: a peer's lookup would add rows)
    features = {f: t for f, t in FEATURES.items() if any(t == x.name for x in tables)}
    plan = (
        Plan(world, tuple(shard_table(t, "data_parallel", tuple(range(world))) for t in tables))
        if kind.endswith("replicated")
        else _plan(world, tables)
    )
    ec = ShardedCollection(tables, features, plan)
    model = nn.ModuleDict({"ec": ec, "dense": nn.Linear(1, 1)})
    opt, proj = _opt("sgd", model), _projections(features)
    b0, b1, b2 = (_batch(s, 4, features, False) for s in range(3))
    ec(b0)
    before = {t.name: _table_now(ec, t.name) for t in tables}
    msg = "no error"
    try:
        if kind == "bad_prefetch" and rank == 1:
            bad = dict(b1)
            bad["c"] = he.Jagged(torch.tensor([0, 37]), torch.tensor([0, 1, 2, 2, 2]))  # (checked in the thread)
            ec.prefetch(bad)
        elif kind == "bad_structure" and rank == 1:
            bad = {**b1, "c": torch.tensor([0.5, 1.5])}  # (not ids at all: refused in prefetch too)
            try:
                ec.prefetch(bad)
            except he.InvalidInputError as e:
                msg = f"prefetch: {e} | "
        else:
            ec.prefetch(b1)
        if kind.startswith("mismatch") and rank == 1:
            ec(b2)  # not what it prefetched
        elif kind == "inplace" and rank == 1:
            b1["a"].values.add_(1).remainder_(50)  # (changed in place after the prefetch: not what was sent)
            ec(b1)
        elif kind == "forward_fails" and rank == 1:
            ec.step_failed(RuntimeError("the dense part raised"))
            raise RuntimeError("the dense part raised")
        else:
            ec(b1)
    except Exception as e:  # noqa: BLE001
        msg += f"{type(e).__name__}: {e}"
    after = {t.name: _table_now(ec, t.name) for t in tables}
    for n in before if kind != "double" else ():  # (nothing looked up on any rank: not a row made in the dynamic table)
        assert all(torch.equal(x, y) for x, y in zip(before[n], after[n])), f"table {n} changed"
    assert not ec.prefetched
    ec.prefetch(b2)  # the job goes on: a pipelined step trains
    opt.zero_grad()
    _loss(ec(b2), proj, 0.25).backward()
    opt.step()
    if kind == "double":
        ec.prefetch(b0)
        try:
            ec.prefetch(b1)
        except he.HybridEmbedError as e:
            msg = str(e)
        ec(b0)
    return {"msg": msg, "a": ec.gather_table("a")}


@pytest.mark.parametrize(
    "kind", ["mismatch", "mismatch_replicated", "inplace", "bad_prefetch", "bad_structure", "forward_fails", "double"]
)
def test_a_rank_failing_around_a_prefetch_makes_every_rank_raise(kind):
    got = spawn(_faults, 2, kind, timeout=120)
    m0, m1 = got[0]["msg"], got[1]["msg"]
    assert torch.equal(got[0]["a"], got[1]["a"])
    if kind == "double":
        assert "already waiting" in m0 and "already waiting" in m1
        return
    if kind.startswith("mismatch") or kind == "inplace":
        assert "not the ones prefetched" in m1 and "rank 1" in m1
        assert "rank(s) 1 did not take this step's prefetched lookups (rank 1: this forward's" in m0, m0
    elif kind == "bad_prefetch":
        assert m1.startswith("no errorInvalidInputError") and "out of range" in m1 and "'c'" in m1  # (at the forward)
        assert "InvalidInputError" in m0 and "rank(s) 1" in m0 and "out of range" in m0
    elif kind == "bad_structure":
        assert m1.startswith("prefetch: ") and "'c'" in m1 and m1.count("InvalidInputError") == 1, m1
        assert "InvalidInputError" in m0 and "rank(s) 1" in m0 and "'c'" in m0
    else:
        assert "the dense part raised" in m1 and "rank(s) 1" in m0 and "the dense part raised" in m0


def _next_inputs(x: dict) -> dict:
    """``he.prefetch``'s map of the layers of ``Plain`` to what its forward gives them."""
    return {
        "user": x["user"].unsqueeze(1),
        "items": (x["items"], x["items_off"]),
        "city": x["city"],
        "tags": (x["tags"], x["tags_off"], x["tags_w"]),
    }


def _distributed_pipelined(rank: int, world: int) -> dict:
    from .test_distribute import STEPS, N, Plain, _batch, _plan, _slice

    model = he.distribute(Plain(), plan=_plan(world))
    opt = he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    per = N // world
    batches = [_slice(*_batch(s, N), rank * per, (rank + 1) * per) for s in range(STEPS)]
    ec = unwrap(model).hybridembed
    taken = []
    for i, (x, y) in enumerate(batches):
        loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
        if i + 1 < len(batches):
            he.prefetch(model, _next_inputs(batches[i + 1][0]))
        taken.append(ec.prefetched)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    bad = None
    try:  # not a layer of the model: refused before anything is sent
        he.prefetch(model, {"mlp": batches[0][0]["city"]})
    except he.ConfigError as e:
        bad = str(e)
    return {"tables": {n: ec.gather_table(n) for n in ec.tables}, "taken": taken, "bad": bad}


def test_he_prefetch_of_a_distributed_plain_model_equals_one_process():
    from .test_distribute import _reference

    ref = _reference()
    results = spawn(_distributed_pipelined, 2, timeout=120)
    for name, w in ref["tables"].items():
        torch.testing.assert_close(results[0]["tables"][name], w, atol=1e-5, rtol=1e-5)
    assert results[0]["taken"] == [True, True, True, False]
    assert "'mlp' is a Sequential, not a converted embedding layer" in results[0]["bad"]


def _weight_grads(rank: int, world: int, pipelined: bool) -> list:
    """Per-id weights that require grad, on a replicated and a sharded table: their gradients the
    same pipelined or not (the forward's own weights pool, not the prefetch's copy)."""
    tables = [he.TableConfig("f", 10, 4), he.TableConfig("c", 37, 4)]
    plan = Plan(world, (shard_table(tables[0], "data_parallel", (0, 1)), shard_table(tables[1], "table_wise", (1,))))
    ec = ShardedCollection(tables, plan=plan, seed=1)
    grads = []
    batches = []
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        w = (torch.rand(6, generator=g) + 0.5).requires_grad_()
        ids = {
            n: he.Jagged.from_lengths(torch.randint(0, 10, (6,), generator=g), torch.tensor([2, 1, 3]), w) for n in "fc"
        }
        batches.append((ids, w))
    for i, (ids, w) in enumerate(batches):
        out = ec(ids)
        if pipelined and i + 1 < len(batches):
            ec.prefetch(batches[i + 1][0])
        sum(x.pow(2).sum() for x in out.values()).backward()
        grads.append(w.grad.clone())
    return grads


def test_per_id_weights_get_their_gradients_through_a_prefetched_step():
    plain = spawn(_weight_grads, 2, False, timeout=60)
    piped = spawn(_weight_grads, 2, True, timeout=60)
    for a, b in zip(plain, piped):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
