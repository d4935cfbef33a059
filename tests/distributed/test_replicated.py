"""Data-parallel (replicated) tables: their row gradients summed over the ranks by the touched
rows alone (a big table, few rows a step) or by a dense all-reduce (a small table, most rows
touched; through gloo, or through shared memory between ranks of one machine), each against one
process on the concatenated batches."""

from __future__ import annotations

import torch
import torch.distributed as dist

import hybridembed as he
from hybridembed.distributed import Plan, ShardedCollection, shard_table
from hybridembed.launch import spawn

TABLES = [he.TableConfig("big", 2000, 6), he.TableConfig("small", 8, 6, dtype=torch.float64)]
STEPS = 3


def _batch(step: int, rank: int | None) -> dict[str, he.Jagged]:
    """Rank ``rank``'s half of step ``step``'s batch (None: the whole batch, ranks concatenated)."""
    if rank is None:
        halves = [_batch(step, r) for r in range(2)]
        return {k: he.Jagged.from_lists(halves[0][k].to_lists() + halves[1][k].to_lists()) for k in halves[0]}
    g = torch.Generator().manual_seed(100 * step + rank)
    return {
        t.name: he.Jagged.from_lists(
            [torch.randint(0, t.num_embeddings, (n,), generator=g).tolist() for n in (2, 1, 3, 0)]
        )
        for t in TABLES
    }


def _train(ec, batch_of, scale: float) -> None:
    opt = he.wrap_optimizer(torch.optim.Adagrad(ec.parameters(), lr=0.3), ec)
    for step in range(STEPS):
        out = ec(batch_of(step))
        opt.zero_grad()
        (sum((v * torch.linspace(-1, 2, v.shape[1], dtype=v.dtype)).sum() for v in out.values()) * scale).backward()
        opt.step()


def _job(rank: int, world: int) -> dict:
    """Both ways of summing the small table: gloo's all-reduce, and (ranks of one machine, the
    default) shared memory; the choice is read when the collection first needs it."""
    return {shared: _trained(rank, world, shared) for shared in (False, True)}


def _trained(rank: int, world: int, shared: bool) -> dict:
    import os

    from hybridembed.distributed import shm

    os.environ[shm.ENV] = "1" if shared else "0"
    plan = Plan(world, tuple(shard_table(t, "data_parallel", tuple(range(world))) for t in TABLES))
    ec = ShardedCollection(TABLES, plan=plan, seed=2)
    seen: list[str] = []
    real_gather, real_reduce, real_shared = dist.all_gather_single, dist.all_reduce, shm.Transport.all_reduce

    def gather(out, t, *a, **k):
        seen.append(f"all_gather {t.dtype}")
        return real_gather(out, t, *a, **k)

    def reduce(t, *a, **k):
        seen.append(f"all_reduce {t.dtype} {tuple(t.shape)}")
        return real_reduce(t, *a, **k)

    def through(tr, t):
        seen.append(f"shared all_reduce {t.dtype} {tuple(t.shape)}")
        return real_shared(tr, t)

    dist.all_gather_single, dist.all_reduce, shm.Transport.all_reduce = gather, reduce, through
    try:
        _train(ec, lambda step: _batch(step, rank), 1.0)  # (mean over ranks: as the whole batch's half)
    finally:
        dist.all_gather_single, dist.all_reduce, shm.Transport.all_reduce = real_gather, real_reduce, real_shared
    return {"seen": seen, "tables": {t.name: ec.gather_table(t.name) for t in TABLES}}


def test_replicated_rows_summed_by_touched_rows_or_dense_equal_one_process():
    got = spawn(_job, 2, timeout=120)
    ref = he.EmbeddingCollection(TABLES, seed=2)
    _train(ref, lambda step: _batch(step, None), 0.5)
    for both in got:
        for shared, r in both.items():
            for t in TABLES:
                torch.testing.assert_close(r["tables"][t.name], ref.weight(t.name), rtol=1e-6, atol=1e-7, msg=t.name)
                assert torch.equal(r["tables"][t.name], both[False]["tables"][t.name])  # (b0 + b1 either way)
            # per step: the counts (int64), the big table's touched rows (bytes), the small one's dense buffer
            dense = f"{'shared ' if shared else ''}all_reduce torch.float64 (8, 7)"
            assert r["seen"] == ["all_gather torch.int64", "all_gather torch.uint8", dense] * STEPS, (shared, r["seen"])
