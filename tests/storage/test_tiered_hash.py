"""Tiered dynamic tables (``TableConfig(None, dim, dynamic=he.Dynamic(), tiered=he.Tiered(...))``:
any int64 id, rows beyond a bounded cache spilled to disk) against the same dynamic tables in memory:
every optimizer, admission, lru and lfu, eval lookups; state_dict and checkpoints (full and
incremental, into tiers or memory); refusals that change nothing."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import torch

import hybridembed as he
from hybridembed.optim import sparse as so
from hybridembed.storage import mapped as mapped_mod
from hybridembed.storage import records, tiered_hash
from hybridembed.storage.tiered_file import _File
from hybridembed.storage.tiered_hash import TieredHashStorage

OPTIMIZERS = {
    "sgd": so.SGD(lr=0.1),
    "adagrad": so.Adagrad(lr=0.1, initial_accumulator_value=0.1),
    "rowwise": so.RowWiseAdagrad(lr=0.1),
    "adam": so.Adam(lr=0.01),
    "ftrl": so.Ftrl(lr=0.1),  # (no fused kernel: the eager update)
}


def _tables(tiered: he.Tiered | None, opt=None, **dynamic) -> list[he.TableConfig]:
    dyn = he.Dynamic(**dynamic)
    return [
        he.TableConfig("a", None, 8, optimizer=opt, dynamic=dyn, tiered=tiered),
        he.TableConfig("b", None, 8, combiner="mean", optimizer=opt, dynamic=dyn, tiered=tiered),
    ]


def _batch(g: torch.Generator) -> dict:
    ids = (torch.rand(24, generator=g) ** 3 * 400).long() - 7  # (power-law-ish, negative ids too)
    return {
        "a": (torch.rand(16, generator=g) ** 2 * 10**9).long() % 300,
        "b": he.Jagged.from_lengths(ids, torch.tensor([5, 7, 0, 12])),
    }


def _loss(out: dict) -> torch.Tensor:
    return sum((v * torch.linspace(-1, 2, v.shape[1])).sum() for v in out.values())


def _train(ec, steps: int = 30, seed: int = 0, opt=None):
    opt = opt or he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        _loss(ec(_batch(g))).backward()
        opt.step()
    return opt


def _state(ec) -> dict:
    out = {}
    for s in {id(ec.storage_of(n)): ec.storage_of(n) for n in ec.tables}.values():
        if hasattr(s, "rec_live"):  # (the count of rows on disk, kept step by step, against the flags)
            assert s._disk_rows() == int(s.rec_live.sum()), (s._disk_rows(), int(s.rec_live.sum()))
            live = (s.slot_table >= 0).nonzero().squeeze(1)  # (each cached row's kept index position holds it)
            if live.numel():
                row = s._hrow.index_select(0, s.slot_pos.index_select(0, live))
                assert torch.equal(row[:, 0], s.slot_key[live]) and torch.equal(row[:, 1] & ((1 << 32) - 1), live)
    for n in ec.tables:
        ids, rows, state = ec.storage_of(n).read_ids(n)
        out[f"{n}.ids"], out[n] = ids, rows
        out |= {f"{n}.{k}": v for k, v in state.items()}
        stats = ec.storage_of(n).table_stats(n)
        out[f"{n}.stats"] = torch.tensor([stats[k] for k in ("size", "inserted", "rejected", "hits", "lookups")])
    return out


def _same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("mapped", [None, False])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_tiered_dynamic_table_trains_as_the_table_in_memory(tmp_path, name, mapped, monkeypatch):
    """Records read through a mapping (None: this small file is; a row read back goes to disk
    again in its place, and no place dies) or by system calls (each spill appends its rows to the
    file, which is compacted when mostly dead: often here)."""
    monkeypatch.setattr(TieredHashStorage, "COMPACT_AT", 50)
    opt = OPTIMIZERS[name]
    ref = he.EmbeddingCollection(_tables(None, opt), seed=3)
    _train(ref)
    ec = he.EmbeddingCollection(_tables(he.Tiered(tmp_path, cache_rows=60, mapped=mapped), opt), seed=3)
    _train(ec)
    st = ec.storage_of("a")
    assert isinstance(st, TieredHashStorage) and st.weight.shape[0] == 61  # (the cache never grows)
    assert (st._file.map is not None) == (mapped is None) and not st._file.map_writes
    stats = st.stats()
    assert stats["spilled"] > 100 and stats["read_back"] > 50 and stats["disk_rows"] > stats["cache_rows"], stats
    if mapped is None:  # (one place a record, at most: a place dies only where a record's row is dropped)
        assert stats["compactions"] == 0 and st._tail == st._placed == int((st.rec_at >= 0).sum()), stats
        assert st._placed <= st._homes.n and st._tail < stats["spilled"], (st._tail, stats)
    else:
        assert stats["compactions"] >= 1 and st._placed == int((st.rec_at >= 0).sum()), stats
    assert stats["rows"] == sum(ref.storage_of("a").stats()["rows"] for _ in [0])
    _same(_state(ec), _state(ref))
    ec.eval(), ref.eval()  # eval: rows on disk are read back; unknown ids get the default row, admitted nowhere
    g = torch.Generator().manual_seed(99)
    for _ in range(3):
        b = _batch(g)
        for f, x in ec(b).items():
            torch.testing.assert_close(x, ref(b)[f], rtol=0, atol=0)
    assert ec.storage_of("a").stats()["rows"] == ref.storage_of("a").stats()["rows"]


@pytest.mark.parametrize(
    "dynamic", [{"eviction": "lfu"}, {"eviction": "lru"}, {"min_count": 2}, {"admit_probability": 0.5}]
)
def test_which_rows_stay_in_memory_and_admission_do_not_change_the_result(tmp_path, dynamic):
    ref = he.EmbeddingCollection(_tables(None, OPTIMIZERS["adagrad"], **dynamic), seed=1)
    ec = he.EmbeddingCollection(_tables(he.Tiered(tmp_path, cache_rows=60), OPTIMIZERS["adagrad"], **dynamic), seed=1)
    _train(ref, seed=4)
    _train(ec, seed=4)
    _same(_state(ec), _state(ref))


def test_state_dict_and_checkpoints_full_and_incremental_through_the_tiers(tmp_path):
    adagrad = OPTIMIZERS["adagrad"]
    ref = he.EmbeddingCollection(_tables(None, adagrad), seed=2)
    ec = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "a", cache_rows=60), adagrad), seed=2)
    opt_ref, opt = _train(ref, steps=10), _train(ec, steps=10)
    sd, sd_ref = ec.state_dict(), ref.state_dict()
    assert sd.keys() == sd_ref.keys()
    for k, v in sd_ref.items():
        torch.testing.assert_close(sd[k], v, rtol=0, atol=0)
    he.save(tmp_path / "ck", ec, opt)
    _train(ec, steps=6, seed=5, opt=opt)
    _train(ref, steps=6, seed=5, opt=opt_ref)
    he.save(tmp_path / "ck", ec, opt, incremental=True)  # (rows changed in the cache and on disk since)
    loaded = []
    for tiered in (he.Tiered(tmp_path / "b", cache_rows=60), None):  # into tiers and into memory
        back = he.EmbeddingCollection(_tables(tiered, adagrad), seed=2)  # (rows made later: keyed by the seed)
        opt_back = he.wrap_optimizer(torch.optim.SGD(back.parameters(), lr=0.1), back)
        he.load(tmp_path / "ck", back, opt_back)
        _same(_state(back), _state(ref))
        loaded.append((back, opt_back))
    _train(ref, steps=5, seed=11, opt=opt_ref)
    for back, opt_back in loaded:  # and they go on as the reference
        _train(back, steps=5, seed=11, opt=opt_back)
        _same(_state(back), _state(ref))
    # a checkpoint of the table in memory loads into tiers too
    he.save(tmp_path / "ck_ref", ref, opt_ref)
    other = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "c", cache_rows=60), adagrad), seed=2)
    opt_other = he.wrap_optimizer(torch.optim.SGD(other.parameters(), lr=0.1), other)
    he.load(tmp_path / "ck_ref", other, opt_other)
    _same(_state(other), _state(ref))
    assert other.storage_of("a").stats()["disk_rows"] == other.storage_of("a").stats()["rows"]  # (loaded to disk)


def test_refusals_change_nothing(tmp_path, monkeypatch):
    with pytest.raises(he.ConfigError, match="Dynamic\\(capacity=None\\)"):
        he.TableConfig("a", None, 8, dynamic=he.Dynamic(capacity=100), tiered=he.Tiered(tmp_path, 10))
    with pytest.raises(he.ConfigError, match="'ttl'"):
        he.TableConfig("a", None, 8, dynamic=he.Dynamic(eviction="ttl", ttl_steps=3), tiered=he.Tiered(tmp_path, 10))
    ec = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "t", cache_rows=40), OPTIMIZERS["adagrad"]), seed=1)
    opt = _train(ec, steps=5)
    before = _state(ec)
    with pytest.raises(
        he.HybridEmbedError, match=r"this batch needs \d+ rows in the cache, 0 of its 40 slots.*Nothing was changed"
    ):
        ec({"a": torch.arange(1000, 1050), "b": torch.arange(3)})  # (more distinct rows than the cache)
    _same(_state(ec), before)

    def full(self, rows):
        raise he.HybridEmbedError(f"tiered table file {self.path}: cannot grow (No space left on device)")

    monkeypatch.setattr(_File, "reserve", full)
    with pytest.raises(he.HybridEmbedError, match="No space left"):  # (a spill needs room on a full disk)
        for step in range(50):
            opt.zero_grad()
            _loss(ec({"a": torch.arange(2000 + 30 * step, 2030 + 30 * step), "b": torch.arange(3)})).backward()
            opt.step()
            before = _state(ec)
    _same(_state(ec), before)
    monkeypatch.undo()
    _train(ec, steps=3, opt=opt)  # (it goes on once there is room)


@pytest.mark.parametrize("mapped", [True, False])
def test_a_records_file_cut_short_under_the_table_is_a_clear_error_not_rows_of_zeros(tmp_path, mapped, monkeypatch):
    """The file of spilled records truncated while the table lives: the next lookup that reads or
    spills raises, naming the file (read by system calls, its missing records read as zeros, and a
    spill's write grew the file again before the read)."""
    monkeypatch.setattr(mapped_mod, "memory_limit", lambda: (1 << 40) if mapped else 1)
    ec = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "t", cache_rows=40)), seed=1)
    _train(ec, steps=8)
    st = ec.storage_of("a")
    assert st.stats()["spilled"] > 0 and (st._file.map is not None) == mapped
    os.truncate(st._file.path, 0)
    with pytest.raises(he.HybridEmbedError, match="shorter than its rows"):
        _train(ec, steps=8)


def test_the_records_index_lives_in_mapped_files_and_a_full_disk_growing_it_changes_nothing(tmp_path, monkeypatch):
    """The per-record arrays and index are files of the table's directory mapped into memory (not
    the process's memory), unlinked at once; when the disk cannot hold them grown, the batch is
    refused and nothing changes. (Rebuilds go a window of 64 positions at a time, batches a span.)"""
    monkeypatch.setattr(records.Homes, "_WINDOW_BYTES", 64 * records.Homes._BYTES)
    ref = he.EmbeddingCollection(_tables(None, OPTIMIZERS["adagrad"]), seed=1)
    ec = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "t", cache_rows=40), OPTIMIZERS["adagrad"]), seed=1)
    opts = [_train(m, steps=5) for m in (ref, ec)]
    st = ec.storage_of("a").stats()
    positions = ec.storage_of("a")._homes._mask + 1  # (records' arrays: 1,024 at least; 16 bytes a position)
    assert st["disk_rows"] > 0 and st["index_bytes"] >= 1024 * (8 + 8 + 8 + 2) + 16 * positions, st
    maps = [x for x in open("/proc/self/maps").read().splitlines() if str(tmp_path / "t" / ".mapped-") in x]
    assert maps and all(x.endswith("(deleted)") for x in maps), (
        maps
    )  # (mapped, unlinked; the records' file, mapped too, stays)
    assert not list((tmp_path / "t").glob(".mapped-*"))
    real = tiered_hash.os.posix_fallocate

    def full(fd, offset, size):  # (no room for the index's files alone)
        if ".mapped-" in tiered_hash.os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(28, "No space left on device")
        return real(fd, offset, size)

    monkeypatch.setattr(tiered_hash.os, "posix_fallocate", full)
    before, made = _state(ec), 0
    with pytest.raises(he.HybridEmbedError, match="No space left on device.*nothing was changed"):
        for step in range(100):  # (30 new ids a step: the records outgrow their arrays)
            opts[1].zero_grad()
            _loss(ec({"a": torch.arange(2000 + 30 * step, 2030 + 30 * step), "b": torch.arange(3)})).backward()
            opts[1].step()
            before, made = _state(ec), step + 1
    _same(_state(ec), before)
    monkeypatch.undo()
    for step in range(made + 1):  # (it goes on with the refused batch once there is room: as the table in memory)
        for m, o in zip((ref, ec) if step == made else (ref,), opts):
            o.zero_grad()
            _loss(m({"a": torch.arange(2000 + 30 * step, 2030 + 30 * step), "b": torch.arange(3)})).backward()
            o.step()
    _same(_state(ec), _state(ref))


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.user = torch.nn.Embedding(500, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.user(ids)).squeeze(1)


def test_a_converted_layer_made_dynamic_and_tiered_trains_as_the_plain_layer(tmp_path):
    """``he.convert(model, tables={layer: {"dynamic": ..., "tiered": ...}}, copy_dynamic_rows=True)``:
    the layer's rows as ids 0..N-1, most of them on disk; Adagrad (lazy = dense) as torch's."""
    plain = _Model()
    spec = {"user": {"dynamic": he.Dynamic(), "tiered": he.Tiered(tmp_path, cache_rows=64)}}
    model = he.convert(_Model(), tables=spec, copy_dynamic_rows=True)
    st = model.user.collection.storage_of(model.user.table)
    assert isinstance(st, TieredHashStorage) and st.stats()["disk_rows"] >= 500 - 64
    opts = [torch.optim.Adagrad(plain.parameters(), lr=0.1)]
    opts.append(he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model))
    g = torch.Generator().manual_seed(1)
    for _ in range(12):
        ids = torch.randint(0, 500, (40,), generator=g)
        for m, o in zip((plain, model), opts):
            o.zero_grad()
            m(ids).pow(2).mean().backward()
            o.step()
    ids, rows = model.user.collection.dynamic_rows(model.user.table)
    assert torch.equal(ids, torch.arange(500))
    torch.testing.assert_close(rows, plain.user.weight.detach(), rtol=1e-6, atol=1e-7)


def _prefetched_runs(tmp_path, steps: int, ahead: int) -> dict:
    """The same batches trained in memory and tiered (a cache of 60 rows), the tiered one calling
    ``ec.prefetch(the batch ahead steps on)`` after each backward: {"memory": ec, "tiered": ec}."""
    g = torch.Generator().manual_seed(3)
    batches = [_batch(g) for _ in range(steps)]
    runs = {}
    for kind in ("memory", "tiered"):
        tiered = he.Tiered(tmp_path / kind, cache_rows=60, mapped=False) if kind == "tiered" else None
        ec = he.EmbeddingCollection(_tables(tiered, OPTIMIZERS["adagrad"]), seed=3)
        opt = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec)
        for i, b in enumerate(batches):
            opt.zero_grad()
            _loss(ec(b)).backward()
            if i + ahead < len(batches):
                ec.prefetch(batches[i + ahead])
            opt.step()
        runs[kind] = ec
    return runs


@pytest.mark.parametrize("ahead", [1, 2])
@pytest.mark.parametrize("compact", [False, True, "slow"])
def test_prefetched_rows_of_a_dynamic_table_train_as_in_memory(tmp_path, ahead, compact, monkeypatch):
    """ec.prefetch(a later batch) finds and reads its rows on disk in a background thread; read
    back, they come from memory. Two batches ahead, some records are written again before their
    batch comes: read again (equal to the table in memory either way). ``slow``: the thread's
    search of the records index takes long; the lookup waits for it and takes every row from it."""
    if compact is True:  # (a compaction moves rows on disk: it drops what was prefetched)
        monkeypatch.setattr(TieredHashStorage, "COMPACT_AT", 50)
    if compact == "slow":
        sort = tiered_hash.sort_pairs

        def slow(*args):
            if threading.current_thread() is not threading.main_thread():
                time.sleep(0.05)
            return sort(*args)

        monkeypatch.setattr(tiered_hash, "sort_pairs", slow)
    runs = _prefetched_runs(tmp_path, steps=30, ahead=ahead)
    stats = runs["tiered"].storage_of("a").stats()
    assert stats["prefetched"] > 50, stats
    if ahead == 2:  # (two prefetches held at once: the one for the batch after next is not dropped first)
        assert stats["prefetched"] > 0.7 * stats["read_back"], stats
    assert (stats["compactions"] > 0) == (compact is True), stats
    if (
        ahead == 1 and compact is not True
    ):  # (nothing is written between the prefetch and its lookup: every row read back came from it)
        assert stats["prefetched"] == stats["read_back"], stats
    _same(_state(runs["tiered"]), _state(runs["memory"]))


def test_a_failing_prefetch_of_a_dynamic_table_is_counted_logged_once_and_changes_nothing(
    tmp_path, monkeypatch, caplog
):
    """A prefetch whose thread fails (here its search of the records index) is dropped: the lookups
    read their rows themselves (equal to the table in memory), ``stats()["prefetch_failed"]``
    counts every failure, and the first one is logged (once: not a line a step)."""
    sort = tiered_hash.sort_pairs

    def failing(*args):
        if threading.current_thread() is not threading.main_thread():
            raise OSError(5, "Input/output error")
        return sort(*args)

    monkeypatch.setattr(tiered_hash, "sort_pairs", failing)
    with caplog.at_level(logging.WARNING, logger="hybridembed"):
        runs = _prefetched_runs(tmp_path, steps=12, ahead=1)
    st = runs["tiered"].storage_of("a")
    st.drop_prefetch()
    stats = st.stats()
    assert stats["prefetched"] == 0 and stats["read_back"] > 0, stats
    assert stats["prefetch_failed"] >= 5, stats  # (every prefetch once records were on disk)
    lines = [r.getMessage() for r in caplog.records if "a prefetch failed" in r.getMessage()]
    assert len(lines) == 1 and "OSError" in lines[0], lines
    _same(_state(runs["tiered"]), _state(runs["memory"]))


def _one(tmp_path, tiered: bool, cache: int = 4):
    t = he.TableConfig(
        "a", None, 4, optimizer=OPTIMIZERS["adagrad"], dynamic=he.Dynamic(),
        tiered=he.Tiered(tmp_path, cache_rows=cache, mapped=False) if tiered else None,
    )  # fmt: skip
    ec = he.EmbeddingCollection([t], seed=1)
    return ec, he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec)


def _step(ec, opt, ids: list[int]) -> None:
    opt.zero_grad()
    ec({"a": torch.tensor(ids)})["a"].sum().backward()
    opt.step()


def test_rows_on_disk_reloaded_reattached_and_read_after_a_failed_read_stay_exact(tmp_path, monkeypatch):
    """Regressions: an incremental save after a reload says which rows on disk were dropped; a new
    optimizer's fresh state reaches rows on disk in the next delta; a read that fails changes nothing;
    a reload on a full disk changes nothing."""
    for tiered in (False, True):  # an incremental checkpoint after load_state_dict: the dropped rows stay dropped
        ec, opt = _one(tmp_path / f"t{tiered}", tiered)
        _step(ec, opt, [0, 1, 2, 3])
        _step(ec, opt, [10, 11, 12, 13])  # (tiered: 0..3 on disk)
        other, o2 = _one(tmp_path / f"o{tiered}", False)
        _step(other, o2, [10, 11])
        he.save(tmp_path / f"ck{tiered}", ec, opt)
        ec.load_state_dict(other.state_dict())
        he.save(tmp_path / f"ck{tiered}", ec, opt, incremental=True)
        back, ob = _one(tmp_path / f"b{tiered}", False)
        he.load(tmp_path / f"ck{tiered}", back, ob)
        assert back.storage_of("a").read_ids("a")[0].tolist() == [10, 11]
    ec, opt = _one(tmp_path / "r", True)  # a new optimizer: the rows on disk get fresh state, saved as such
    _step(ec, opt, [0, 1, 2, 3])
    _step(ec, opt, [10, 11, 12, 13])
    he.save(tmp_path / "ck_r", ec, opt)
    opt = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec, sparse=so.Adagrad(lr=0.1))
    he.save(tmp_path / "ck_r", ec, opt, incremental=True)
    back, ob = _one(tmp_path / "rb", False)
    he.load(tmp_path / "ck_r", back, ob)
    _same(_state(back), _state(ec))
    good = _state(ec)
    real = _File.read

    def broken(self, rows):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(_File, "read", broken)
    ec.eval()
    with pytest.raises(OSError):
        ec({"a": torch.tensor([0, 1])})  # (on disk: the read fails)
    monkeypatch.setattr(_File, "read", real)
    _same(_state(ec), good)
    assert torch.equal(ec({"a": torch.tensor([0, 1])})["a"], good["a"][:2])
    big, ob = _one(tmp_path / "big", False)
    _step(big, ob, list(range(3000)))  # (more rows than the files have room for)
    monkeypatch.setattr(_File, "reserve", lambda self, rows: (_ for _ in ()).throw(he.HybridEmbedError("disk full")))
    with pytest.raises(he.HybridEmbedError, match="disk full"):
        ec.load_state_dict(big.state_dict())
    _same(_state(ec), good)


def test_a_table_stepped_by_another_optimizer_is_refused_not_corrupted(tmp_path):
    """Rows a training lookup handed out stay cached until he.wrap_optimizer's step: with a plain
    torch optimizer they never leave, so the cache fills and a lookup is refused (a pending
    gradient would otherwise land on the id that took its slot)."""
    t = he.TableConfig("a", None, 4, dynamic=he.Dynamic(), tiered=he.Tiered(tmp_path, cache_rows=4))
    ec = he.EmbeddingCollection([t], seed=1)
    ec({"a": torch.tensor([0, 1, 2, 3])})["a"].sum().backward()
    with pytest.raises(he.HybridEmbedError, match="rows looked up since the last optimizer step stay"):
        ec({"a": torch.tensor([10, 11])})


def _on_a_server(rank: int, world: int, where: str):
    """Tiered dynamic tables on a parameter server (rank 1): rows beyond its cache on its disk."""
    tables = _tables(he.Tiered(f"{where}/rank{rank}", cache_rows=60), OPTIMIZERS["rowwise"])
    model = he.distribute(
        torch.nn.ModuleDict({"ec": he.EmbeddingCollection(tables, seed=3)}), servers=1, server_exit=False
    )
    if model is None:  # (the server: it served until the trainer finished)
        return None
    opt = he.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        opt.zero_grad()
        _loss(model["ec"](_batch(g))).backward()
        opt.step()
    he.save(f"{where}/ck", model, opt)
    return {t: model["ec"].gather_table(t) for t in ("a", "b")}


def test_tiered_dynamic_tables_on_a_parameter_server_train_as_in_memory(tmp_path):
    from hybridembed.launch import spawn

    got, served = spawn(_on_a_server, 2, str(tmp_path), timeout=120)
    files = [p for p in (tmp_path / "rank1").iterdir() if p.suffix == ".rows"]
    assert served is None and files and max(p.stat().st_size for p in files) > 1  # (the server spilled rows)
    ref = he.EmbeddingCollection(_tables(None, OPTIMIZERS["rowwise"]), seed=3)
    _train(ref, steps=20)
    for t in ("a", "b"):
        ids, rows = ref.dynamic_rows(t)
        assert torch.equal(got[t][0], ids), t
        torch.testing.assert_close(got[t][1], rows, rtol=1e-6, atol=1e-7, msg=t)
    mem = he.EmbeddingCollection(_tables(None, OPTIMIZERS["rowwise"]), seed=0)  # the server's checkpoint, into memory
    he.load(
        tmp_path / "ck", torch.nn.ModuleDict({"ec": mem}), he.wrap_optimizer(torch.optim.SGD(mem.parameters()), mem)
    )
    want = _state(ref)
    got_state = _state(mem)
    for k in want:
        if not k.endswith(".stats"):  # (the counters: the server's table counts its pulls, not the trainer's lookups)
            torch.testing.assert_close(got_state[k], want[k], rtol=1e-6, atol=1e-7, msg=k)


_KILLED = r"""
import os, signal, sys, torch
import hybridembed as he
from hybridembed.checkpoint import layout
sys.path.insert(0, sys.argv[2])
from test_tiered_hash import OPTIMIZERS, _seeded_step, _tables

where = sys.argv[1]
ec = he.EmbeddingCollection(_tables(he.Tiered(where + "/tiers", cache_rows=60), OPTIMIZERS["adagrad"]), seed=6)
opt = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec)
for s in range(6):
    _seeded_step(ec, opt, s)
    if s == 2:
        he.save(where + "/ck", ec, opt, extra={"step": 3})
"""


def _seeded_step(ec, opt, s: int) -> None:
    g = torch.Generator().manual_seed(100 + s)
    opt.zero_grad()
    _loss(ec(_batch(g))).backward()
    opt.step()


def test_a_job_killed_in_a_save_resumes_from_the_last_commit_and_trains_as_in_memory(tmp_path):
    """A process training tiered dynamic tables is killed (SIGKILL) in the middle of a save: the
    last committed checkpoint loads into fresh tiered tables (the dead one's files are scratch),
    and training on from there equals an uninterrupted run in memory, bit for bit."""
    from .test_tiered import run_killed  # (here: the job's script imports this module as a top-level one)

    run_killed(_KILLED, tmp_path, 1)
    again = he.Tiered(tmp_path / "again", cache_rows=60)  # (rows made later are keyed by the seed, as the run's)
    ec = he.EmbeddingCollection(_tables(again, OPTIMIZERS["adagrad"]), seed=6)
    opt = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec)
    assert he.load(tmp_path / "ck", ec, opt)["extra"] == {"step": 3}
    ref = he.EmbeddingCollection(_tables(None, OPTIMIZERS["adagrad"]), seed=6)
    opt_ref = he.wrap_optimizer(torch.optim.SGD(ref.parameters(), lr=0.1), ref)
    for s in range(12):
        _seeded_step(ref, opt_ref, s)
        if s >= 3:
            _seeded_step(ec, opt, s)
    assert ec.storage_of("a").stats()["spilled"] > 0  # (rows went to disk after the load)
    _same(_state(ec), _state(ref))


def test_spills_written_behind_slowly_train_as_the_table_in_memory(tmp_path, monkeypatch):
    """Each spill's write made 30 ms slower in the writer thread: the lookups, compactions and
    whole-table reads that follow meet writes in flight and wait for them, and the table trains as
    in memory."""
    from hybridembed.storage import tiered_file as T

    from .writes import slow_writes

    if T._io() is None:
        pytest.skip("Numba does not import here: spills are written at once")
    monkeypatch.setattr(TieredHashStorage, "COMPACT_AT", 20)
    seen = slow_writes(monkeypatch, T, 0.03)
    ref = he.EmbeddingCollection(_tables(None, OPTIMIZERS["rowwise"]), seed=5)
    _train(ref, steps=30, seed=2)
    tiered = he.Tiered(tmp_path, cache_rows=60, mapped=False)  # (every spill appended behind the step)
    ec = he.EmbeddingCollection(_tables(tiered, OPTIMIZERS["rowwise"]), seed=5)
    _train(ec, steps=30, seed=2)
    stats = ec.storage_of("a").stats()
    assert stats["read_back"] > 20 and stats["compactions"] >= 1 and seen["writes"] > 10, (stats, seen)
    assert seen["waits"] > 0, seen  # (some read or compaction met a write in flight)
    _same(_state(ec), _state(ref))


@pytest.mark.parametrize("kernels", ["eager", "auto"])
def test_a_spill_tombstones_the_positions_its_inserts_kept(tmp_path, kernels, monkeypatch):
    """The cache index keeps each row's position at insert (the torch ops' insert or Numba's) and
    a spill makes those positions tombstones without searching: every cached row's kept position
    holds it (``_state`` checks), and the table trains as in memory."""
    monkeypatch.setattr(TieredHashStorage, "COMPACT_AT", 50)
    ref = he.EmbeddingCollection(_tables(None, OPTIMIZERS["adagrad"]), seed=2, kernels=kernels)
    _train(ref, steps=20, seed=7)
    ec = he.EmbeddingCollection(
        _tables(he.Tiered(tmp_path, cache_rows=60), OPTIMIZERS["adagrad"]), seed=2, kernels=kernels
    )
    _train(ec, steps=20, seed=7)
    assert ec.storage_of("a").stats()["spilled"] > 50
    _same(_state(ec), _state(ref))


def test_records_are_read_through_a_mapping_while_the_file_takes_an_eighth_of_the_memory(tmp_path, monkeypatch):
    """Tiered(mapped=None): the file of records, which grows, is mapped for reads while it takes at
    most 1/8 of the memory this process may use (checked as it grows); the table trains as in
    memory, mapped and then not."""
    limit = 1500 * 64  # (bytes: 1,024 records of a row and Adagrad's state, 8 + 8 float32, but not 2,048)
    monkeypatch.setattr(mapped_mod, "memory_limit", lambda: 8 * limit)
    models = [
        he.EmbeddingCollection(_tables(t, OPTIMIZERS["adagrad"]), seed=4) for t in (None, he.Tiered(tmp_path, 60))
    ]
    opts = [he.wrap_optimizer(torch.optim.SGD(m.parameters(), lr=0.1), m) for m in models]
    g, seen = torch.Generator().manual_seed(2), []
    for _ in range(60):
        b = _batch(g)
        for m, opt in zip(models, opts):
            opt.zero_grad()
            _loss(m(b)).backward()
            opt.step()
        f = models[1].storage_of("a")._file
        held = models[1].storage_of("a")._prefetches
        was = held[-1] if held else None
        models[1].prefetch(b)  # (read ahead only while the file is not mapped)
        assert ((held[-1] if held else None) is not was) == (f.map is None), (f.map is None, held)
        size = os.fstat(f.fd).st_size
        seen.append((f.map.shape[0] * f.row_bytes if f.map is not None else 0, size, f.row_bytes))
    assert all(m == (size // rb * rb if size <= limit else 0) for m, size, rb in seen), seen
    assert {m > 0 for m, _, _ in seen} == {True, False} and seen[-1][2] == 64, seen
    _same(_state(models[1]), _state(models[0]))


def test_the_cache_keeps_often_seen_rows_by_default(tmp_path):
    """Dynamic(eviction=None) on a tiered table: the cache spills by lrfu (recency, each doubling of
    a row's count worth 8 lookups), which reads back fewer rows of a power-law stream than lru;
    either trains as in memory."""
    ref = he.EmbeddingCollection(_tables(None, OPTIMIZERS["adagrad"]), seed=1)
    _train(ref, steps=40)
    read_back = {}
    for eviction in (None, "lru"):
        tiered = he.Tiered(tmp_path / str(eviction), cache_rows=60)
        ec = he.EmbeddingCollection(_tables(tiered, OPTIMIZERS["adagrad"], eviction=eviction), seed=1)
        _train(ec, steps=40)
        read_back[eviction] = ec.storage_of("a").stats()["read_back"]
        _same(_state(ec), _state(ref))
    assert 0 < read_back[None] < read_back["lru"], read_back


def test_a_reload_leaves_the_dropped_rows_places_dead_and_a_forced_mapping_beyond_memory_appends(tmp_path, monkeypatch):
    """Written in place (mapped, the page cache holding the file), the rows a reload drops give up
    their places (counted dead: compacted), and the table trains as in memory after it. Mapped by
    ``Tiered(mapped=True)`` beyond what the page cache holds, spills are appended behind the step as
    for a file not mapped (a row written in place might make the kernel read its page first)."""
    monkeypatch.setattr(TieredHashStorage, "COMPACT_AT", 20)
    opt = OPTIMIZERS["adagrad"]
    ref = he.EmbeddingCollection(_tables(None, opt), seed=6)
    ec = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "a", cache_rows=60), opt), seed=6)
    opts = [_train(m, steps=25, seed=1) for m in (ref, ec)]
    st = ec.storage_of("a")
    assert st._in_place() and st.stats()["compactions"] == 0 and st._dead() == 0
    small = he.EmbeddingCollection(_tables(None, opt), seed=7)
    _train(small, steps=1, seed=2)
    for m in (ref, ec):
        m.load_state_dict(small.state_dict())
    assert st._placed == int((st.rec_at >= 0).sum()) and st._dead() == st._tail - st._placed > 20
    g = torch.Generator().manual_seed(3)
    for _ in range(10):
        b = _batch(g)
        for m, o in zip((ref, ec), opts):
            o.zero_grad()
            _loss(m(b)).backward()
            o.step()
    assert st.stats()["compactions"] >= 1 and st._placed == int((st.rec_at >= 0).sum())
    _same(_state(ec), _state(ref))

    writes = {"mapped": 0, "behind": 0}
    for name, key in (("write_mapped", "mapped"), ("write_behind", "behind")):
        real = getattr(_File, name)
        monkeypatch.setattr(
            _File, name, lambda f, *a, _r=real, _k=key: writes.__setitem__(_k, writes[_k] + 1) or _r(f, *a)
        )
    monkeypatch.setattr(mapped_mod, "memory_limit", lambda: 8 * 1024)  # (the page cache "holds" 1 KiB)
    forced = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "b", cache_rows=60, mapped=True), opt), seed=6)
    _train(forced, steps=25, seed=1)
    fs = forced.storage_of("a")
    assert fs._file.map is not None and not fs._file.fits and not fs._in_place()
    assert writes["behind"] > 5 and writes["mapped"] == 0, writes
    ref2 = he.EmbeddingCollection(_tables(None, opt), seed=6)
    _train(ref2, steps=25, seed=1)
    _same(_state(forced), _state(ref2))


def test_rows_looked_up_before_the_optimizer_is_attached_may_be_spilled_by_its_first_steps(tmp_path):
    """Training-mode lookups without a gradient before ``he.wrap_optimizer``: the first steps spill
    those rows (they were refused: every row seen since the table was built stayed), and the table
    trains as in memory."""
    models = []
    for tiered in (None, he.Tiered(tmp_path, cache_rows=40)):
        t = he.TableConfig("a", None, 8, optimizer=OPTIMIZERS["adagrad"], dynamic=he.Dynamic(), tiered=tiered)
        ec = he.EmbeddingCollection([t], seed=1)
        for i in range(5):
            with torch.no_grad():
                ec({"a": torch.arange(30 * i, 30 * i + 30)})
        opt = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec)
        for i in range(5):
            opt.zero_grad()
            ec({"a": torch.arange(1000 + 30 * i, 1030 + 30 * i)})["a"].sum().backward()
            opt.step()
        models.append(ec)
    assert models[1].storage_of("a").stats()["spilled"] > 150
    _same(_state(models[1]), _state(models[0]))
