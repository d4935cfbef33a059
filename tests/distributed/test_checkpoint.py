"""``he.save`` / ``he.load`` / ``he.export`` of a distributed model: every rank saves its shards
and rank 0 commits; a new job at the same world size resumes exactly (equal to the run that
never stopped); a damaged shard on one rank fails the load on every rank with nothing changed;
another plan or world size loads the same rows; the checkpoint loads into the model of one process; the export
of a distributed model serves its outputs."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

import hybridembed as he
from hybridembed.checkpoint import read_manifest
from hybridembed.distributed import Plan, shard_table, unwrap
from hybridembed.launch import spawn

N, K = 8, 3  # global batch, steps before and after the save

FEATURES = {"a": "a", "b": "b", "c": "c", "d": "d", "f": "f", "e": "e"}


def _tables() -> list[he.TableConfig]:
    return [
        he.TableConfig("a", 30, 8),
        he.TableConfig("b", 31, 8, combiner="mean"),
        he.TableConfig("c", 20, 8),
        he.TableConfig("d", 15, 8, combiner="mean"),
        he.TableConfig("f", 10, 8),
        he.TableConfig("e", None, 8, dynamic=he.Dynamic()),
    ]


def _plan(world: int) -> Plan:
    t = {x.name: x for x in _tables()}
    ranks = tuple(range(world))
    return Plan(
        world,
        (
            shard_table(t["a"], "row_wise", ranks, placement="block"),
            shard_table(t["b"], "row_wise", ranks, placement="mod"),
            shard_table(t["c"], "column_wise", ranks),
            shard_table(t["d"], "table_wise", (world - 1,)),
            shard_table(t["f"], "data_parallel", ranks),
            shard_table(t["e"], "row_wise", ranks),
        ),
    )


class Ranker(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.ec = he.EmbeddingCollection(_tables(), FEATURES, seed=5)
        self.mlp = nn.Linear(48, 1)

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.ec(x)
        return self.mlp(torch.cat([out[f] for f in FEATURES], 1)).squeeze(1)


def _batch(step: int, lo: int, hi: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Rows lo..hi-1 of the global batch of ``step``: (B, 3) ids padded with -1."""
    g = torch.Generator().manual_seed(100 + step)
    x = {}
    for f, rows in (("a", 30), ("b", 31), ("c", 20), ("d", 15), ("f", 10), ("e", 1000)):
        ids = torch.randint(0, rows, (N, 3), generator=g)
        ids[torch.rand(N, 3, generator=g) < 0.3] = -1
        x[f] = ids[lo:hi]
    return x, torch.rand(N, generator=g)[lo:hi]


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return he.wrap_optimizer(torch.optim.Adam(model.parameters(), lr=0.05), model)


def _steps(model, opt, steps, rank: int, world: int) -> list[float]:
    per = N // world
    losses = []
    for s in steps:
        x, y = _batch(s, rank * per, (rank + 1) * per)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every table gathered (a collective) and the MLP: the whole model's state."""
    inner = unwrap(model)
    ec = inner.ec if hasattr(inner, "ec") else inner.hybridembed
    out = {}
    for n in ec.tables:
        t = ec.gather_table(n) if hasattr(ec, "gather_table") else None
        if t is None:
            t = ec.dynamic_rows(n) if ec.tables[n].dynamic is not None else ec.weight(n).detach().clone()
        if isinstance(t, tuple):
            out[n + ".ids"], out[n] = t
        else:
            out[n] = t
    out.update({"mlp." + k: v.detach().clone() for k, v in inner.mlp.state_dict().items()})
    return out


def _train_save_train(rank: int, world: int, path: str) -> dict:
    model = he.distribute(Ranker(), plan=_plan(world))
    opt = _optimizer(model)
    _steps(model, opt, range(K), rank, world)
    written = he.save(path, model, opt, extra={"step": K})
    saved = _snapshot(model)
    _steps(model, opt, range(K, 2 * K), rank, world)
    final = _snapshot(model)
    # the export of the same model (sharded, data-parallel and dynamic tables): one plain file
    x, _ = _batch(50, rank * (N // world), (rank + 1) * (N // world))
    he.export(model, path + ".pt", (x,))
    with torch.no_grad():
        out = unwrap(model).eval()(x)
    return {"written": written, "saved": saved, "final": final, "x": x, "out": out}


def _damage_then_resume(rank: int, world: int, path: str, damaged: str) -> dict:
    import torch.distributed as dist

    model = he.distribute(Ranker(), plan=_plan(world))
    opt = _optimizer(model)
    before = _snapshot(model)
    # a byte flipped in one of rank 1's shard files: every rank refuses, nothing changes anywhere
    if rank == 0:
        shutil.copytree(path, damaged)
        v = Path(damaged) / (Path(damaged) / "LATEST").read_text().strip()
        f = v / "tables" / "ec.b.00001.pt"  # shard 1 of the mod-placed table: rank 1's
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    dist.barrier()
    try:
        he.load(damaged, model, opt)
        refused = None
    except he.CheckpointError as e:
        refused = str(e)
    unchanged = all(torch.equal(before[k], v) for k, v in _snapshot(model).items())
    # the same world size, another plan (table b in blocks, not residues): loads the same rows
    t = {x.name: x for x in _tables()}
    other = _plan(world)
    other = Plan(world, tuple(shard_table(t["b"], "row_wise", (0, 1)) if p.table == "b" else p for p in other.tables))
    replanned_model = he.distribute(Ranker(), plan=other)
    he.load(path, replanned_model)
    replanned = _snapshot(replanned_model)
    manifest = he.load(path, model, opt)
    losses = _steps(model, opt, range(K, 2 * K), rank, world)
    return {
        "replanned": replanned,
        "refused": refused,
        "unchanged": unchanged,
        "extra": manifest["extra"],
        "final": _snapshot(model),
        "losses": losses,
    }


def _load_at(rank: int, world: int, path: str, other: str) -> dict:
    from hybridembed.checkpoint import layout as ck_layout

    model = he.distribute(Ranker(), plan=_plan(world))
    opt = _optimizer(model)
    he.load(path, model, opt)  # saved by 2 ranks: each of 3 reads the rows its shards hold now
    loaded = _snapshot(model)
    # a rank that cannot write its shard: every rank raises, the previous version stays current
    he.save(other, model, opt)
    if rank == 1:
        real = ck_layout._write_file

        def failing(p, obj):
            if p.parent.name == "tables":
                raise ck_layout._WriteError(p, OSError(28, "No space left on device"))
            real(p, obj)

        ck_layout._write_file = failing
    try:
        he.save(other, model, opt)
        failed = None
    except he.CheckpointError as e:
        failed = str(e)
    # sharded and unsharded collections in one model: refused on every rank before any exchange
    mixed = nn.ModuleDict({"s": unwrap(model).ec, "p": he.EmbeddingCollection([he.TableConfig("z", 4, 2)])})
    try:
        he.save(other, mixed)
        mixed_error = None
    except he.CheckpointError as e:
        mixed_error = str(e)
    return {"loaded": loaded, "failed": failed, "mixed": mixed_error}


def _close(a: dict, b: dict, tol: float) -> None:
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=tol, rtol=tol, msg=lambda m, k=k: f"{k}: {m}")


def test_distributed_save_load_resumes_exactly(tmp_path):
    path = str(tmp_path / "ckpt")
    first = spawn(_train_save_train, 2, path, timeout=240)
    assert first[0]["written"] == first[1]["written"]
    m = read_manifest(path)
    assert m["world_size"] == 2 and Plan.from_dict(m["plans"]["ec"]) == _plan(2)
    shards = {q: [(s["rank"], s["shard"]) for s in t["shards"]] for q, t in m["tables"].items()}
    assert shards["ec.b"] == [(0, 0), (1, 1)] and shards["ec.d"] == [(1, 0)] and shards["ec.f"] == [(None, 0)]
    assert m["tables"]["ec.b"]["shards"][1]["row_step"] == 2 and m["tables"]["ec.c"]["shards"][1]["col_start"] == 4

    served = torch.jit.load(path + ".pt")
    for r in first:
        torch.testing.assert_close(served(r["x"]), r["out"], atol=1e-5, rtol=1e-5)

    second = spawn(_damage_then_resume, 2, path, str(tmp_path / "damaged"), timeout=240)
    for r in second:  # every rank refused, naming the damaged file on rank 1
        assert r["refused"] is not None and "no rank changed anything" in r["refused"]
        assert "rank 1" in r["refused"] and "ec.b.00001.pt" in r["refused"] and "checksum" in r["refused"]
        assert r["unchanged"]
        _close(r["replanned"], first[0]["saved"], 0)
        assert r["extra"] == {"step": K}
    _close(second[0]["final"], first[0]["final"], 1e-6)  # resumed == never stopped

    # another world size: the same rows, each of 3 ranks holding its shards of the 3-rank plan
    other = tmp_path / "other"
    errors = spawn(_load_at, 3, path, str(other), timeout=240)
    for e in errors:
        _close(e["loaded"], first[0]["saved"], 0)
        assert "rank 1:" in e["failed"] and "No space left on device" in e["failed"]
        assert "unsharded EmbeddingCollection(s) at ['p']" in e["mixed"]
    assert (other / "LATEST").read_text().strip() == "v-000001"
    assert sorted(p.name for p in other.iterdir()) == ["LATEST", "v-000001"]

    # the model of one process loads the distributed checkpoint (rows put back by id: blocks, residues,
    # column slices, hash shards) and trains on like the job
    model = Ranker()
    opt = _optimizer(model)
    assert he.load(path, model, opt)["extra"] == {"step": K}
    _close(_snapshot(model), first[0]["saved"], 0)
    _steps(model, opt, range(K, 2 * K), 0, 1)
    _close(_snapshot(model), first[0]["final"], 1e-5)


def _load_while_another_job_commits(rank: int, world: int, path: str) -> dict:
    import time

    import torch.distributed as dist

    from hybridembed.checkpoint import layout as ck_layout

    model = he.distribute(Ranker(), plan=_plan(world))
    opt = _optimizer(model)
    _steps(model, opt, range(1), rank, world)
    nan, inf = float("nan"), float("inf")
    he.save(path, model, opt, extra={"auc": nan, "x": inf, "nested": {"y": -inf}})  # v-000001
    first = _snapshot(model)
    _steps(model, opt, range(1, 2), rank, world)
    he.save(path, model, opt, keep=2)  # v-000002
    if rank == 0:
        ck_layout._commit(Path(path), "v-000001")  # LATEST names v-000001 again
    dist.barrier()
    # another job commits v-000002 right after rank 0 read LATEST, and before rank 1 looks
    flag, real = Path(path + ".committed"), ck_layout._read_pointer

    def on_rank_0(root):
        name = real(root)
        if not flag.exists():
            ck_layout._commit(Path(path), "v-000002")
            flag.touch()
        return name

    def on_rank_1(root):
        deadline = time.monotonic() + 30
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return real(root)

    ck_layout._read_pointer = on_rank_0 if rank == 0 else on_rank_1
    fresh = he.distribute(Ranker(), plan=_plan(world))
    manifest = he.load(path, fresh, _optimizer(fresh))
    ck_layout._read_pointer = real
    loaded = _snapshot(fresh)
    return {
        "version": Path(manifest["path"]).name,
        "id": manifest["id"],
        "extra": manifest["extra"],
        "equal": all(torch.equal(first[k], loaded[k]) for k in first),
    }


def test_every_rank_loads_the_version_rank_0_found(tmp_path):
    """A save committed by another job while the ranks load: every rank loads the version rank 0
    read from LATEST (non-finite floats of extra come back too)."""
    import math

    path = str(tmp_path / "ckpt")
    results = spawn(_load_while_another_job_commits, 2, path, timeout=120)
    assert (tmp_path / "ckpt" / "LATEST").read_text().strip() == "v-000002"  # the other job did commit
    assert [r["version"] for r in results] == ["v-000001"] * 2
    assert results[0]["id"] == results[1]["id"]
    assert all(r["equal"] for r in results)  # the rows of v-000001 on every rank
    for r in results:
        e = r["extra"]
        assert math.isnan(e["auc"]) and e["x"] == float("inf") and e["nested"]["y"] == float("-inf")


def _save_while_another_process_writes(rank: int, world: int, path: str) -> dict:
    import os

    import torch.distributed as dist

    from hybridembed.checkpoint import lock as ck_lock

    model = he.distribute(Ranker(), plan=_plan(world))
    opt = _optimizer(model)
    lock = None
    if rank == 1:  # a process that is not the one committing (rank 0) holds the directory
        Path(path).mkdir()
        lock = ck_lock._lock(Path(path))
    dist.barrier()
    try:
        he.save(path, model, opt)
        refused = None
    except he.CheckpointError as e:
        refused = str(e)
    if lock is not None:
        lock.release()
    dist.barrier()
    written = he.save(path, model, opt, background=True).wait(60)  # rank 0's thread holds it until done
    return {"pid": os.getpid(), "refused": refused, "written": written, "listing": sorted(os.listdir(path))}


def test_a_distributed_save_into_a_directory_another_process_writes_fails_on_every_rank(tmp_path):
    import socket

    path = str(tmp_path / "ckpt")
    results = spawn(_save_while_another_process_writes, 2, path, timeout=120)
    holder = f"another process (pid {results[1]['pid']}, host {socket.gethostname()}) is writing the checkpoint"
    for r in results:
        assert r["refused"] is not None and r["refused"].startswith(holder) and "one writer at a time" in r["refused"]
        assert r["written"] == str(tmp_path / "ckpt" / "v-000001")
    assert results[0]["listing"] == ["LATEST", "v-000001"]  # rank 0 released the lock with its cleanup


class Plain(nn.Module):
    """A plain model: nn.EmbeddingBag / nn.Embedding layers and an MLP."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.user = nn.EmbeddingBag(40, 8, mode="sum")
        self.items = nn.EmbeddingBag(60, 8, mode="mean")
        self.city = nn.Embedding(20, 8)
        self.tags = nn.EmbeddingBag(30, 8, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        u = self.user(x["user"].unsqueeze(1))
        i = self.items(x["items"], x["items_off"])
        c = self.city(x["city"])
        t = self.tags(x["tags"], x["tags_off"], per_sample_weights=x["tags_w"])
        return self.mlp(torch.cat([u, i, c, t], 1)).squeeze(1)


def _plain_batch(seed: int, n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = {"user": torch.randint(0, 40, (n,), generator=g), "city": torch.randint(0, 20, (n,), generator=g)}
    for f, rows in (("items", 60), ("tags", 30)):
        lengths = torch.randint(1, 4, (n,), generator=g)
        x[f] = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
        x[f + "_off"] = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    x["tags_w"] = torch.rand(x["tags"].numel(), generator=g)
    return x


def _plain_plan(world: int) -> Plan:
    t = {n: he.TableConfig(n, r, 8) for n, r in (("user", 40), ("items", 60), ("city", 20), ("tags", 30))}
    ranks = tuple(range(world))
    return Plan(
        world,
        (
            shard_table(t["user"], "row_wise", ranks, placement="mod"),
            shard_table(t["items"], "table_wise", (world - 1,)),
            shard_table(t["city"], "data_parallel", ranks),
            shard_table(t["tags"], "column_wise", ranks),
        ),
    )


def _train_export(rank: int, world: int, path: str) -> dict:
    model = he.distribute(Plain(), plan=_plain_plan(world))
    opt = he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model)
    for s in range(2):
        opt.zero_grad()
        model(_plain_batch(10 * s + rank, 4)).square().mean().backward()
        opt.step()
    x = _plain_batch(99 + rank, 5)
    written = he.export(model, path, (x,))
    assert model.training  # modes restored
    with torch.no_grad():
        out = unwrap(model).eval()(x)
    return {"written": str(written), "x": x, "out": out}


def test_export_of_a_distributed_model_serves_its_outputs(tmp_path):
    path = tmp_path / "ranker.pt"
    results = spawn(_train_export, 2, str(path), timeout=240)
    assert [r["written"] for r in results] == [str(path)] * 2
    served = torch.jit.load(str(path))
    assert not any("Sharded" in type(m).__name__ or "Hybrid" in m.original_name for m in served.modules())
    for r in results:  # every rank's inputs: the one file serves what the distributed model computes
        torch.testing.assert_close(served(r["x"]), r["out"], atol=1e-5, rtol=1e-5)


def test_shards_must_tile_every_row_and_column():
    """A manifest's residue and column shards are checked before anything is read (no job needed)."""
    from hybridembed.checkpoint.manifest import _check_shards

    def table(*shards):
        return {"kind": "dense", "shape": [5, 4], "shards": [{"file": f"{i}", **s} for i, s in enumerate(shards)]}

    residues = [{"row_start": 0, "row_end": 5, "row_step": 2}, {"row_start": 1, "row_end": 5, "row_step": 2}]
    assert _check_shards("t", table(*residues)) == []
    residues[1]["row_start"] = 2  # row 1 nowhere, row 2 twice
    assert "(row 1)" in _check_shards("t", table(*residues))[0]
    cols = [
        {"row_start": 0, "row_end": 5, "col_start": 0, "col_end": 2},
        {"row_start": 0, "row_end": 5, "col_start": 2},
    ]
    assert _check_shards("t", table(*cols)) == []
    cols[1]["col_start"] = 3
    assert "do not tile 0..4" in _check_shards("t", table(*cols))[0]
