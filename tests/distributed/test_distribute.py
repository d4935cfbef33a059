"""``he.distribute`` of a plain PyTorch model: the training loop unchanged, world N equal to
the same plain model trained in one process on the concatenated batches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridembed as he
from hybridembed.distributed import Plan, ShardedCollection, health, shard_table, unwrap
from hybridembed.launch import spawn
from tests.procs import a_forked_child_ends


class Plain(nn.Module):
    """What users have: separate embedding layers called one by one, then an MLP."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.user = nn.EmbeddingBag(40, 8, mode="sum")
        self.items = nn.EmbeddingBag(60, 8, mode="mean")
        self.city = nn.Embedding(20, 8)
        self.tags = nn.EmbeddingBag(30, 8, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(33, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        u = self.user(x["user"].unsqueeze(1))
        i = self.items(x["items"], x["items_off"])
        c = self.city(x["city"])
        t = self.tags(x["tags"], x["tags_off"], per_sample_weights=x["tags_w"])
        return self.mlp(torch.cat([u, i, c, t, x["dense"]], 1)).squeeze(1)


def _batch(step: int, n: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)

    def bags(rows: int):
        lengths = torch.randint(0, 4, (n,), generator=g)
        ids = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
        return ids, torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])[:-1], lengths

    items, items_off, items_len = bags(60)
    tags, tags_off, tags_len = bags(30)
    x = {
        "user": torch.randint(0, 40, (n,), generator=g),
        "items": items,
        "items_off": items_off,
        "items_len": items_len,
        "city": torch.randint(0, 20, (n,), generator=g),
        "tags": tags,
        "tags_off": tags_off,
        "tags_len": tags_len,
        "tags_w": torch.rand(tags.numel(), generator=g),
        "dense": torch.randn(n, 1, generator=g),
    }
    return x, torch.randint(0, 2, (n,), generator=g).float()


def _slice(x: dict, y: torch.Tensor, lo: int, hi: int) -> tuple[dict, torch.Tensor]:
    out = {k: x[k][lo:hi] for k in ("user", "city", "dense")}
    for f in ("items", "tags"):
        lens = x[f + "_len"]
        a, b = int(lens[:lo].sum()), int(lens[:hi].sum())
        out[f] = x[f][a:b]
        part = lens[lo:hi]
        out[f + "_off"] = torch.cat([torch.zeros(1, dtype=torch.int64), part.cumsum(0)])[:-1]
        out[f + "_len"] = part
    out["tags_w"] = x["tags_w"][int(x["tags_len"][:lo].sum()) : int(x["tags_len"][:hi].sum())]
    return out, y[lo:hi]


def _plan(world: int) -> Plan:
    t = {n: he.TableConfig(n, r, 8) for n, r in (("user", 40), ("items", 60), ("city", 20), ("tags", 30))}
    ranks = tuple(range(world))
    return Plan(
        world,
        (
            shard_table(t["user"], "row_wise", ranks, placement="mod"),
            shard_table(t["items"], "table_wise", (world - 1,)),
            shard_table(t["city"], "row_wise", ranks, placement="mod"),  # (nn.Embedding: one id per bag)
            shard_table(t["tags"], "column_wise", ranks),
        ),
    )


def _train(model: nn.Module, batches, opt) -> list[float]:
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


N, STEPS = 8, 4


def _distributed(rank: int, world: int, plan_kind: str) -> dict:
    model = Plain()
    plan = _plan(world) if plan_kind == "explicit" else None
    model = he.distribute(model, plan=plan)
    assert isinstance(model, nn.parallel.DistributedDataParallel)
    opt = he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # reaches the sharded tables too
    per = N // world
    batches = [_slice(*_batch(s, N), rank * per, (rank + 1) * per) for s in range(STEPS)]
    losses = []
    for k, b in enumerate(batches):
        losses += _train(model, [b], opt)
        sched.step()
        if k == 1:  # a child forked mid-job that fails and ends leaves the job alone (groups, store, files)
            a_forked_child_ends(failing=True)
    inner = unwrap(model)
    ec = inner.hybridembed
    assert isinstance(ec, ShardedCollection)
    tables = {n: ec.gather_table(n) for n in ec.tables}  # (collective: every rank's child has ended)
    assert health.heartbeat().failures(list(range(world))) == {}  # (the children's errors were their own)
    sd = inner.state_dict()  # (mod-placed tables: their shards' own entries; any table: loads back)
    inner.load_state_dict(sd)
    assert {n: ec.gather_table(n) for n in ec.tables}.keys() == tables.keys()
    return {
        "sd_keys": sorted(sd),
        "tables": tables,
        "mlp": {k: v.detach().clone() for k, v in inner.mlp.state_dict().items()},
        "losses": losses,
    }


def _reference() -> dict:
    model = Plain()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    losses = []
    for s in range(STEPS):
        losses += _train(model, [_batch(s, N)], opt)
        sched.step()
    tables = {n: getattr(model, n).weight.detach() for n in ("user", "items", "city", "tags")}
    return {"tables": tables, "mlp": model.mlp.state_dict(), "losses": losses}


@pytest.mark.parametrize("world", [2, 4])
def test_distribute_a_plain_model_equals_one_process(world):
    ref = _reference()
    results = spawn(_distributed, world, "default" if world == 2 else "explicit", timeout=240)
    for name, w in ref["tables"].items():
        torch.testing.assert_close(
            results[0]["tables"][name], w, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )
    for r in results:
        for k, v in ref["mlp"].items():
            torch.testing.assert_close(r["mlp"][k], v, atol=1e-5, rtol=1e-5)
    if world == 4:  # (the explicit plan: user and city placed by residue, kept as their shards' entries)
        assert "user.shard0.weight" in results[0]["sd_keys"] and "items.weight" in results[0]["sd_keys"]
    # each rank's loss is the mean over its slice; their mean is the one-process loss
    mean = [sum(r["losses"][s] for r in results) / world for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(ref["losses"]), atol=1e-5, rtol=1e-5)
