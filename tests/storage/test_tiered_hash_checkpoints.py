"""Checkpoints of tiered dynamic tables larger than memory: ``he.save`` reads the rows through the
tiers a file at a time, ``he.load`` and ``he.checkpoint.compact`` write them a file at a time (never
the whole table in memory: only its ids), full and incremental, and what is loaded, tiered or in
memory, trains on as the table that was saved; damaged parts are refused and change nothing."""

from __future__ import annotations

import json
import os

import pytest
import torch

import hybridembed as he
from hybridembed.checkpoint.layout import CHECKSUM_KEY
from hybridembed.checkpoint.manifest import _sealed
from hybridembed.storage.tiered_hash import TieredHashStorage

from .test_tiered import train_alike
from .test_tiered_hash import OPTIMIZERS, _batch, _same, _state, _tables, _train

ROW_BYTES = 8 * 4 + 24 + 8 * 4  # a row of 8 floats, its id and counters, Adagrad's (8,) sum


def _pieces(monkeypatch, rows: int) -> None:
    """Checkpoint files of ``rows`` rows of these tables."""
    from hybridembed.checkpoint import local, snapshot

    monkeypatch.setattr(snapshot, "_PIECE_BYTES", rows * ROW_BYTES)
    monkeypatch.setattr(local, "_PIECE_BYTES", rows * ROW_BYTES)


def _reads_and_writes(monkeypatch) -> tuple[list[int], list[int]]:
    """The rows of every read of a tiered dynamic table through its tiers (cached or on disk), and
    of every write of rows to its records, from now on."""
    reads: list[int] = []
    writes: list[int] = []
    read, write = TieredHashStorage._read, TieredHashStorage._write_records
    monkeypatch.setattr(
        TieredHashStorage,
        "_read",
        lambda self, slots, recs, st: reads.append(slots.numel()) or read(self, slots, recs, st),
    )
    monkeypatch.setattr(
        TieredHashStorage,
        "_write_records",
        lambda self, keys, tabs, data, last=None, freq=None: (
            writes.append(keys.numel()) or write(self, keys, tabs, data, last, freq)
        ),
    )
    return reads, writes


def _fresh(where, seed: int = 2):
    """Tables to load into: tiered under ``where`` (None: in memory), and their optimizer."""
    tiered = he.Tiered(where, cache_rows=60) if where is not None else None
    ec = he.EmbeddingCollection(_tables(tiered, OPTIMIZERS["adagrad"]), seed=seed)
    return ec, he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec)


def test_a_checkpoint_of_a_tiered_dynamic_table_is_written_and_read_a_file_at_a_time(tmp_path, monkeypatch):
    adagrad = OPTIMIZERS["adagrad"]
    ref = he.EmbeddingCollection(_tables(None, adagrad), seed=2)
    ec = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "a", cache_rows=60), adagrad), seed=2)
    opt_ref, opt = _train(ref, steps=10), _train(ec, steps=10)
    rows = {t: int(ec.storage_of(t).stats(t)["rows"]) for t in ("a", "b")}
    assert ec.storage_of("a").stats()["disk_rows"] > 100, rows  # (most rows on disk)
    _pieces(monkeypatch, 16)
    reads, writes = _reads_and_writes(monkeypatch)
    he.save(tmp_path / "ck", ec, opt)
    assert reads and max(reads) <= 16 and sum(reads) == sum(rows.values()), reads
    manifest = he.checkpoint.read_manifest(tmp_path / "ck")
    for t, n in rows.items():
        shards = manifest["tables"][t]["shards"]
        assert len(shards) == -(-n // 16) and manifest["tables"][t]["rows"] == n
        assert [s.get("part", 0) for s in shards] == list(range(len(shards)))
        assert [s["rows"] for s in shards] == [n] + [0] * (len(shards) - 1)  # (the first says the table's)
        for s in shards:  # (each file holds its rows alone, no view of a larger tensor)
            got = torch.load(os.path.join(manifest["path"], s["file"]))
            assert all(v.untyped_storage().nbytes() == v.nbytes for v in got.values() if torch.is_tensor(v))

    reads.clear()
    back, opt_back = _fresh(tmp_path / "b")
    he.load(tmp_path / "ck", back, opt_back)
    assert not reads and writes and max(writes) <= 16 and sum(writes) == sum(rows.values()), writes
    assert back.storage_of("a").stats()["disk_rows"] == sum(
        rows.values()
    )  # (loaded to disk; read into the cache on use)
    monkeypatch.undo()
    mem, opt_mem = _fresh(None)
    he.load(tmp_path / "ck", mem, opt_mem)
    _same(_state(back), _state(ref))
    _same(_state(mem), _state(ref))
    for m, o in ((ref, opt_ref), (back, opt_back), (mem, opt_mem)):  # the optimizer's step and state came too
        _train(m, steps=4, seed=11, opt=o)
    _same(_state(back), _state(ref))
    _same(_state(mem), _state(ref))


def test_incremental_versions_and_their_compaction_are_written_a_file_at_a_time(tmp_path, monkeypatch):
    """An incremental version holds the rows changed since the last, in files of at most the piece's
    rows; the chain loads as the table; compacting it writes it again file by file, and that loads
    the same, bit for bit."""
    rowwise = OPTIMIZERS["rowwise"]
    ref = he.EmbeddingCollection(_tables(None, rowwise), seed=8)
    ec = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "a", cache_rows=60), rowwise), seed=8)
    opt_ref, opt = _train(ref, steps=8), _train(ec, steps=8)
    _pieces(monkeypatch, 16)
    he.save(tmp_path / "ck", ec, opt, incremental=True)  # (the first: full)
    touched = train_alike(((ref, opt_ref), (ec, opt)), _batch, torch.Generator().manual_seed(21))
    reads, writes = _reads_and_writes(monkeypatch)
    he.save(tmp_path / "ck", ec, opt, incremental=True)
    manifest = he.checkpoint.read_manifest(tmp_path / "ck")
    assert manifest["incremental"]["length"] == 1
    per = 16 * ROW_BYTES // (8 * 4 + 24 + 4)  # rows a file: row-wise Adagrad keeps one float a row
    for t in ("a", "b"):
        shards = manifest["tables"][t]["shards"]
        assert sum(s["changed"] for s in shards) == len(touched[t]) and len(shards) == -(-len(touched[t]) // per)
    assert max(reads) <= per, reads

    want = _state(ref)
    loaded = []
    for where in (tmp_path / "b", None):
        m = he.EmbeddingCollection(_tables(he.Tiered(where, 60) if where else None, rowwise), seed=8)
        he.load(tmp_path / "ck", m, he.wrap_optimizer(torch.optim.SGD(m.parameters(), lr=0.1), m))
        _same(_state(m), want)
        loaded.append(m)
    writes.clear()
    done = he.checkpoint.compact(tmp_path / "ck")
    compacted = he.checkpoint.read_manifest(tmp_path / "ck")
    assert "incremental" not in compacted and done.endswith(os.path.basename(compacted["path"]))
    for t in ("a", "b"):
        shards = compacted["tables"][t]["shards"]
        n = int(ec.storage_of(t).stats(t)["rows"])
        assert len(shards) == -(-n // per) and shards[0]["rows"] == n and "changed" not in shards[0]
    listed = {s["file"] for t in compacted["tables"].values() for s in t["shards"]}
    assert set(compacted["files"]) == listed | {"dense.pt", "optimizer.pt"}  # (the chain's own parts not copied)
    for f in listed:  # (each file its rows alone: no view of a part read from the chain's files)
        got = torch.load(os.path.join(compacted["path"], f))
        tensors = [v for v in got.values() if torch.is_tensor(v)] + list(got["state"].values())
        assert all(v.untyped_storage().nbytes() == v.nbytes for v in tensors), f
    for where in (tmp_path / "c", None):
        m = he.EmbeddingCollection(_tables(he.Tiered(where, 60) if where else None, rowwise), seed=8)
        opt_m = he.wrap_optimizer(torch.optim.SGD(m.parameters(), lr=0.1), m)
        he.load(tmp_path / "ck", m, opt_m)
        _same(_state(m), want)
        _train(m, steps=3, seed=5, opt=opt_m)
        loaded.append(m)
    _train(ref, steps=3, seed=5, opt=opt_ref)
    for m in loaded[2:]:
        _same(_state(m), _state(ref))


def test_a_damaged_part_or_a_part_without_its_first_is_refused_and_changes_nothing(tmp_path, monkeypatch):
    ec = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "a", cache_rows=60), OPTIMIZERS["adagrad"]), seed=4)
    opt = _train(ec, steps=6)
    _pieces(monkeypatch, 32)
    he.save(tmp_path / "ck", ec, opt)
    vdir = he.checkpoint.read_manifest(tmp_path / "ck")["path"]
    target, opt_target = _fresh(tmp_path / "b", seed=5)
    _train(target, steps=2, opt=opt_target)
    before = _state(target)

    piece = os.path.join(vdir, "tables", "b.00001.pt")
    saved = torch.load(piece)
    with open(piece, "rb") as f:
        original = f.read()
    assert "stats" not in saved and saved["ids"].numel() == 32  # (a later part: rows only)
    size = os.path.getsize(piece)
    bad = {"weight": saved["weight"].reshape(16, 16).clone(), "state": {"sum": saved["state"]["sum"].reshape(16, 16)}}
    torch.save(saved | bad, piece)  # (as many bytes: found by the per-file check, not the file size)
    assert os.path.getsize(piece) == size
    with pytest.raises(he.CheckpointError, match=r"b\.00001\.pt' does not hold 'weight' of shape \(32, 8\)"):
        he.load(tmp_path / "ck", target, opt_target, verify=False)
    _same(_state(target), before)
    torch.save(saved | {"ids": saved["ids"] * 0}, piece)  # (an id many times)
    with pytest.raises(he.CheckpointError, match="an id appears more than once"):
        he.load(tmp_path / "ck", target, opt_target, verify=False)
    _same(_state(target), before)
    with open(piece, "wb") as f:
        f.write(original)
    he.load(tmp_path / "ck", target, opt_target)  # (restored: loads)

    after = _state(target)
    mpath = os.path.join(vdir, "manifest.json")
    with open(mpath) as f:
        body = json.load(f)
    body.pop(CHECKSUM_KEY)
    body["tables"]["b"]["shards"] = body["tables"]["b"]["shards"][1:]  # (the first part gone)
    with open(mpath, "w") as f:
        f.write(json.dumps(_sealed(body)))
    with pytest.raises(he.CheckpointError, match="table 'b': a shard's later part without its first"):
        he.load(tmp_path / "ck", target, opt_target, verify=False)
    _same(_state(target), after)


@pytest.mark.parametrize("sizes", [[5, 7, 3], [10], [4, 6], [0, 3, 0, 9], [2]])
def test_compaction_regroups_parts_into_files_of_their_own_rows(sizes):
    """``_repacked``: parts of any sizes (views of one larger tensor, as a part read from a mapped
    file is) regrouped 5 rows at a time, in order, each group's tensors its own."""
    from hybridembed.checkpoint.local import _repacked

    n = sum(sizes)
    big = {"ids": torch.arange(100), "weight": torch.randn(100, 3), "state": {"sum": torch.randn(100)}}
    edges = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    parts = [
        {"ids": big["ids"][a:b], "weight": big["weight"][a:b], "state": {"sum": big["state"]["sum"][a:b]}}
        for a, b in zip(edges, edges[1:])
    ]
    got = list(_repacked(iter(parts), 5))
    assert [g["ids"].numel() for g in got] == [5] * (n // 5) + ([n % 5] if n % 5 else [])
    assert torch.equal(torch.cat([g["ids"] for g in got]), big["ids"][:n])
    assert torch.equal(torch.cat([g["weight"] for g in got]), big["weight"][:n])
    assert torch.equal(torch.cat([g["state"]["sum"] for g in got]), big["state"]["sum"][:n])
    for g in got:
        for v in (g["ids"], g["weight"], g["state"]["sum"]):
            assert v.untyped_storage().nbytes() == v.nbytes  # (not a view of `big`)


def test_a_chain_whose_last_delta_fits_one_file_compacts_file_by_file_and_reloading_grows_nothing(
    tmp_path, monkeypatch
):
    ec = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "a", cache_rows=60), OPTIMIZERS["adagrad"]), seed=3)
    opt = _train(ec, steps=8)
    _pieces(monkeypatch, 16)
    he.save(tmp_path / "ck", ec, opt, incremental=True)  # (the base: in parts)
    opt.zero_grad()
    sum(v.sum() for v in ec({"a": torch.tensor([1, 2]), "b": he.Jagged.from_lists([[3]])}).values()).backward()
    opt.step()
    he.save(tmp_path / "ck", ec, opt, incremental=True)  # (the delta: a file a table)
    delta = he.checkpoint.read_manifest(tmp_path / "ck")["tables"]
    assert all(len(delta[t]["shards"]) == 1 for t in ("a", "b"))
    he.checkpoint.compact(tmp_path / "ck")
    compacted = he.checkpoint.read_manifest(tmp_path / "ck")["tables"]
    for t in ("a", "b"):
        n = int(ec.storage_of(t).stats(t)["rows"])
        assert len(compacted[t]["shards"]) == -(-n // 16), t  # (file by file, not one file of the whole table)
    back, opt_back = _fresh(tmp_path / "b", seed=3)
    he.load(tmp_path / "ck", back, opt_back)
    _same(_state(back), _state(ec))
    st = back.storage_of("a")
    grown = st.memory_bytes
    he.load(tmp_path / "ck", back, opt_back)  # (again, into the same tables: their records are reused)
    assert st.memory_bytes == grown
    _same(_state(back), _state(ec))
