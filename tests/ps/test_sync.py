"""Synchronous parameter servers equal one process: 2 trainers + 1 or 2 servers (spawned gloo
jobs) train K steps, save, train K more; every table (dense and dynamic; SGD with momentum,
Adagrad, row-wise Adagrad, Adam), the MLP and the checkpoint equal one uninterrupted process on
the concatenated batches within 1e-5. The checkpoint loads in one process and in a new job."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridembed as he
from hybridembed.distributed import Plan, health, shard_table, unwrap
from hybridembed.launch import spawn
from hybridembed.ps import PSCollection
from tests.distributed.test_checkpoint import _close, _snapshot
from tests.distributed.test_distribute import Plain, _slice, _train
from tests.distributed.test_distribute import _batch as _plain_batch
from tests.distributed.test_reshard import K, N, Ranker, _optimizer, _reference, _steps, _tables
from tests.procs import a_forked_child_ends

T = 2  # trainers


def _server_plan(servers: int) -> Plan | None:
    """One server: the planner's. Two: row blocks, residues, hash shards and whole tables."""
    if servers == 1:
        return None
    t = {x.name: x for x in _tables()}
    kinds = {
        "a": ("row_wise", (0, 1), "block"),
        "b": ("row_wise", (0, 1), "mod"),
        "c": ("table_wise", (1,), None),
        "d": ("row_wise", (0, 1), "block"),
        "e": ("row_wise", (0, 1), None),
        "f": ("table_wise", (0,), None),
    }
    tables = [shard_table(t[n], k, on, **({"placement": p} if p else {})) for n, (k, on, p) in kinds.items()]
    return Plan(2, tuple(tables))


def _ps_model(servers: int):
    model = he.distribute(Ranker(), plan=_server_plan(servers), servers=servers, server_exit=False)
    if model is None:
        return None, None
    return model, _optimizer(model)


def _train_save_train(rank: int, world: int, path: str, servers: int) -> dict:
    model, opt = _ps_model(servers)
    if model is None:
        return {"server": True}
    ec = unwrap(model).ec
    assert isinstance(ec, PSCollection) and ec.servers == list(range(T, world))
    _steps(model, opt, range(K), rank, T)
    a_forked_child_ends(failing=True)  # (the trainer's servers, cache, groups and store are not the child's)
    he.save(path, model, opt)
    saved = _snapshot(model)
    torch.distributed.barrier(model.process_group)  # (no trainer's next lookup before both have read)
    assert health.heartbeat().failures(list(range(world))) == {}  # (the children's errors are their own)
    _steps(model, opt, range(K, 2 * K), rank, T)
    out = {"saved": saved, "final": _snapshot(model), "stats": ec.stats(), "servers": ec.server_stats()}
    ec.close()
    return out


def _load_train(rank: int, world: int, path: str, servers: int) -> dict:
    model, opt = _ps_model(servers)
    if model is None:
        return {"server": True}
    he.load(path, model, opt)
    loaded = _snapshot(model)
    torch.distributed.barrier(model.process_group)
    _steps(model, opt, range(K, 2 * K), rank, T)
    return {"loaded": loaded, "final": _snapshot(model)}


@pytest.mark.parametrize("servers", [1, 2])
def test_sync_servers_equal_one_process_and_checkpoint_anywhere(tmp_path, servers):
    saved, final = _reference()
    path = str(tmp_path / "ckpt")
    results = spawn(_train_save_train, T + servers, path, servers, timeout=240)
    for r in results[:T]:
        _close(r["saved"], saved, 1e-5)
        _close(r["final"], final, 1e-5)
    assert all(r == {"server": True} for r in results[T:])
    stats, per_server = results[0]["stats"], results[0]["servers"]
    assert stats["step"] == 2 * K and stats["bytes_sent"] > 0 and stats["bytes_received"] > 0
    assert all(s["errors"] == 0 and s["applied_steps"] == 2 * K for s in per_server)
    assert sum(len(s["tables"]) for s in per_server) >= 6  # every table (or its shards) on a server
    # the checkpoint is a sharded checkpoint of the whole job: it loads in one process ...
    from hybridembed.checkpoint import read_manifest

    m = read_manifest(path)
    assert m["world_size"] == T + servers
    model, opt = Ranker(), None
    opt = _optimizer(model)
    he.load(path, model, opt)
    _close(_snapshot(model), saved, 1e-5)
    # ... and in a new parameter-server job, which resumes exactly
    if servers == 2:
        for r in spawn(_load_train, T + servers, path, servers, timeout=240)[:T]:
            _close(r["loaded"], saved, 1e-5)
            _close(r["final"], final, 1e-5)


class Shared(nn.Module):
    """Two features reading one table, dense and dynamic (watched and browsed videos)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        tables = [
            he.TableConfig("video", 50, 4, combiner="mean"),
            he.TableConfig("query", None, 4, dynamic=he.Dynamic(min_count=1)),
        ]
        features = {"watched": "video", "browsed": "video", "q1": "query", "q2": "query"}
        self.ec = he.EmbeddingCollection(tables, features, seed=2)
        self.mlp = nn.Linear(16, 1)

    def forward(self, x):
        out = self.ec(x)
        return self.mlp(torch.cat([out[f] for f in ("watched", "browsed", "q1", "q2")], 1)).squeeze(1)


def _train_shared(model: nn.Module, steps: int, lo: int, hi: int):
    """``steps`` Adagrad steps on rows ``[lo, hi)`` of each batch; returns the optimizer."""
    opt = he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model)
    for s in range(steps):
        x, y = _shared_batch(s, lo, hi)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return opt


def _shared_batch(step: int, lo: int, hi: int):
    g = torch.Generator().manual_seed(900 + step)
    x = {}
    for f, rows in (("watched", 50), ("browsed", 50), ("q1", 10**12), ("q2", 10**12)):
        ids = torch.randint(0, rows, (8, 3), generator=g)
        if rows > 100:
            ids = ids % 40 - 20  # (negative ids: any int64 is a key)
        else:
            ids[torch.rand(8, 3, generator=g) < 0.3] = -1
        x[f] = ids[lo:hi]
    return x, torch.rand(8, generator=g)[lo:hi]


def _shared_job(rank: int, world: int, which: str, path: str = "") -> dict:
    if which == "plain":  # nn.Embedding(Bag) layers, SGD, an LR scheduler
        model = he.distribute(Plain(), servers=world - T, server_exit=False)
        if model is None:
            return {}
        opt = he.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        per = 8 // T
        for s in range(4):
            _train(model, [_slice(*_plain_batch(s, 8), rank * per, (rank + 1) * per)], opt)
            sched.step()
        ec = unwrap(model).hybridembed
        out = {n: ec.gather_table(n) for n in ec.tables} | {"mlp": unwrap(model).mlp[0].weight.detach()}
        out["state_dict"] = {k: v.clone() for k, v in unwrap(model).state_dict().items()}  # (the plain model's keys)
        try:
            unwrap(model).load_state_dict(out["state_dict"])
        except RuntimeError as e:  # (tables on servers: loaded by he.load, never silently dropped)
            out["load_error"] = str(e)
        he.export(model, path, (_plain_batch(9, 8)[0],))  # (trainers only: the servers are serving)
        return out
    model = he.distribute(Shared(), servers=world - T, server_exit=False)
    if model is None:
        return {}
    _train_shared(model, 4, rank * 4, rank * 4 + 4)
    return _snapshot(model)


def test_shared_tables_and_a_plain_model_with_a_scheduler_exported(tmp_path):
    model = Shared()
    _train_shared(model, 4, 0, 8)
    ref = _snapshot(model)
    _close(spawn(_shared_job, T + 1, "shared", timeout=240)[0], ref, 1e-5)

    plain = Plain()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for s in range(4):
        _train(plain, [_plain_batch(s, 8)], opt)
        sched.step()
    served = str(tmp_path / "served.pt")
    got = spawn(_shared_job, T + 2, "plain", served, timeout=240)[0]
    for n in ("user", "items", "city", "tags"):
        torch.testing.assert_close(got[n], getattr(plain, n).weight.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["mlp"], plain.mlp[0].weight.detach(), atol=1e-5, rtol=1e-5)
    # a trainer's state_dict(): the plain model's keys, the tables pulled from the servers (DLRM's --save-model)
    want = plain.state_dict()
    assert sorted(got["state_dict"]) == sorted(want)
    for k, v in want.items():
        torch.testing.assert_close(got["state_dict"][k], v, atol=1e-5, rtol=1e-5, msg=k)
    assert "lives on the parameter servers" in got["load_error"] and "he.load" in got["load_error"]
    x = _plain_batch(9, 8)[0]  # the exported plain model serves what one process computes
    with torch.no_grad():
        torch.testing.assert_close(torch.jit.load(served)(x), plain.eval()(x), atol=1e-5, rtol=1e-5)


def test_without_a_process_group_the_servers_are_this_process():
    model = he.distribute(Shared(), servers=2)
    assert isinstance(model.ec, he.EmbeddingCollection) and not isinstance(model.ec, PSCollection)
    ref = Shared()
    for m in (model, ref):
        opt = he.wrap_optimizer(torch.optim.Adagrad(m.parameters(), lr=0.1), m)
        x, y = _shared_batch(0, 0, 8)
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
    _close(_snapshot(model), _snapshot(ref), 0)


def _server_frees(rank: int, world: int) -> dict:
    import gc
    import weakref

    import hybridembed.ps as ps

    model = Shared()
    whole = weakref.ref(model.ec)
    seen = {}
    real = ps.serve

    def serve(*args):  # (what the server holds while it serves)
        gc.collect()
        seen["whole_alive"] = whole() is not None
        real(*args)

    ps.serve = serve
    if he.distribute(model, servers=1, server_exit=False) is None:
        return seen
    return {}


def test_a_server_serves_without_the_unsharded_tables():
    assert spawn(_server_frees, 2, timeout=120)[1] == {"whole_alive": False}


def _prefetching(rank: int, world: int, wrong: bool) -> dict:
    from tests.distributed.test_reshard import _batch

    model, opt = _ps_model(1)
    if model is None:
        return {}
    ec = unwrap(model).ec
    per = N // T
    kept = []
    for s in range(K):
        x, y = _batch(s, rank * per, (rank + 1) * per)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        # (each group of a fused optimizer keeps its lookups' gradient for the fused step's reduction:
        # no sparse gradient made; the SGD with momentum table's is made at once)
        kept.append([bool(st._deferred) and st.weight.grad is None for st in ec.storages])
        if s + 1 < K:  # (before the step: sent now, answered once this step is applied)
            ec.prefetch(_batch(s + (2 if wrong else 1), rank * per, (rank + 1) * per)[0])
        opt.step()
    return {"tables": _snapshot(model), "stats": ec.stats(), "kept": kept}


@pytest.mark.parametrize("wrong", [False, True])
def test_prefetched_pulls_equal_one_process(wrong):
    saved, _ = _reference()
    for r in spawn(_prefetching, T + 1, wrong, timeout=240)[:T]:
        if wrong:  # (a prefetch is a lookup: the dynamic table made rows for the ids it asked for)
            saved = {k: v for k, v in saved.items() if not k.startswith("e")}
            r["tables"] = {k: v for k, v in r["tables"].items() if not k.startswith("e")}
        _close(r["tables"], saved, 1e-5)
        groups = 6  # (every table has its own optimizer: one storage each)
        hits, misses = r["stats"]["prefetch_hits"], r["stats"]["prefetch_misses"]
        assert (hits, misses) == ((0, (K - 1) * groups) if wrong else ((K - 1) * groups, 0)), (hits, misses)
        assert all(k == r["kept"][0] for k in r["kept"]) and sum(r["kept"][0]) == groups - 1, r["kept"]


class OneHot(nn.Module):
    """DLRM's pattern: one id a bag per table, the pooled rows and a dense part concatenated."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(13)
        self.embs = nn.ModuleList(nn.EmbeddingBag(rows, 4, mode="sum") for rows in (30, 50, 20))
        self.mlp = nn.Linear(16, 1)

    def forward(self, ids: list[torch.Tensor], dense: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([e(x.unsqueeze(1)) for e, x in zip(self.embs, ids)] + [dense], 1)).squeeze(1)


def _one_hot_batch(step: int, lo: int, hi: int):
    g = torch.Generator().manual_seed(700 + step)
    ids = [torch.randint(0, rows, (8,), generator=g)[lo:hi] for rows in (30, 50, 20)]
    return ids, torch.randn(8, 4, generator=g)[lo:hi], torch.rand(8, generator=g)[lo:hi]


def _one_hot_train(model: nn.Module, lo: int, hi: int) -> None:
    opt = he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model)
    for s in range(4):
        ids, dense, y = _one_hot_batch(s, lo, hi)
        opt.zero_grad()
        nn.functional.mse_loss(model(ids, dense), y).backward()
        opt.step()


def _one_hot_job(rank: int, world: int) -> dict:
    from hybridembed.modules import joined

    model = he.distribute(OneHot(), servers=1, server_exit=False)
    if model is None:
        return {}
    made, real = [], joined.prepare
    joined.prepare = lambda *a: made.append(1) or real(*a)
    per = 8 // T
    _one_hot_train(model, rank * per, (rank + 1) * per)
    ec = unwrap(model).hybridembed
    out = {n: ec.gather_table(n) for n in ec.tables} | {"mlp": unwrap(model).mlp.weight.detach()}
    return out | {"joined": len(made)}


def test_a_trainer_s_cat_of_its_pulled_rows_is_made_by_the_lookup_and_equals_one_process():
    """The trainers' ``torch.cat`` of one-hot pooled rows (and a dense part) is made by the lookup of
    the rows pulled from the servers (a joined lookup, its gradient kept): 4 synchronous steps of 2
    trainers equal one process on the whole batches."""
    ref = he.convert(OneHot())  # (one process: the reference)
    _one_hot_train(ref, 0, 8)
    for got in spawn(_one_hot_job, T + 1, timeout=240)[:T]:
        assert got["joined"] == 4  # (one joined lookup a step)
        for k in range(3):
            want = ref.hybridembed.weight(f"embs__{k}")
            torch.testing.assert_close(got[f"embs__{k}"], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["mlp"], ref.mlp.weight.detach(), atol=1e-5, rtol=1e-5)
