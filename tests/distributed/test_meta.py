"""A model whose tables are built on the meta device (no rows) is sharded by ``he.distribute``
with each rank making only its shards (from the row-keyed init), and trains as the real model."""

from __future__ import annotations

import torch

import hybridembed as he
from hybridembed.distributed import Plan, shard_table, unwrap
from hybridembed.launch import spawn
from tests.ps.test_memory import Big, _reference, _steps


def _job(rank: int, world: int, rows: int) -> dict:
    t = he.TableConfig("big", rows, 4)
    plan = Plan(world, (shard_table(t, "row_wise", (0, 1)),))
    model = he.distribute(Big(rows, 4), plan=plan)
    assert all(p.device.type == "cpu" for p in model.parameters())
    opt = he.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.5), model)
    _steps(model, opt, rows, rank * 4, (rank + 1) * 4)
    return {"table": unwrap(model).ec.gather_table("big"), "head": unwrap(model).head.weight.detach().clone()}


def test_a_meta_model_distributed_trains_as_the_real_one():
    table, head = _reference(60)
    for r in spawn(_job, 2, 60, timeout=120):
        torch.testing.assert_close(r["table"], table, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(r["head"], head, atol=1e-6, rtol=1e-5)
