"""A distributed converted model's ``torch.cat`` of its tables' rows made by the lookup
(:mod:`hybridembed.distributed.joined`): replicated tables' by the replicas' kernel call, table-wise
ones' by the exchange (through shared memory), against one process on the concatenated batches;
through gloo, or replicated and sharded tables in one cat, the usual path (and the same results)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridembed as he
from hybridembed.distributed import Plan, shard_table
from hybridembed.kernels import cpu_fused
from hybridembed.launch import spawn

pytestmark = pytest.mark.skipif(not cpu_fused.available(), reason="the joined layout is the fused CPU step's")
STEPS, B, VOCAB, DIM = 3, 6, 40, 4


class Joining(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.bot = nn.Linear(3, DIM)
        self.embs = nn.ModuleList(nn.EmbeddingBag(VOCAB, DIM, mode="sum") for _ in range(3))
        self.top = nn.Linear(4 * DIM, 1)

    def forward(self, x, ids):
        t = torch.cat([self.bot(x), *(e(i) for e, i in zip(self.embs, ids))], 1)
        return self.top(t).squeeze(1)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(B, 3, generator=g), [torch.randint(0, VOCAB, (B, 1), generator=g) for _ in range(3)]


def _whole(step: int, world: int):
    parts = [_batch(step, r) for r in range(world)]
    return torch.cat([p[0] for p in parts]), [torch.cat([p[1][k] for p in parts]) for k in range(3)]


def _train(model, batch_of, plain: bool = False) -> None:
    if plain:  # (torch's Adagrad on the tables' dense gradients: untouched rows do not move)
        embs = [p for n, p in model.named_parameters() if n.startswith("embs")]
        dense = [p for n, p in model.named_parameters() if not n.startswith("embs")]
        opt = torch.optim.SGD(dense, lr=0.2)
        both = [opt, torch.optim.Adagrad(embs, lr=0.2)]
    else:
        both = [he.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.2), model, sparse=he.optim.Adagrad(lr=0.2))]
    for step in range(STEPS):
        x, ids = batch_of(step)
        loss = (model(x, ids) ** 2).mean()
        for opt in both:
            opt.zero_grad()
        loss.backward()
        for opt in both:
            opt.step()


def _job(rank: int, world: int, sharding: str, way: str) -> dict:
    import os

    from hybridembed.distributed import exchange, runtime, shm
    from hybridembed.modules import joined

    os.environ[shm.ENV] = "0" if way == "gloo" else "1"
    if way == "shared":  # (rows of any size through shared memory: not folded into gloo's all-to-all)
        runtime.FOLD_ROWS = 0
    made, real = [], (joined.Ready.run, exchange.SharedRowsJoined.apply)

    def counted(self, train):
        made.append(1)
        return real[0](self, train)

    def joined_rows(*a):
        made.append(1)
        return real[1](*a)

    joined.Ready.run, exchange.SharedRowsJoined.apply = counted, joined_rows
    try:
        plain = Joining()
        tables = [he.TableConfig(f"embs__{k}", VOCAB, DIM) for k in range(3)]
        every = tuple(range(world))
        kinds = {"mixed": ["data_parallel", "data_parallel", "table_wise"]}.get(sharding, [sharding] * 3)
        ranks = [every if kind == "data_parallel" else (k % world,) for k, kind in enumerate(kinds)]
        plan = Plan(world, tuple(shard_table(t, kind, r) for t, kind, r in zip(tables, kinds, ranks)))
        model = he.distribute(plain, plan)
        _train(model, lambda step: _batch(step, rank))
    finally:
        joined.Ready.run, exchange.SharedRowsJoined.apply = real
    state = {k: v.detach().clone() for k, v in plain.named_parameters() if not k.startswith("embs")}
    state.update({f"embs.{k}.weight": model.hybridembed.gather_table(f"embs__{k}") for k in range(3)})
    return {"made": len(made), "state": state}


@pytest.mark.parametrize(
    "sharding, way",
    [("data_parallel", "shared"), ("table_wise", "shared"), ("table_wise", "gloo"), ("mixed", "shared")],
)
def test_a_joined_cat_of_a_sharded_job_equals_one_process(sharding, way):
    got = spawn(_job, 2, sharding, way, timeout=120)
    ref = Joining()
    _train(ref, lambda step: _whole(step, 2), plain=True)
    for r in got:
        # every step's cat made by the replicas' kernel call, or by the exchange of the owners' rows
        # through shared memory; through gloo (then the cat after the exchange), or replicated and
        # sharded tables in one cat, never
        assert r["made"] == (STEPS if way == "shared" and sharding != "mixed" else 0)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-5, atol=1e-6, msg=k)
