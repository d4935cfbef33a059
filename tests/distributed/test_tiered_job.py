"""Tiered tables in a sharded job: each shard's rows on its owner's disk with a cache, trained as
one process holding the same tables in memory (row-wise, table-wise and column-wise shards); a
checkpoint of the job loads into one process; replicas and parameter servers are refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

import hybridembed as he
from hybridembed.distributed import Plan, ShardedCollection, make_plan, plan_costs, shard_table
from hybridembed.distributed.planner import checked_plan
from hybridembed.launch import spawn
from hybridembed.storage import TieredStorage

STEPS = 4
ADAGRAD = he.optim.Adagrad(lr=0.2)


def _tables(where: str | None) -> list[he.TableConfig]:
    def tiered(cache: int):
        return he.Tiered(where, cache_rows=cache) if where is not None else None

    return [
        he.TableConfig("rows", 400, 8, optimizer=ADAGRAD, tiered=tiered(40)),
        he.TableConfig("whole", 300, 8, combiner="mean", optimizer=ADAGRAD, tiered=tiered(50)),
        he.TableConfig("cols", 200, 8, optimizer=ADAGRAD, tiered=tiered(60)),
    ]


def _batch(step: int, rank: int | None) -> dict[str, he.Jagged]:
    """Rank ``rank``'s half of step ``step``'s batch (None: both halves, ranks concatenated)."""
    if rank is None:
        halves = [_batch(step, r) for r in range(2)]
        return {k: he.Jagged.from_lists(halves[0][k].to_lists() + halves[1][k].to_lists()) for k in halves[0]}
    g = torch.Generator().manual_seed(50 * step + rank)
    rows = {"rows": 400, "whole": 300, "cols": 200}
    return {
        k: he.Jagged.from_lists([(torch.rand(n, generator=g) ** 2 * v).long().tolist() for n in (3, 1, 4, 2, 0, 5)])
        for k, v in rows.items()
    }


def _train(ec, batch_of, scale: float, after=None) -> None:
    opt = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec)
    for step in range(STEPS):
        out = ec(batch_of(step))
        opt.zero_grad()
        (sum((v * torch.linspace(-1, 2, v.shape[1])).sum() for v in out.values()) * scale).backward()
        opt.step()
        if after is not None:
            after(step, opt)
    return opt


def _job(rank: int, world: int, where: str) -> dict:
    tables = _tables(where)
    plan = Plan(
        world,
        (
            shard_table(tables[0], "row_wise", (0, 1)),
            shard_table(tables[1], "table_wise", (1,)),
            shard_table(tables[2], "column_wise", (0, 1)),
        ),
    )
    ec = ShardedCollection(tables, plan=plan, seed=4)
    tiered = [type(st).__name__ for st in ec.storages]
    from hybridembed.checkpoint import snapshot

    snapshot._PIECE_BYTES = 40 * 8 * 4 * 2  # (40 rows a file: a shard is saved a part at a time)
    seen: list[int] = []
    real = TieredStorage._gather
    TieredStorage._gather = lambda self, rows, cols: seen.append(rows.numel()) or real(self, rows, cols)

    def save(step: int, opt) -> None:  # a full version after step 1, an incremental one at the end
        if step in (1, STEPS - 1):
            he.save(f"{where}/ck", ec, opt, incremental=True)

    opt = _train(ec, lambda step: _batch(step, rank), 1.0, save)
    TieredStorage._gather = real
    he.save(f"{where}/ck", ec, opt, keep=3)  # a full version again: links v-000001's files unchanged since
    evictions = sum(st.stats()["evictions"] for st in ec.storages if isinstance(st, TieredStorage))
    # (a read per file of 640 bytes of rows and state: 40 rows of 8 columns, 80 of a 4-column slice)
    assert seen and max(seen) <= 80, seen
    return {"tiered": tiered, "evictions": evictions, "tables": {t.name: ec.gather_table(t.name) for t in tables}}


def _load_job(rank: int, world: int, where: str) -> dict:
    """The job's checkpoint into a fresh job of tiered shards by the planner's plan (a range at a time)."""
    from hybridembed.checkpoint import local

    local._PIECE_BYTES = 40 * 8 * 4 * 2
    ec = ShardedCollection(_tables(f"{where}/again"), seed=0)
    opt = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec)
    writes: list[int] = []
    real = TieredStorage.write_range
    TieredStorage.write_range = lambda self, t, lo, d, c=0: writes.append(len(d["weight"])) or real(self, t, lo, d, c)
    he.load(f"{where}/ck", ec, opt)
    TieredStorage.write_range = real
    loaded = {t: ec.gather_table(t) for t in ec.tables}
    _more(ec, opt, lambda step: _batch(step, rank), 1.0)  # (the optimizer state came too: Adagrad's steps equal)
    return {"writes": writes, "loaded": loaded, "tables": {t: ec.gather_table(t) for t in ec.tables}}


def _more(ec, opt, batch_of, scale: float) -> None:
    for step in (10, 11):
        out = ec(batch_of(step))
        opt.zero_grad()
        (sum((v * torch.linspace(-1, 2, v.shape[1])).sum() for v in out.values()) * scale).backward()
        opt.step()


def test_tiered_shards_train_as_one_process_in_memory_and_their_checkpoint_loads_in_one(tmp_path):
    got = spawn(_job, 2, str(tmp_path), timeout=120)
    ref = he.EmbeddingCollection(_tables(None), seed=4)
    opt_ref = _train(ref, lambda step: _batch(step, None), 0.5)
    for r in got:
        assert set(r["tiered"]) == {"TieredStorage"}
        for t in ref.tables:
            torch.testing.assert_close(r["tables"][t], ref.weight(t), rtol=1e-5, atol=1e-6, msg=t)
    assert sum(r["evictions"] for r in got) > 0
    delta = he.checkpoint.read_manifest(
        tmp_path / "ck" / "v-000002"
    )  # the changes since v-000001, in files of their own
    assert delta["incremental"]["length"] == 1 and all("changed" in s for s in delta["tables"]["rows"]["shards"])
    # the last (full) version links each file of v-000001 none of whose rows were looked up since
    first, last = (he.checkpoint.read_manifest(tmp_path / "ck" / v)["tables"] for v in ("v-000001", "v-000003"))
    count = 0
    for t in ref.tables:
        since = torch.cat([_batch(step, None)[t].values for step in range(2, STEPS)])
        old = {(tmp_path / "ck" / "v-000001" / s["file"]).stat().st_ino for s in first[t]["shards"]}
        linked, untouched = set(), set()
        for s in last[t]["shards"]:
            span = (s["row_start"], s["row_end"], s.get("col_start"))
            if (tmp_path / "ck" / "v-000003" / s["file"]).stat().st_ino in old:
                linked.add(span)
            if not ((since >= s["row_start"]) & (since < s["row_end"])).any():
                untouched.add(span)
        assert linked == untouched, t
        count += len(linked)
    assert count >= 1, count
    shards = he.checkpoint.read_manifest(tmp_path / "ck" / "v-000001")["tables"]["rows"]["shards"]
    assert len(shards) == 2 * 5 and {(s["row_start"], s["row_end"]) for s in shards} >= {
        (0, 40),
        (200, 240),
        (360, 400),
    }
    one = he.EmbeddingCollection(_tables(str(tmp_path / "one")), seed=0)  # the job's checkpoint, in one process
    opt_one = he.wrap_optimizer(torch.optim.SGD(one.parameters(), lr=0.1), one)
    he.load(tmp_path / "ck", one, opt_one)
    for t in ref.tables:
        torch.testing.assert_close(one.weight(t), ref.weight(t), rtol=1e-5, atol=1e-6, msg=t)
        for k, v in ref.storage_of(t).table_state(t).items():
            torch.testing.assert_close(one.storage_of(t).table_state(t)[k], v, rtol=1e-5, atol=1e-6, msg=f"{t}.{k}")
    loaded = spawn(_load_job, 2, str(tmp_path), timeout=120)  # ... and into a new job of tiered shards
    want = {t: ref.weight(t).clone() for t in ref.tables}
    _more(ref, opt_ref, lambda step: _batch(step, None), 0.5)
    for r in loaded:
        assert r["writes"] and max(r["writes"]) <= 80, r["writes"]  # (range by range)
        for t in ref.tables:
            torch.testing.assert_close(r["loaded"][t], want[t], rtol=1e-5, atol=1e-6, msg=t)
            torch.testing.assert_close(r["tables"][t], ref.weight(t), rtol=1e-5, atol=1e-6, msg=t)


def test_a_tiered_table_is_never_replicated_and_the_planner_counts_its_cache():
    t = he.TableConfig("t", 1000, 4, tiered=he.Tiered("unused", cache_rows=50))
    with pytest.raises(he.ConfigError, match="tiered: a replica on every rank"):
        checked_plan(Plan(2, (shard_table(t, "data_parallel", (0, 1)),)), [t], 2, None)
    assert make_plan([t], 2).tables[0].sharding != "data_parallel"  # (small enough to replicate in memory)
    big = he.TableConfig("big", 10**9, 64)  # 476 GiB of rows and Adagrad state: a rank's memory holds its cache
    tiered = replace(big, tiered=he.Tiered("unused", cache_rows=10**6))
    in_memory, on_disk = (max(r.memory_bytes for r in plan_costs(make_plan([x], 2), [x])) for x in (big, tiered))
    assert in_memory > 200 * 2**30 and on_disk < 5 * 2**30  # (its cache's rows and state, and 4 bytes a row)


def _distributed(rank: int, world: int, where: str) -> dict:
    """A model described on the meta device (no files, no rows) and he.distribute: each rank makes
    only its shards, on its disk, by the planner's default plan."""
    model = torch.nn.ModuleDict({"ec": he.EmbeddingCollection(_tables(where), seed=4, device="meta")})
    assert "TieredStorage(rows=400, cache_rows=40" in repr(model)  # (printable; no files made)
    model = he.distribute(model)
    ec = model["ec"]
    _train(ec, lambda step: _batch(step, rank), 1.0)
    kinds = {tp.table: tp.sharding for tp in ec.plan.tables}
    return {"kinds": kinds, "tables": {t: ec.gather_table(t) for t in ec.tables}}


def test_a_model_of_tiered_tables_on_meta_is_distributed_on_the_ranks_disks(tmp_path):
    got = spawn(_distributed, 2, str(tmp_path), timeout=120)
    ref = he.EmbeddingCollection(_tables(None), seed=4)
    _train(ref, lambda step: _batch(step, None), 0.5)
    for r in got:
        assert "data_parallel" not in r["kinds"].values(), r["kinds"]
        for t in ref.tables:
            torch.testing.assert_close(r["tables"][t], ref.weight(t), rtol=1e-5, atol=1e-6, msg=t)
    assert any(p.suffix == ".rows" for p in tmp_path.iterdir())


def _train_ids(ec, opt, seed: int, rank: int | None, world: int = 2, scale: float = 1.0) -> int:
    """20 steps on ids in [-500, 500): rank ``rank``'s 16 of each step (None: all ranks' together,
    the loss scaled by ``scale``); -> rows the collection spilled to disk."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(20):
        ids = torch.randint(-500, 500, (world, 16), generator=g)
        opt.zero_grad()
        (
            ec({"e": ids.flatten() if rank is None else ids[rank]})["e"] * torch.linspace(-1, 1, 8) * scale
        ).sum().backward()
        opt.step()
    return sum(st.stats().get("spilled", 0) for st in ec.storages)


def _meta_dynamic(rank: int, world: int, where: str) -> tuple:
    """A model of a tiered dynamic table described on meta (no files, no index) and he.distribute:
    each rank makes its shard, on its disk (the planner's default plan); SGD on the mean of the ranks."""
    t = he.TableConfig("e", None, 8, dynamic=he.Dynamic(), tiered=he.Tiered(where, cache_rows=30))
    model = he.distribute(nn.ModuleDict({"ec": he.EmbeddingCollection([t], seed=3, device="meta")}))
    ec = model["ec"]
    opt = he.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    spilled = _train_ids(ec, opt, 7, rank, world)
    return ec.gather_table("e"), spilled


def test_a_model_of_a_tiered_dynamic_table_on_meta_is_distributed_on_the_ranks_disks(tmp_path):
    got = spawn(_meta_dynamic, 2, str(tmp_path), timeout=120)
    t = he.TableConfig("e", None, 8, dynamic=he.Dynamic())
    one = he.EmbeddingCollection([t], seed=3)
    _train_ids(one, he.wrap_optimizer(torch.optim.SGD(one.parameters(), lr=0.1), one), 7, None, scale=0.5)
    ids, rows = one.storage_of("e").read_ids("e")[:2]
    for (got_ids, got_rows), spilled in got:
        assert spilled > 0 and torch.equal(got_ids, ids)
        torch.testing.assert_close(got_rows, rows, rtol=1e-6, atol=1e-7)
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".rows") == ["e@0.rows", "e@1.rows"]


def _dynamic_job(rank: int, world: int, where: str | None, seed: int) -> tuple:
    """A dynamic table row-wise over the ranks, tiered (rows beyond 30 a shard spilled to disk) or not."""
    t = he.TableConfig(
        "e", None, 8, dynamic=he.Dynamic(), tiered=he.Tiered(where, cache_rows=30) if where is not None else None
    )
    ec = ShardedCollection([t], plan=Plan(world, (shard_table(t, "row_wise", tuple(range(world))),)), seed=3)
    opt = he.wrap_optimizer(
        torch.optim.Adagrad(ec.parameters(), lr=0.1), nn.ModuleDict({"ec": ec, "d": nn.Linear(1, 1)})
    )
    spilled = _train_ids(ec, opt, seed, rank, world)
    if where is not None:  # (each shard saved in files of 20 rows: a row, its id and counters, Adagrad's sum)
        from hybridembed.checkpoint import snapshot

        snapshot._PIECE_BYTES = 20 * (8 * 4 + 24 + 8 * 4)
        he.save(f"{where}/ck", ec, opt)
    return ec.gather_table("e"), spilled


def _dynamic_load(rank: int, world: int, where: str) -> tuple:
    """The tiered job's checkpoint into a new job of tiered shards, a file at a time; a step on."""
    t = he.TableConfig("e", None, 8, dynamic=he.Dynamic(), tiered=he.Tiered(f"{where}/again", cache_rows=30))
    ec = ShardedCollection([t], plan=Plan(world, (shard_table(t, "row_wise", tuple(range(world))),)), seed=3)
    opt = he.wrap_optimizer(
        torch.optim.Adagrad(ec.parameters(), lr=0.1), nn.ModuleDict({"ec": ec, "d": nn.Linear(1, 1)})
    )
    he.load(f"{where}/ck", ec, opt)
    loaded = ec.gather_table("e")
    ids = torch.arange(-8, 8).reshape(2, 8)[rank]
    opt.zero_grad()
    (ec({"e": ids})["e"] * torch.linspace(-1, 1, 8)).sum().backward()
    opt.step()
    return loaded, ec.gather_table("e")


def test_a_tiered_dynamic_table_sharded_row_wise_trains_as_in_memory(tmp_path):
    tiered = spawn(_dynamic_job, 2, str(tmp_path), 5, timeout=120)
    memory = spawn(_dynamic_job, 2, None, 5, timeout=120)
    (ids, rows), spilled = tiered[0]
    assert all(r[1] > 0 for r in tiered)  # (each rank's shard spilled rows to its disk)
    assert torch.equal(ids, memory[0][0][0]) and ids.numel() > 300
    torch.testing.assert_close(rows, memory[0][0][1], rtol=0, atol=0)
    # its checkpoint: each shard in parts, loaded into a job of tiered shards and into one process
    shards = he.checkpoint.read_manifest(tmp_path / "ck")["tables"]["e"]["shards"]
    assert len(shards) >= ids.numel() // 20 and sorted({s["residue"] for s in shards if not s.get("part")}) == [0, 1]
    again = spawn(_dynamic_load, 2, str(tmp_path), timeout=120)
    t = he.TableConfig("e", None, 8, dynamic=he.Dynamic(), tiered=he.Tiered(tmp_path / "one", cache_rows=40))
    one = he.EmbeddingCollection([t], seed=3)
    opt_one = he.wrap_optimizer(torch.optim.Adagrad(one.parameters(), lr=0.1), one)
    he.load(tmp_path / "ck", one, opt_one)
    got = one.storage_of("e").read_ids("e")
    for i, r in enumerate([(got[0], got[1]), again[0][0], again[1][0]]):
        assert torch.equal(r[0], ids), i
        torch.testing.assert_close(r[1], rows, rtol=0, atol=0, msg=str(i))
    opt_one.zero_grad()  # (a step on from the loaded optimizer state: as the job's, whose ranks average)
    (one({"e": torch.arange(-8, 8)})["e"] * torch.linspace(-1, 1, 8) * 0.5).sum().backward()
    opt_one.step()
    after = one.storage_of("e").read_ids("e")
    torch.testing.assert_close(again[0][1][1], after[1], rtol=1e-6, atol=1e-7)
