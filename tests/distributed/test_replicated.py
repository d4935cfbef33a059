"""Data-parallel (replicated) tables: their row gradients summed over the ranks, each against one
process on the concatenated batches: through gloo by the touched rows alone (a big table, few rows
a step) or by a dense all-reduce (a small table, most rows touched); between ranks of one machine
(the default) by every rank's touched rows read from the others' shared memory, merged (each rank's
ids ascending) or, where that cannot run, summed by index."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hybridembed as he
from hybridembed.distributed import Plan, ShardedCollection, shard_table, shm
from hybridembed.launch import spawn

TABLES = [he.TableConfig("big", 2000, 6), he.TableConfig("small", 8, 6, dtype=torch.float64)]
STEPS = 3


def _batch(step: int, rank: int | None, world: int = 2) -> dict[str, he.Jagged]:
    """Rank ``rank``'s part of step ``step``'s batch (None: the whole batch, ranks concatenated)."""
    if rank is None:
        parts = [_batch(step, r, world) for r in range(world)]
        return {k: he.Jagged.from_lists(sum((p[k].to_lists() for p in parts), [])) for k in parts[0]}
    g = torch.Generator().manual_seed(100 * step + rank)
    return {
        t.name: he.Jagged.from_lists(
            [torch.randint(0, t.num_embeddings, (n,), generator=g).tolist() for n in (2, 1, 3, 0)]
        )
        for t in TABLES
    }


def _train(ec, batch_of, scale: float) -> None:
    # (an accumulator that starts above 0: an update not invariant to the scale of the gradient)
    opt = he.wrap_optimizer(torch.optim.Adagrad(ec.parameters(), lr=0.3, initial_accumulator_value=0.1), ec)
    for step in range(STEPS):
        out = ec(batch_of(step))
        opt.zero_grad()
        (sum((v * torch.linspace(-1, 2, v.shape[1], dtype=v.dtype)).sum() for v in out.values()) * scale).backward()
        opt.step()


def _job(rank: int, world: int) -> dict:
    """Every way of summing: gloo (touched rows, or the small table's dense all-reduce), and (ranks
    of one machine, the default) shared memory, merged or summed by index; the choice is read when
    the collection first needs it."""
    ways = ("gloo", "shared", "shared, by index") if world == 2 else ("shared", "shared, by index")
    return {way: _trained(rank, world, way) for way in ways}


def _trained(rank: int, world: int, way: str) -> dict:
    import os

    from hybridembed.distributed import shm
    from hybridembed.kernels import cpu_fused

    os.environ[shm.ENV] = "0" if way == "gloo" else "1"
    plan = Plan(world, tuple(shard_table(t, "data_parallel", tuple(range(world))) for t in TABLES))
    ec = ShardedCollection(TABLES, plan=plan, seed=2)
    seen: list[str] = []
    real = (
        dist.all_gather_single,
        dist.all_reduce,
        shm.Transport.all_gather,
        cpu_fused.merge_rows,
        dist.all_to_all_single,
        shm.Transport.all_to_all,
        cpu_fused.parts_ready,
        cpu_fused.apply_parts,
    )
    lookup = ec.replicated._lookup_many

    def headers(out, t, *a, async_op=False, **k):
        seen.append(f"header all_to_all (async {async_op})")
        return real[4](out, t, *a, async_op=async_op, **k)

    def shared_headers(tr, *a, meanwhile=None, **k):
        seen.append(f"shared header all_to_all (meanwhile {meanwhile is not None})")
        return real[5](tr, *a, meanwhile=meanwhile, **k)

    def looked_up(*a, **k):
        seen.append("replicated lookup")
        return lookup(*a, **k)

    def gather(out, t, *a, **k):
        seen.append(f"all_gather {t.dtype}")
        return real[0](out, t, *a, **k)

    def reduce(t, *a, **k):
        seen.append(f"all_reduce {t.dtype} {tuple(t.shape)}")
        return real[1](t, *a, **k)

    def through(tr, pieces):
        seen.append(f"shared all_gather {[p.dtype for p in pieces]}")
        return real[2](tr, pieces)

    def merged(ids, rows, divisor):
        out = real[3](ids, rows, divisor)
        seen.append(f"merged {out is not None}")
        return out

    def stepped(*a):
        seen.append("merged as stepped")
        return real[7](*a)

    by_index = way.endswith("by index")
    cpu_fused.merge_rows = (lambda *a: None) if by_index else merged
    cpu_fused.parts_ready = (lambda *a: None) if by_index else real[6]
    cpu_fused.apply_parts = stepped
    dist.all_gather_single, dist.all_reduce, shm.Transport.all_gather = gather, reduce, through
    dist.all_to_all_single, shm.Transport.all_to_all, ec.replicated._lookup_many = headers, shared_headers, looked_up
    try:
        _train(ec, lambda step: _batch(step, rank, world), 1.0)  # (mean over ranks: as the whole batch's part)
    finally:
        dist.all_gather_single, dist.all_reduce, shm.Transport.all_gather, cpu_fused.merge_rows = real[:4]
        dist.all_to_all_single, shm.Transport.all_to_all = real[4:6]
        cpu_fused.parts_ready, cpu_fused.apply_parts = real[6:]
    tables = {t.name: ec.gather_table(t.name) for t in TABLES}
    every = [{} for _ in range(world)]
    dist.all_gather_object(every, {k: v.tolist() for k, v in tables.items()})
    return {"seen": seen, "tables": tables, "replicas agree": all(e == every[0] for e in every)}


@pytest.mark.parametrize("world", [2, 3])
def test_replicated_rows_summed_every_way_equal_one_process(world):
    got = spawn(_job, world, timeout=120)
    ref = he.EmbeddingCollection(TABLES, seed=2)
    _train(ref, lambda step: _batch(step, None, world), 1.0 / world)
    for ways in got:
        for way, r in ways.items():
            assert r["replicas agree"], way  # (every replica the same bits)
            for t in TABLES:
                torch.testing.assert_close(r["tables"][t.name], ref.weight(t.name), rtol=1e-6, atol=1e-7, msg=t.name)
                # (every way sums each row in rank order: the same bits; gloo's dense sum at world 2: b0 + b1)
                assert torch.equal(r["tables"][t.name], ways["shared, by index"]["tables"][t.name]), (way, t.name)
            # per step, the forward: the ranks' headers sent (through gloo, or shared memory when the ranks
            # share it), the replicated lookups made while they cross
            rings = way != "gloo" and shm._FUTEX.works  # (where every rank can wait on a futex)
            header = "shared header all_to_all (meanwhile True)" if rings else "header all_to_all (async True)"
            expected = [header, "replicated lookup"]
            if way == "gloo":  # the counts (int64), the big table's touched rows (bytes), the small one's dense buffer
                expected += ["all_gather torch.int64", "all_gather torch.uint8", "all_reduce torch.float64 (8, 7)"]
            else:  # one gather of both tables' ids and rows; each table's rows summed as the update steps them
                # (each rank's ids were ascending), the first ranks' merged first at world 3; by index: summed first
                expected += ["shared all_gather [torch.int64, torch.float32, torch.int64, torch.float64]"]
                each = ["merged as stepped"] if world == 2 else ["merged True", "merged as stepped"]
                expected += [] if way.endswith("by index") else each * 2
            assert r["seen"] == expected * STEPS, (way, r["seen"])
