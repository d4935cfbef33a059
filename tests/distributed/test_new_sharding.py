"""A new sharding type in one place: a plan function and a Route registered together, and a
world-2 job (the exchange, the parameter servers, a checkpoint) trains like one process.

The toy kind, ``reversed_blocks``: rows in contiguous blocks, the first block on the last rank.
Its route finds an id's shard by arithmetic of its own (``k - 1 - id // block``), not by the
built-in row-wise route's search over block starts."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import hybridembed as he
from hybridembed.distributed import Plan, TablePlan, register_sharding, shard_table, unwrap
from hybridembed.distributed.plan import Shard
from hybridembed.distributed.routes import Rows
from hybridembed.launch import spawn


class ReversedBlocks(Rows):
    """Block b of k holds rows [b * block, (b + 1) * block) and sits on the plan's shard k-1-b."""

    def locate(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = len(self.plan.shards)
        block = -(-self.table.num_embeddings // k)
        b = ids.div(block, rounding_mode="floor")
        return (k - 1) - b, ids - b * block  # (every block holds rows: shard positions are the plan's)


@register_sharding("reversed_blocks", route=ReversedBlocks)
def reversed_blocks(t: he.TableConfig, ranks) -> TablePlan:
    k, n = len(ranks), t.num_embeddings
    block = -(-n // k)
    shards = [
        Shard(r, (k - 1 - i) * block, min((k - i) * block, n), 1, 0, t.embedding_dim) for i, r in enumerate(ranks)
    ]
    return TablePlan(t.name, "reversed_blocks", tuple(shards), "block")


TABLES = [he.TableConfig("a", 40, 4), he.TableConfig("b", 30, 4, combiner="mean")]


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ec = he.EmbeddingCollection(TABLES, seed=7)
        self.mlp = nn.Linear(8, 1)

    def forward(self, x):
        out = self.ec(x)
        return self.mlp(torch.cat([out["a"], out["b"]], 1)).squeeze(1)


def _batch(step: int, rank: int | None):
    g = torch.Generator().manual_seed(100 + step)
    a = torch.randint(0, 40, (8,), generator=g)
    bags = [torch.randint(0, 30, (n,), generator=g).tolist() for n in (1, 3, 0, 2, 2, 1, 4, 1)]
    y = torch.rand(8, generator=g)
    lo, hi = (0, 8) if rank is None else (4 * rank, 4 * rank + 4)
    return {"a": a[lo:hi], "b": he.Jagged.from_lists(bags[lo:hi])}, y[lo:hi]


def _train(model, steps, rank):
    opt = he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model)
    for s in range(steps):
        x, y = _batch(s, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return opt


def _job(rank: int, world: int, path: str, servers: int) -> dict:
    plan = Plan(2, tuple(shard_table(t, "reversed_blocks", ranks=range(2)) for t in TABLES))  # (2 ranks or servers)
    model = he.distribute(Model(), plan=plan, servers=servers or None, server_exit=False)
    if model is None:
        return {}
    opt = _train(model, 4, rank)
    ec = unwrap(model).ec
    out = {n: ec.gather_table(n) for n in ("a", "b")}
    if not servers:
        out["shards"] = [(name, s.row_start, s.row_stop) for name, _, s, _ in ec.shards_here()]
        he.save(path, model, opt)
        dist.barrier()
    return out


def test_a_sharding_type_registered_in_one_place_trains_like_one_process(tmp_path):
    ref = Model()
    ref_opt = _train(ref, 4, None)
    want = {n: ref.ec.weight(n) for n in ("a", "b")}
    ckpt = str(tmp_path / "ckpt")
    for servers in (0, 2):  # the collective exchange, then two parameter servers and two trainers
        results = spawn(_job, 2 + servers, ckpt, servers, timeout=120)
        for r in results[:2]:
            for n in ("a", "b"):
                torch.testing.assert_close(r[n], want[n], atol=1e-5, rtol=1e-5)
        if not servers:  # rank 0 holds the last block, rank 1 the first
            assert results[0]["shards"] == [("a", 20, 40), ("b", 15, 30)], results[0]["shards"]
            assert results[1]["shards"] == [("a", 0, 20), ("b", 0, 15)], results[1]["shards"]
    # the checkpoint of the world-2 job (its shards' spans) loads into one process
    fresh = Model()
    opt = he.wrap_optimizer(torch.optim.Adagrad(fresh.parameters(), lr=0.1), fresh)
    he.load(ckpt, fresh, opt)
    for n in ("a", "b"):
        torch.testing.assert_close(fresh.ec.weight(n), want[n], atol=1e-5, rtol=1e-5)
    assert ref_opt is not None
