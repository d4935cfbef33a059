"""The server's request handler in this process (a world-1 gloo group, no spawn, no
transport): a push of non-finite gradients is refused and changes nothing, whatever its
values sum to; a push of finite gradients whose sum overflows float32 is applied; a pull's
reply bytes are left to the transport to count (once)."""

from __future__ import annotations

import pytest
import torch

import hybridembed as he
from hybridembed.distributed import Plan, ShardedCollection, shard_table
from hybridembed.ps import TableServer, wire
from hybridembed.ps.wire import Message
from tests.procs import world_of_one

TRAINER = 1  # (a rank number only: handle() takes requests without a transport)
LR = 0.5


@pytest.fixture
def group():
    with world_of_one():
        yield


@pytest.fixture
def server(group):
    t = he.TableConfig("a", 10, 4)
    sc = ShardedCollection([t], plan=Plan(1, (shard_table(t, "table_wise", (0,)),)), seed=3)
    srv = TableServer(sc, [TRAINER])
    attach = Message(
        wire.ATTACH,
        1,
        0,
        torch.zeros(0, dtype=torch.int64),
        None,
        {"group": 0, "optimizer": "SGD", "hparams": {"lr": LR}},
    )
    (reply,), _ = srv.handle(TRAINER, *wire.pack(attach))
    assert reply[1].op == wire.OK
    return srv


def _push(srv: TableServer, ids: list[int], grads: torch.Tensor, step: int = 0):
    """A push of rows ``ids`` of the one shard -> the server's replies (none when accepted)."""
    ints = torch.tensor([0, 1, 0, len(ids), *ids], dtype=torch.int64)
    m = Message(wire.PUSH, 10 + step, step, ints, grads.reshape(-1), {"had": [0], "hp": {}})
    replies, _ = srv.handle(TRAINER, *wire.pack(m))
    return replies


def _rows(srv: TableServer) -> torch.Tensor:
    return srv.storages[0].weight.detach().clone()


@pytest.mark.parametrize(
    "bad",
    [[float("nan"), 1.0], [float("inf"), 1.0], [float("-inf"), 1.0], [float("inf"), float("-inf")]],
    ids=["nan", "inf", "-inf", "inf and -inf"],
)
def test_a_push_of_non_finite_gradients_is_refused_and_changes_nothing(server, bad):
    before = _rows(server)
    grads = torch.ones(2, 4)
    grads[:, 0] = torch.tensor(bad)
    (reply,) = _push(server, [2, 7], grads)
    assert reply[1].op == wire.ERROR and "non-finite" in reply[1].meta["error"]
    assert torch.equal(_rows(server), before)
    assert _push(server, [2, 7], torch.ones(2, 4)) == []  # the same step, finite: accepted
    torch.testing.assert_close(_rows(server)[[2, 7]], before[[2, 7]] - LR)


def test_finite_gradients_whose_sum_overflows_are_applied(server):
    before = _rows(server)
    grads = torch.full((3, 4), 3e38)  # finite float32; their sum is inf
    assert not torch.isfinite(grads.sum())
    assert _push(server, [0, 4, 9], grads) == []
    torch.testing.assert_close(_rows(server)[[0, 4, 9]], before[[0, 4, 9]] - LR * grads)
    assert torch.equal(_rows(server)[[1, 2, 3]], before[[1, 2, 3]])


def test_a_pull_counts_its_request_bytes_and_leaves_the_reply_to_the_transport(server):
    ints = torch.tensor([1, 1, 0, 3, 1, 5, 8], dtype=torch.int64)  # train, one shard, 3 ids
    header, payload = wire.pack(Message(wire.PULL, 20, 0, ints))
    before = server.stats()
    ((_, reply),), _ = server.handle(TRAINER, header, payload)
    assert reply.op == wire.OK and reply.floats.numel() == 3 * 4
    after = server.stats()
    assert after["pulled_rows"] - before["pulled_rows"] == 3
    assert after["bytes_in"] - before["bytes_in"] == 8 * wire.HEAD + payload.numel()
    # hybridembed.ps.serve adds the bytes ServerLink.reply sends (header and payload); counting
    # a pull's rows here as well counted them twice
    assert after["bytes_out"] == before["bytes_out"]


def _server_of(trainers: list[int], optimizer: str, hparams: dict) -> TableServer:
    """A server of two tables of 20 rows, shards 0 and 1, in one storage (rows 0..19 and 20..39) for
    ``trainers``, the optimizer attached."""
    ts = [he.TableConfig("a", 20, 4), he.TableConfig("b", 20, 4)]
    sc = ShardedCollection(ts, plan=Plan(1, tuple(shard_table(t, "table_wise", (0,)) for t in ts)), seed=3)
    srv = TableServer(sc, trainers)
    m = Message(
        wire.ATTACH,
        1,
        0,
        torch.zeros(0, dtype=torch.int64),
        None,
        {"group": 0, "optimizer": optimizer, "hparams": hparams},
    )
    (reply,), _ = srv.handle(trainers[0], *wire.pack(m))
    assert reply[1].op == wire.OK
    return srv


def _push_shards(srv: TableServer, src: int, step: int, per_shard: list[list[int]], g: torch.Generator):
    """A push of ``src``'s rows of each shard (local ids as given) -> the replies (none when accepted)."""
    head = [0, len(per_shard)]  # (no flags; then (shard, count) per item, then the ids of each)
    for shard, ids in enumerate(per_shard):
        head += [shard, len(ids)]
    ints = torch.tensor(head + [i for ids in per_shard for i in ids], dtype=torch.int64)
    grads = [torch.randn(len(ids), 4, generator=g) for ids in per_shard]
    m = Message(wire.PUSH, 10 + step, step, ints, torch.cat(grads).reshape(-1), {"had": [0], "hp": {}})
    replies, _ = srv.handle(src, *wire.pack(m))
    return replies


@pytest.mark.parametrize("trainers", [2, 3])
@pytest.mark.parametrize(
    "optimizer, hparams", [("SGD", {"lr": 0.1}), ("RowWiseAdagrad", {"lr": 0.1}), ("Adam", {"lr": 0.01})]
)
@pytest.mark.parametrize("order", ["ascending", "any"])
def test_several_trainers_pushes_are_summed_as_the_rows_are_stepped(
    group, monkeypatch, trainers, optimizer, hparams, order
):
    """A synchronous step's pushes of a dense table, each trainer's rows distinct: summed per row in
    trainer order (``mean``: divided by the trainers) as the update steps each row. Against the
    sums made first (each push scaled by 1 / trainers, then one reduction): the same bits for two
    trainers (halving is exact), within rounding for three; pushes whose ids are not ascending are
    summed first by the fused reduction (the same bits as stepped where they are)."""
    from hybridembed.kernels import cpu_fused

    stepped, real = [], cpu_fused.apply_parts
    monkeypatch.setattr(cpu_fused, "apply_parts", lambda *a: stepped.append(1) or real(*a))
    ranks = list(range(1, trainers + 1))
    got = []
    for ours in (True, False):
        srv = _server_of(ranks, optimizer, hparams)
        if not ours:
            srv._parts = lambda *a: None  # (the pushes summed first, as before)
        for step in range(3):
            for src in reversed(ranks):  # (pushes arrive in any order; summed in trainer order)
                g = torch.Generator().manual_seed(100 * step + src)
                shard0 = torch.randperm(20, generator=g)[: 5 + src].sort().values.tolist()
                shard1 = torch.randperm(20, generator=g)[: 3 * src].sort().values.tolist()
                if order == "any":
                    shard0 = shard0[::-1]
                assert _push_shards(srv, src, step, [shard0, shard1], g) == []
        got.append(_rows(srv))
    assert len(stepped) == (3 if order == "ascending" else 0)
    if trainers == 2:
        assert torch.equal(got[0], got[1])
    else:
        torch.testing.assert_close(got[0], got[1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("order", ["by table", "mixed"])
def test_a_trainer_routes_every_pair_to_its_shard_whatever_the_order_of_tables(group, order):
    """``Client.route``: distinct (table, id) pairs -> per server, per shard, the pairs' positions
    and local ids; pairs that come grouped by table (a dense group's, ids ascending) are taken as
    they lie, others are grouped first: every position once, each to its table's shard."""
    from hybridembed.ps import client as ps_client
    from hybridembed.ps.server import shard_index

    ts = [he.TableConfig("a", 20, 4), he.TableConfig("b", 30, 4), he.TableConfig("c", 10, 4)]
    sc = ShardedCollection(ts, plan=Plan(1, tuple(shard_table(t, "table_wise", (0,)) for t in ts)), seed=3)
    cl = ps_client.Client({}, shard_index(sc), sc.routes(), torch.float32)
    tabs = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2])
    ids = torch.tensor([1, 4, 19, 3, 5, 7, 29, 0, 9])
    if order == "mixed":
        perm = torch.randperm(9, generator=torch.Generator().manual_seed(1))
        tabs, ids = tabs[perm], ids[perm]
    (items,) = cl.route(ids, tabs, [t.name for t in ts]).values()
    seen = torch.cat([pos for _, pos, _ in items])
    assert sorted(seen.tolist()) == list(range(9))
    for ref, pos, local in items:
        assert (tabs[pos] == [t.name for t in ts].index(ref.table)).all() and torch.equal(local, ids[pos])
