"""``torch.distributed.checkpoint`` (DCP), the ecosystem's format, on a distributed model: its
``state_dict()`` has the plain model's keys with the sharded tables as ShardedTensors; saved at
world 2, it loads into a plain one-process model and into a job of 3 under another plan, and
each serves what the world-2 model served. ``load_state_dict`` of a one-process state_dict into
a distributed model copies each rank's slices."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import hybridembed as he
from hybridembed.distributed import Plan, shard_table, unwrap
from hybridembed.launch import spawn

from .test_distribute import N, Plain, _batch, _slice, _train

KEYS = ["city.weight", "items.weight", "mlp.0.bias", "mlp.0.weight", "mlp.2.bias", "mlp.2.weight", "tags.weight", "user.weight"]  # fmt: skip


def _plan(world: int) -> Plan:
    """Every rectangle DCP reshards: row blocks, a whole table on one rank, column slices, replicated."""
    t = {n: he.TableConfig(n, r, 8) for n, r in (("user", 40), ("items", 60), ("city", 20), ("tags", 30))}
    ranks = tuple(range(world))
    return Plan(
        world,
        (
            shard_table(t["user"], "row_wise", ranks, placement="block"),
            shard_table(t["items"], "table_wise", (world - 1,)),
            shard_table(t["city"], "data_parallel", ranks),
            shard_table(t["tags"], "column_wise", ranks),
        ),
    )


def _probe():
    return _batch(99, 6)[0]


def _save_at_2(rank: int, world: int, path: str) -> dict:
    model = he.distribute(Plain(), plan=_plan(world))
    opt = he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model)
    per = N // world
    for s in range(2):
        _train(model, [_slice(*_batch(s, N), rank * per, (rank + 1) * per)], opt)
    sd = unwrap(model).state_dict()
    kinds = {k: type(v).__name__ for k, v in sd.items()}
    dcp.save(sd, checkpoint_id=path)
    model.eval()
    with torch.no_grad():
        out = model(_probe())
    return {"keys": sorted(sd), "kinds": kinds, "out": out}


def _load_at_3(rank: int, world: int, path: str) -> dict:
    model = he.distribute(Plain(), plan=_plan(world))  # (another plan: 3 row blocks, 3 column slices)
    sd = unwrap(model).state_dict()
    dcp.load(sd, checkpoint_id=path)
    unwrap(model).load_state_dict(sd)
    model.eval()
    with torch.no_grad():
        out = model(_probe())
    # a one-process state_dict (whole tensors) loads into the distributed model: each rank its slices
    plain = Plain()
    twin = he.distribute(Plain(), plan=_plan(world))
    unwrap(twin).load_state_dict(plain.state_dict())
    twin.eval()
    plain.eval()
    with torch.no_grad():
        twin_out, plain_out = twin(_probe()), plain(_probe())
    dist.barrier()
    return {"out": out, "twin": twin_out, "plain": plain_out}


def test_dcp_saved_at_world_2_loads_in_one_process_and_at_world_3(tmp_path):
    path = str(tmp_path / "dcp")
    saved = spawn(_save_at_2, 2, path, timeout=240)
    assert saved[0]["keys"] == KEYS  # the plain model's keys
    assert saved[0]["kinds"]["user.weight"] == "ShardedTensor" and saved[0]["kinds"]["city.weight"] == "Tensor"
    want = saved[0]["out"]
    torch.testing.assert_close(saved[1]["out"], want)
    # one process, no hybridembed in the model: DCP reads the shards into plain tensors
    plain = Plain()
    sd = plain.state_dict()
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    plain.load_state_dict(sd)
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(_probe()), want, atol=1e-6, rtol=1e-5)
    for r in spawn(_load_at_3, 3, path, timeout=240):
        torch.testing.assert_close(r["out"], want, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(r["twin"], r["plain"], atol=1e-6, rtol=1e-5)
