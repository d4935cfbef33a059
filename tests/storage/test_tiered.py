"""Tiered tables (``he.Tiered``: rows on disk, a bounded cache in memory) against the same tables
in memory: every optimizer, both CPU kernel backends, after many evictions; state_dict and
checkpoints; refusals that change nothing."""

from __future__ import annotations

import copy
import errno
import os
import re
from pathlib import Path

import pytest
import torch

import hybridembed as he
from hybridembed.optim import sparse as so
from hybridembed.storage import TieredStorage
from hybridembed.storage import tiered as tiered_mod

OPTIMIZERS = {
    "sgd": so.SGD(lr=0.1),
    "adagrad": so.Adagrad(lr=0.1, initial_accumulator_value=0.1),
    "rowwise": so.RowWiseAdagrad(lr=0.1),
    "adam": so.Adam(lr=0.01),
    "rmsprop": so.RMSprop(lr=0.01),  # (no fused kernel: the eager update)
}


def _tables(tiered: he.Tiered | None, opt=None) -> list[he.TableConfig]:
    return [
        he.TableConfig("a", 300, 8, optimizer=opt, tiered=tiered),
        he.TableConfig("b", 200, 8, combiner="mean", optimizer=opt, tiered=tiered),
    ]


def _batch(g: torch.Generator) -> dict:
    ids = (torch.rand(24, generator=g) ** 3 * 200).long()  # (power-law-ish: hot rows near 0)
    return {
        "a": (torch.rand(16, generator=g) ** 3 * 300).long(),
        "b": he.Jagged.from_lengths(ids, torch.tensor([5, 7, 0, 12])),
    }


def _train(ec, steps: int = 25, twice: bool = False, seed: int = 0):
    opt = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(2 if twice else 1):  # (two backwards: the first's rows stay cached until the step)
            out = ec(_batch(g))
            sum((v * torch.linspace(-1, 2, v.shape[1])).sum() for v in out.values()).backward()
        opt.step()
    return opt


def _state(ec) -> dict:
    out = {}
    for n in ec.tables:
        st = ec.storage_of(n)
        out[n] = ec.weight(n).clone()
        for k, v in st.table_state(n).items():
            out[f"{n}.{k}"] = v.clone()
    return out


def _same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize(
    ("kernels", "mapped", "loops"),
    [("auto", None, True), ("auto", None, False), ("eager", None, True), ("auto", False, True)],
)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_tiered_table_trains_as_the_table_in_memory(tmp_path, name, kernels, mapped, loops, monkeypatch):
    """Files mapped (None: these small tables' are) or read and written by system calls; mapped,
    the misses moved by the Numba loops (``loops``) or by torch's ops."""
    if not loops:
        monkeypatch.setattr(tiered_mod, "_kernel", lambda: None)
    elif mapped is None and tiered_mod._kernel() is None:
        pytest.skip("Numba is not installed")
    opt = OPTIMIZERS[name]
    ref = he.EmbeddingCollection(_tables(None, opt), seed=3, kernels=kernels)
    _train(ref)
    ec = he.EmbeddingCollection(
        _tables(he.Tiered(tmp_path, cache_rows=60, mapped=mapped), opt), seed=3, kernels=kernels
    )
    _train(ec)
    st = ec.storage_of("a")
    assert isinstance(st, TieredStorage) and st.weight.shape[0] == 60
    files = [st._rows_file, *st._state_files.values()]
    assert all((f.map is not None) == (mapped is None) for f in files) and len(files) == 1 + len(st.state)
    assert (st._loops() is not None) == (loops and mapped is None)
    stats = st.stats()
    assert stats["evictions"] > 200 and stats["disk_reads"] > 100 and 0 < stats["hit_rate"] < 1, stats
    _same(_state(ec), _state(ref))


def test_two_backwards_a_step_and_an_optimizer_attached_after_rows_went_to_disk(tmp_path):
    ref = he.EmbeddingCollection(_tables(None), seed=1)
    ec = he.EmbeddingCollection(_tables(he.Tiered(tmp_path, cache_rows=80)), seed=1)
    for m in (ref, ec):  # rows evicted before any optimizer: on disk without state
        with torch.no_grad():
            g = torch.Generator().manual_seed(5)
            for _ in range(6):
                m.train()(_batch(g))
    assert ec.storage_of("a").stats()["evictions"] > 0
    for m in (ref, ec):
        _train(m, steps=12, twice=True)
    _same(_state(ec), _state(ref))


def test_state_dict_and_checkpoints_read_and_write_through_the_tiers(tmp_path):
    ref = he.EmbeddingCollection(_tables(None, OPTIMIZERS["adagrad"]), seed=2)
    ec = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "a", cache_rows=50), OPTIMIZERS["adagrad"]), seed=2)
    opt_ref, opt = _train(ref, steps=10), _train(ec, steps=10)
    sd = ec.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=0, atol=0)
    # into a fresh tiered collection by load_state_dict: then both train alike
    other = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "b", cache_rows=50), OPTIMIZERS["adagrad"]), seed=9)
    other.load_state_dict(ref.state_dict())
    for n in ref.tables:
        torch.testing.assert_close(other.weight(n), ref.weight(n), rtol=0, atol=0)
    # a checkpoint of the tiered one loads into memory, and the other way round, with the optimizer state
    he.save(tmp_path / "ck_tiered", ec, opt)
    he.save(tmp_path / "ck_ref", ref, opt_ref)
    mem = he.EmbeddingCollection(_tables(None, OPTIMIZERS["adagrad"]), seed=7)
    opt_mem = he.wrap_optimizer(torch.optim.SGD(mem.parameters(), lr=0.1), mem)
    he.load(tmp_path / "ck_tiered", mem, opt_mem)
    back = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "c", cache_rows=50), OPTIMIZERS["adagrad"]), seed=7)
    opt_back = he.wrap_optimizer(torch.optim.SGD(back.parameters(), lr=0.1), back)
    he.load(tmp_path / "ck_ref", back, opt_back)
    _same(_state(mem), _state(ref))
    _same(_state(back), _state(ref))
    for m, o in ((ref, opt_ref), (back, opt_back)):  # and they go on alike
        g = torch.Generator().manual_seed(11)
        for _ in range(5):
            o.zero_grad()
            sum(v.sum() for v in m(_batch(g)).values()).backward()
            o.step()
    _same(_state(back), _state(ref))


def test_a_batch_larger_than_the_cache_is_refused_and_changes_nothing(tmp_path):
    ec = he.EmbeddingCollection(_tables(he.Tiered(tmp_path, cache_rows=20)), seed=0)
    _train(ec, steps=0)
    ec({"a": torch.arange(10), "b": torch.arange(5)})
    before, stats = _state(ec), ec.storage_of("a").stats()
    with pytest.raises(he.HybridEmbedError, match="needs 40 distinct rows, the cache holds 20"):
        ec({"a": torch.arange(20, 40), "b": torch.arange(20)})
    _same(_state(ec), before)
    assert ec.storage_of("a").stats() == stats


def test_bad_directories_and_a_full_disk_are_clear_errors(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(he.ConfigError, match="cannot make the directory"):
        he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "file" / "sub", cache_rows=10)))

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(he.ConfigError, match=r"cannot reserve .* MiB \(No space left on device\)"):
        he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "d", cache_rows=10)))


def test_refusals():
    with pytest.raises(he.ConfigError, match="cache_rows must be a positive int"):
        he.Tiered("x", cache_rows=0)
    with pytest.raises(he.ConfigError, match="mapped must be True, False or None"):
        he.Tiered("x", cache_rows=5, mapped="yes")
    with pytest.raises(he.ConfigError, match="tiered must be a he.Tiered"):
        he.TableConfig("a", 10, 4, tiered="tiers")
    with pytest.raises(he.ConfigError, match="keeps every row it admits"):  # (tests/storage/test_tiered_hash.py)
        he.TableConfig("a", None, 4, dynamic=he.Dynamic(capacity=9), tiered=he.Tiered("x", cache_rows=5))


def test_copying_is_refused_and_export_serves_the_rows(tmp_path):
    import copy
    import pickle

    ec = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "t", cache_rows=40)), seed=4)
    _train(ec, steps=5)
    for copier in (copy.deepcopy, pickle.dumps):
        with pytest.raises(he.HybridEmbedError, match="cannot be copied or pickled: save a checkpoint"):
            copier(ec)
    ref = he.EmbeddingCollection(_tables(None), seed=4)
    _train(ref, steps=5)
    b = {"a": torch.tensor([0, 5, 299, 7]), "b": torch.tensor([[1, 2, 3], [0, 199, 4], [9, 9, 9], [5, 6, 7]])}
    path = he.export(ec.eval(), tmp_path / "served.pt2", example_inputs=(b,))
    served = torch.export.load(str(path)).module()
    for k, v in ref.eval()(b).items():
        torch.testing.assert_close(served(b)[k], v)


def _on_servers(rank: int, world: int, where: str):
    """A tiered table on a parameter server (rank 1): its shard on the server's disk."""
    tables = _tables(he.Tiered(where, cache_rows=60), OPTIMIZERS["adagrad"])
    model = he.distribute(
        torch.nn.ModuleDict({"ec": he.EmbeddingCollection(tables, seed=3, device="meta")}), servers=1, server_exit=False
    )
    if model is None:  # (the server: it served until the trainer finished)
        return None
    opt = he.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    g = torch.Generator().manual_seed(0)
    for _ in range(12):
        opt.zero_grad()
        sum((v * torch.linspace(-1, 2, v.shape[1])).sum() for v in model["ec"](_batch(g)).values()).backward()
        opt.step()
    he.save(f"{where}/ck", model, opt)
    return {t: model["ec"].gather_table(t) for t in ("a", "b")}


def test_a_tiered_table_on_a_parameter_server_trains_as_in_memory(tmp_path):
    """(In a sharded job: tests/distributed/test_tiered_job.py.)"""
    from hybridembed.launch import spawn

    got, served = spawn(_on_servers, 2, str(tmp_path), timeout=120)
    assert served is None and any(p.suffix == ".rows" for p in tmp_path.iterdir())
    ref = he.EmbeddingCollection(_tables(None, OPTIMIZERS["adagrad"]), seed=3)
    opt = he.wrap_optimizer(torch.optim.SGD(ref.parameters(), lr=0.1), ref)
    g = torch.Generator().manual_seed(0)
    for _ in range(12):
        opt.zero_grad()
        sum((v * torch.linspace(-1, 2, v.shape[1])).sum() for v in ref(_batch(g)).values()).backward()
        opt.step()
    for t in ("a", "b"):
        torch.testing.assert_close(got[t], ref.weight(t), rtol=1e-6, atol=1e-7, msg=t)
    mem = he.EmbeddingCollection(_tables(None, OPTIMIZERS["adagrad"]), seed=0)  # the server's checkpoint
    he.load(
        tmp_path / "ck",
        torch.nn.ModuleDict({"ec": mem}),
        he.wrap_optimizer(torch.optim.SGD(mem.parameters(), lr=0.1), mem),
    )
    _same(_state(mem), _state(ref))


def test_two_live_tables_cannot_share_their_files_and_zero_grad_before_backward_keeps_its_rows(tmp_path):
    import gc

    tiered = he.Tiered(tmp_path, cache_rows=12)
    ec = he.EmbeddingCollection(_tables(tiered), seed=1)
    with pytest.raises(he.ConfigError, match="in use by another live tiered table"):
        he.EmbeddingCollection(_tables(tiered), seed=1)
    # zero_grad between forward and backward: the forward's rows stay cached until the step
    ref = he.EmbeddingCollection(_tables(None), seed=1)
    for m in (ref, ec):
        opt = he.wrap_optimizer(torch.optim.SGD(m.parameters(), lr=0.5), m)
        out = m({"a": torch.arange(6), "b": torch.arange(6)})
        opt.zero_grad()
        if m is ec:
            with pytest.raises(he.HybridEmbedError, match="needs 12 distinct rows"):
                with torch.no_grad():
                    m({"a": torch.arange(50, 56), "b": torch.arange(50, 56)})
        sum(v.sum() for v in out.values()).backward()
        opt.step()
    _same(_state(ec), _state(ref))
    del ec, opt, out, m
    gc.collect()
    he.EmbeddingCollection(_tables(tiered), seed=1)  # (the first one gone: its files are free)


def test_runs_longer_than_one_call_are_split(tmp_path, monkeypatch):
    from hybridembed.storage import tiered_file as T

    monkeypatch.setattr(T, "_CALL_BYTES", 3 * 8 * 4)  # (three rows of 8 float32 per call)
    ref = he.EmbeddingCollection(_tables(None), seed=6)
    ec = he.EmbeddingCollection(_tables(he.Tiered(tmp_path, cache_rows=60, mapped=False)), seed=6)
    for m in (ref, ec):
        _train(m, steps=10)
    _same(_state(ec), _state(ref))


def _pieces(monkeypatch, rows: int) -> None:
    """Checkpoint files of ``rows`` rows of these tables (dim 8, one float32 state)."""
    from hybridembed.checkpoint import local, snapshot

    monkeypatch.setattr(snapshot, "_PIECE_BYTES", rows * 8 * 4 * 2)
    monkeypatch.setattr(local, "_PIECE_BYTES", rows * 8 * 4 * 2)


def _gathers(monkeypatch) -> list[int]:
    """The rows of every read of a tiered table through its tiers, from now on."""
    seen: list[int] = []
    real = TieredStorage._gather
    monkeypatch.setattr(
        TieredStorage, "_gather", lambda self, rows, cols: seen.append(rows.numel()) or real(self, rows, cols)
    )
    return seen


def test_a_checkpoint_of_a_tiered_table_is_written_and_read_a_range_at_a_time(tmp_path, monkeypatch):
    """A table larger than memory is checkpointed: he.save reads it a range of rows at a time
    into files of at most _PIECE_BYTES, he.load writes it back range by range (never the whole
    table in memory), and the reloaded table, tiered or in memory, trains on as the original."""
    adagrad = OPTIMIZERS["adagrad"]
    ref = he.EmbeddingCollection(_tables(None, adagrad), seed=2)
    ec = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "a", cache_rows=50), adagrad), seed=2)
    opt_ref, opt = _train(ref, steps=10), _train(ec, steps=10)
    _pieces(monkeypatch, 8)
    seen = _gathers(monkeypatch)
    he.save(tmp_path / "ck", ec, opt)
    assert seen and max(seen) <= 8, seen
    manifest = he.checkpoint.read_manifest(tmp_path / "ck")
    shards = manifest["tables"]["a"]["shards"]
    assert len(shards) == 38 and [(s["row_start"], s["row_end"]) for s in shards[-2:]] == [(288, 296), (296, 300)]

    back = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "b", cache_rows=50), adagrad), seed=9)
    opt_back = he.wrap_optimizer(torch.optim.SGD(back.parameters(), lr=0.1), back)
    seen.clear()
    writes: list[int] = []
    real_write = TieredStorage.write_range
    monkeypatch.setattr(
        TieredStorage,
        "write_range",
        lambda self, t, lo, d, c=0: writes.append(len(d["weight"])) or real_write(self, t, lo, d, c),
    )
    he.load(tmp_path / "ck", back, opt_back)
    assert not seen and writes and max(writes) <= 8 and sum(writes) == 500, (seen, writes)
    monkeypatch.undo()
    mem = he.EmbeddingCollection(_tables(None, adagrad), seed=7)
    opt_mem = he.wrap_optimizer(torch.optim.SGD(mem.parameters(), lr=0.1), mem)
    he.load(tmp_path / "ck", mem, opt_mem)
    _same(_state(back), _state(ref))
    _same(_state(mem), _state(ref))
    for m, o in ((ref, opt_ref), (back, opt_back), (mem, opt_mem)):  # the optimizer's step and state came too
        g = torch.Generator().manual_seed(11)
        for _ in range(4):
            o.zero_grad()
            sum(v.sum() for v in m(_batch(g)).values()).backward()
            o.step()
    _same(_state(back), _state(ref))
    _same(_state(mem), _state(ref))


def test_a_background_save_of_a_tiered_table_holds_its_rows_at_the_call(tmp_path, monkeypatch):
    ec = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "a", cache_rows=50), OPTIMIZERS["rowwise"]), seed=4)
    opt = _train(ec, steps=5)
    _pieces(monkeypatch, 16)
    at_call = _state(ec)
    handle = he.save(tmp_path / "ck", ec, opt, background=True)
    _train(ec, steps=5, seed=1)  # (goes on changing rows on disk and in the cache)
    handle.wait()
    mem = he.EmbeddingCollection(_tables(None, OPTIMIZERS["rowwise"]), seed=0)
    he.load(tmp_path / "ck", mem, he.wrap_optimizer(torch.optim.SGD(mem.parameters(), lr=0.1), mem))
    _same(_state(mem), at_call)


def test_a_damaged_piece_of_a_tiered_checkpoint_is_refused_and_changes_nothing(tmp_path, monkeypatch):
    ec = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "a", cache_rows=50), OPTIMIZERS["adagrad"]), seed=4)
    opt = _train(ec, steps=3)
    _pieces(monkeypatch, 32)
    he.save(tmp_path / "ck", ec, opt)
    piece = os.path.join(he.checkpoint.read_manifest(tmp_path / "ck")["path"], "tables", "b.00002.pt")
    saved, size = torch.load(piece), os.path.getsize(piece)  # rows 64..95 of b, (32, 8) rows and state
    bad = {"weight": saved["weight"].reshape(16, 16).clone(), "state": {"sum": saved["state"]["sum"].reshape(16, 16)}}
    torch.save(bad, piece)  # (as many bytes: found by the per-range check, not the file size)
    assert os.path.getsize(piece) == size
    target = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "b", cache_rows=50), OPTIMIZERS["adagrad"]), seed=5)
    opt_target = he.wrap_optimizer(torch.optim.SGD(target.parameters(), lr=0.1), target)
    before = _state(target)
    with pytest.raises(he.CheckpointError, match=r"b\.00002\.pt' does not hold 'weight' of shape \(32, 8\)"):
        he.load(tmp_path / "ck", target, opt_target, verify=False)
    _same(_state(target), before)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.bag, self.user = (
            torch.nn.Embedding(300, 8),
            torch.nn.EmbeddingBag(200, 8, mode="mean"),
            torch.nn.Embedding(50, 8),
        )

    def forward(self, a, b, offsets, u):
        return torch.cat([self.emb(a), self.bag(b, offsets), self.user(u)], 1)


def test_convert_puts_dense_layers_on_disk_and_they_train_as_in_memory(tmp_path):
    torch.manual_seed(0)
    plain = _Model()
    models = {k: copy.deepcopy(plain) for k in ("memory", "every", "one")}
    old = models["every"].emb.weight
    he.convert(models["memory"])
    he.convert(models["every"], tiered=he.Tiered(tmp_path / "e", cache_rows=70), tables={"user": {"tiered": None}})
    he.convert(models["one"], tables={"emb": {"tiered": he.Tiered(tmp_path / "o", cache_rows=40)}})
    tiered = {
        k: sorted(t for t in m.hybridembed.tables if m.hybridembed.storage_of(t).tiered) for k, m in models.items()
    }
    assert tiered == {"memory": [], "every": ["bag", "emb"], "one": ["emb"]}
    assert old.shape == (0, 8)  # (its rows went to the files; its memory was handed back)
    for m in models.values():
        opt = he.wrap_optimizer(torch.optim.Adagrad(m.parameters(), lr=0.1), m)
        g = torch.Generator().manual_seed(1)
        for _ in range(12):
            a, b, u = (
                (torch.rand(16, generator=g) ** 3 * 300).long(),
                (torch.rand(32, generator=g) ** 3 * 200).long(),
                torch.randint(0, 50, (16,), generator=g),
            )
            opt.zero_grad()
            (m(a, b, torch.arange(0, 32, 2), u) * torch.linspace(-1, 1, 24)).sum().backward()
            opt.step()
    want = _state(models["memory"].hybridembed)
    for k in ("every", "one"):
        _same(_state(models[k].hybridembed), want)
    with pytest.raises(he.ConfigError, match="tiered must be a he.Tiered"):
        he.convert(_Model(), tiered=str(tmp_path))
    with pytest.raises(he.ConfigError, match="keeps every row it admits"):  # (a capacity would drop rows)
        he.convert(
            _Model(),
            tables={"emb": {"dynamic": he.Dynamic(capacity=9), "tiered": he.Tiered(tmp_path / "x", cache_rows=9)}},
        )


@pytest.mark.parametrize(("ahead", "mapped"), [(1, None), (2, None), (1, False), (2, False)])
@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_prefetched_rows_train_as_the_table_in_memory(tmp_path, name, ahead, mapped):
    """ec.prefetch(a later batch) reads its rows on disk in a background thread; the lookup takes
    them from memory. Two batches ahead (two prefetches held), some prefetched rows are loaded,
    changed and written back before their batch comes: they are read again (equal to the table in
    memory either way)."""
    opt_cfg = OPTIMIZERS[name]
    g = torch.Generator().manual_seed(3)
    batches = [_batch(g) for _ in range(30)]
    runs = {}
    for kind in ("memory", "tiered"):
        tiered = he.Tiered(tmp_path / kind, cache_rows=60, mapped=mapped) if kind == "tiered" else None
        ec = he.EmbeddingCollection(_tables(tiered, opt_cfg), seed=3)
        opt = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec)
        for i, b in enumerate(batches):
            opt.zero_grad()
            sum((v * torch.linspace(-1, 2, v.shape[1])).sum() for v in ec(b).values()).backward()
            if i + ahead < len(batches):
                ec.prefetch(batches[i + ahead])  # (before the step: it reads while the step runs)
            opt.step()
        runs[kind] = ec
    stats = runs["tiered"].storage_of("a").stats()
    if mapped is None:  # (files mapped: the page cache serves their rows, nothing is read ahead)
        assert stats["prefetched"] == 0 and stats["disk_reads"] > 50, stats
        _same(_state(runs["tiered"]), _state(runs["memory"]))
        return
    assert stats["prefetched"] > 50, stats
    if ahead == 2:  # (two prefetches held at once: the one for the batch after next is not dropped first)
        assert stats["prefetched"] > 3 * stats["disk_reads"], stats
    if ahead == 1:  # (nothing changes between the prefetch and its lookup: every row on disk came from it)
        assert stats["disk_reads"] == 0, stats
    _same(_state(runs["tiered"]), _state(runs["memory"]))


def test_two_prefetches_are_held_and_a_third_drops_the_oldest(tmp_path):
    ec = he.EmbeddingCollection(_tables(he.Tiered(tmp_path, cache_rows=60, mapped=False)), seed=1)
    _train(ec, steps=25)
    st = ec.storage_of("a")
    made = []
    for lo in (100, 150, 200):
        ec.prefetch({"a": torch.arange(lo, lo + 40), "b": torch.arange(lo - 100, lo - 60)})
        made.append(st._prefetches[-1])
    assert len(set(map(id, made))) == 3 and st._prefetches == made[1:]
    assert not made[0]._thread.is_alive()  # (the dropped one's read was waited for)
    st.drop_prefetch()
    assert st._prefetches == [] and not any(pf._thread.is_alive() for pf in made)


def test_a_row_written_after_its_prefetch_is_read_again_and_a_failed_prefetch_is_dropped(tmp_path, monkeypatch):
    ec = he.EmbeddingCollection(
        _tables(he.Tiered(tmp_path, cache_rows=64, mapped=False), OPTIMIZERS["adagrad"]), seed=1
    )
    ref = he.EmbeddingCollection(_tables(None, OPTIMIZERS["adagrad"]), seed=1)
    st = ec.storage_of("a")
    hot = {"a": torch.arange(0, 20), "b": torch.arange(0, 20)}
    cold = {"a": torch.arange(100, 130), "b": torch.arange(100, 130)}
    for m in (ec, ref):
        opt = he.wrap_optimizer(torch.optim.SGD(m.parameters(), lr=0.1), m)
        for b in (hot, cold, hot):  # hot rows go to disk, changed
            opt.zero_grad()
            sum(v.sum() for v in m(b).values()).backward()
            opt.step()
        if m is ec:
            assert int((st.slot_of[100:130] < 0).sum()) > 10  # (cold rows on disk)
            m.prefetch(cold)
            st._prefetches[-1].ready()
        for b in (cold, hot, cold):  # cold rows taken from the prefetch, changed, written back, read again
            opt.zero_grad()
            sum(v.sum() for v in m(b).values()).backward()
            opt.step()
    assert st._prefetches[-1].stale.any() and st.stats()["prefetched"] > 0
    _same(_state(ec), _state(ref))
    import threading

    real = type(st._rows_file).read

    def failing(self, rows):
        if threading.current_thread() is not threading.main_thread():
            raise OSError("the disk went away")
        return real(self, rows)

    monkeypatch.setattr(type(st._rows_file), "read", failing)
    ec.prefetch(hot)
    before = st.stats()["prefetched"]
    assert torch.equal(ec(hot)["a"], ref(hot)["a"])  # (the lookup read the files itself)
    assert st._prefetches[-1].error is not None and st.stats()["prefetched"] == before


_KILLED = r"""
import os, signal, sys, torch
import hybridembed as he
from hybridembed.checkpoint import layout, local, snapshot
sys.path.insert(0, sys.argv[2])
from test_tiered import OPTIMIZERS, _step, _tables

where = sys.argv[1]
snapshot._PIECE_BYTES = local._PIECE_BYTES = 16 * 8 * 4 * 2  # (16 rows a file)
ec = he.EmbeddingCollection(_tables(he.Tiered(where + "/tiers", cache_rows=50), OPTIMIZERS["adagrad"]), seed=6)
opt = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec)
for s in range(6):
    _step(ec, opt, s)
    if s == 2:
        he.save(where + "/ck", ec, opt, extra={"step": 3})
"""

_DIES_IN_A_SAVE = r"""
real, written = layout._write_file, []
def dying(path, obj):  # the step-6 save dies after DEATH of its files
    if len(written) == DEATH:
        os.kill(os.getpid(), signal.SIGKILL)
    written.append(path)
    real(path, obj)
layout._write_file = dying
he.save(where + "/ck", ec, opt, extra={"step": 6})
"""


def run_killed(script: str, where, files: int) -> None:
    """Runs ``script`` (it trains ``ec`` with ``opt`` and saves to ``where/ck``) in a process that
    then dies (SIGKILL) in a save after writing ``files`` of its files; checks that it did."""
    import signal

    from tests import warm

    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(he.__path__[0]), os.environ.get("PYTHONPATH", "")])
    )
    code = script + _DIES_IN_A_SAVE.replace("DEATH", str(files))  # (a process of its own, forked warm)
    rc, _, err = warm.run_code(code, env, cwd=where, timeout=120, argv=[str(where), os.path.dirname(__file__)])
    assert rc == -signal.SIGKILL, err[-2000:]
    assert any(p.name.startswith(".tmp-") for p in (where / "ck").iterdir())  # (the save that died)


def _step(ec, opt, s: int) -> None:
    g = torch.Generator().manual_seed(100 + s)
    opt.zero_grad()
    sum((v * torch.linspace(-1, 2, v.shape[1])).sum() for v in ec(_batch(g)).values()).backward()
    opt.step()


def test_a_job_killed_in_a_save_resumes_from_the_last_commit_and_trains_as_in_memory(tmp_path):
    """A process training a tiered table is killed (SIGKILL) in the middle of a save: the last
    committed checkpoint loads into a fresh tiered table (the dead one's files are scratch), and
    training on from there equals an uninterrupted run in memory, bit for bit."""
    run_killed(_KILLED, tmp_path, 2)
    ec = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "again", cache_rows=50), OPTIMIZERS["adagrad"]), seed=0)
    opt = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec)
    assert he.load(tmp_path / "ck", ec, opt)["extra"] == {"step": 3}
    ref = he.EmbeddingCollection(_tables(None, OPTIMIZERS["adagrad"]), seed=6)
    opt_ref = he.wrap_optimizer(torch.optim.SGD(ref.parameters(), lr=0.1), ref)
    for s in range(10):
        _step(ref, opt_ref, s)
        if s >= 3:
            _step(ec, opt, s)
    _same(_state(ec), _state(ref))


def train_alike(pairs, batch, g: torch.Generator, steps: int = 3) -> dict[str, set]:
    """A step of each (model, optimizer) of ``pairs`` on each of ``steps`` batches ``batch(g)`` (tables
    "a": a tensor of ids, "b": Jagged); -> the ids each table saw."""
    touched: dict[str, set] = {"a": set(), "b": set()}
    for _ in range(steps):
        b = batch(g)
        touched["a"] |= set(b["a"].tolist())
        touched["b"] |= set(b["b"].values.tolist())
        for m, o in pairs:
            o.zero_grad()
            sum(v.sum() for v in m(b).values()).backward()
            o.step()
    return touched


def test_incremental_checkpoints_of_a_tiered_table_hold_the_rows_changed_and_load_as_the_chain(tmp_path, monkeypatch):
    """Changes are counted by table row (not cache slot, which rows come and go through): an
    incremental version holds exactly the rows changed since the last one (read through the
    tiers, never the whole table), and the chain loads, into memory or tiers, as the table."""
    opt_cfg = OPTIMIZERS["rowwise"]
    ref = he.EmbeddingCollection(_tables(None, opt_cfg), seed=8)
    ec = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "a", cache_rows=50), opt_cfg), seed=8)
    opt_ref, opt = _train(ref, steps=6), _train(ec, steps=6)
    _pieces(monkeypatch, 16)
    he.save(tmp_path / "ck", ec, opt, incremental=True)  # (the first: full)
    touched = train_alike(((ref, opt_ref), (ec, opt)), _batch, torch.Generator().manual_seed(21))
    assert ec.storage_of("a").stats()["evictions"] > 0
    seen = _gathers(monkeypatch)
    he.save(tmp_path / "ck", ec, opt, incremental=True)
    manifest = he.checkpoint.read_manifest(tmp_path / "ck")
    assert manifest["incremental"]["length"] == 1
    per = (16 * 8 * 4 * 2) // (8 * 4 + 4)  # rows a file: 8 floats of row and one of row-wise state each
    for t in ("a", "b"):  # (in files of at most `per` rows, written in the save's foreground)
        shards = manifest["tables"][t]["shards"]
        assert sum(s["changed"] for s in shards) == len(touched[t]) and len(shards) == -(-len(touched[t]) // per)
    assert max(seen) <= per, seen
    monkeypatch.undo()
    for tiered in (None, he.Tiered(tmp_path / "b", cache_rows=50)):
        m = he.EmbeddingCollection(_tables(tiered, opt_cfg), seed=1)
        he.load(tmp_path / "ck", m, he.wrap_optimizer(torch.optim.SGD(m.parameters(), lr=0.1), m))
        _same(_state(m), _state(ref))


def test_a_load_while_rows_wait_for_their_step_is_refused_and_changes_nothing(tmp_path):
    """A backward's rows stay cached for the optimizer's step: he.load before that step is
    refused (it would write through that cache), nothing loaded; after the step it loads."""
    ref = he.EmbeddingCollection(_tables(None, OPTIMIZERS["adagrad"]), seed=2)
    he.save(tmp_path / "ck", ref, _train(ref, steps=2))
    ec = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "t", cache_rows=50), OPTIMIZERS["adagrad"]), seed=5)
    opt = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec)
    sum(v.sum() for v in ec({"a": torch.arange(40), "b": torch.arange(5)}).values()).backward()
    before = _state(ec)
    with pytest.raises(he.CheckpointError, match=r"45 rows looked up in training are held .* call it \(opt.step\(\)\)"):
        he.load(tmp_path / "ck", ec, opt)
    _same(_state(ec), before)
    opt.step()
    he.load(tmp_path / "ck", ec, opt)
    _same(_state(ec), _state(ref))


def _low(hi: int, by: int = 0):
    """Batches of ids in ``by .. by + hi`` only (the table's other rows stay as they were)."""

    def batch(g: torch.Generator) -> dict:
        ids = torch.randint(by, by + hi, (24,), generator=g)
        return {
            "a": torch.randint(by, by + hi, (16,), generator=g),
            "b": he.Jagged.from_lengths(ids, torch.tensor([5, 7, 0, 12])),
        }

    return batch


def _linked(root, version: str) -> dict[str, set[int]]:
    """{table: indices of the version's files that are second names of an older version's}."""
    m = he.checkpoint.read_manifest(root / version)
    return {
        q: {i for i, s in enumerate(t["shards"]) if (root / version / s["file"]).stat().st_nlink > 1}
        for q, t in m["tables"].items()
    }


def _untouched(manifest: dict, q: str, touched: set) -> set[int]:
    return {
        i
        for i, s in enumerate(manifest["tables"][q]["shards"])
        if not any(s["row_start"] <= r < s["row_end"] for r in touched)
    }


def _trained_pair(tmp_path, monkeypatch, opt_cfg, seed: int, steps: int):
    """A table in memory and the same on disk, trained alike; checkpoint files of 16 rows; the root."""
    ref = he.EmbeddingCollection(_tables(None, opt_cfg), seed=seed)
    ec = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "a", cache_rows=50), opt_cfg), seed=seed)
    pairs = ((ref, _train(ref, steps=steps)), (ec, _train(ec, steps=steps)))
    _pieces(monkeypatch, 16)
    return ref, ec, pairs, tmp_path / "ck"


def _same_file(root, manifest: dict, q: str, new: str, old: str) -> set[int]:
    """Indices of table ``q``'s files of version ``new`` (``manifest``) that are version ``old``'s file of that name."""
    ino = lambda v, s: (root / v / s["file"]).stat().st_ino  # noqa: E731
    return {i for i, s in enumerate(manifest["tables"][q]["shards"]) if ino(new, s) == ino(old, s)}


def test_a_full_save_links_the_files_no_row_of_changed_since_and_loads_as_the_table(tmp_path, monkeypatch):
    """A full save of a tiered table hard-links each range file of the current chain's full
    base none of whose rows was written since (by the model or by an incremental version of the
    chain), and writes the others; every version loads as the table, also once the versions
    it linked from are deleted. A model whose changes count from elsewhere links nothing."""
    opt_cfg = OPTIMIZERS["rowwise"]
    ref, ec, pairs, root = _trained_pair(tmp_path, monkeypatch, opt_cfg, seed=8, steps=6)
    he.save(root, ec, pairs[1][1], keep=5)  # v-000001: full, every file written
    assert _linked(root, "v-000001") == {"a": set(), "b": set()}
    touched = train_alike(pairs, _low(40), torch.Generator().manual_seed(3))
    he.save(root, ec, pairs[1][1], keep=5)  # v-000002: full, the files of rows >= 40 linked
    m2 = he.checkpoint.read_manifest(root)
    got = _linked(root, "v-000002")
    for q in ("a", "b"):
        assert got[q] == _untouched(m2, q, touched[q]) and len(got[q]) >= 5, (q, got[q])
    late = train_alike(pairs, _low(20, by=40), torch.Generator().manual_seed(4))
    he.save(root, ec, pairs[1][1], keep=5, incremental=True)  # v-000003: a delta on v-000002
    later = train_alike(pairs, _low(30, by=100), torch.Generator().manual_seed(5))
    he.save(root, ec, pairs[1][1], keep=5)  # v-000004: full; links none of the rows written in the delta or since
    m4 = he.checkpoint.read_manifest(root)
    for q in ("a", "b"):
        want = _untouched(m4, q, touched[q] | late[q] | later[q])
        got = _same_file(root, m4, q, "v-000004", "v-000001")
        assert got == want and len(want) >= 3, (q, got, want)
    inodes = {p.stat().st_ino for p in (root / "v-000004" / "tables").iterdir()}
    he.save(root, ec, pairs[1][1], keep=1)  # v-000005: nothing changed since v-000004, all linked; the others deleted
    assert [p.name for p in root.glob("v-*")] == ["v-000005"]
    assert {p.stat().st_ino for p in (root / "v-000005" / "tables").iterdir()} == inodes
    for tiered in (None, he.Tiered(tmp_path / "b", cache_rows=50)):
        m = he.EmbeddingCollection(_tables(tiered, opt_cfg), seed=1)
        he.load(root, m, he.wrap_optimizer(torch.optim.SGD(m.parameters(), lr=0.1), m))
        _same(_state(m), _state(ref))
    other = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "c", cache_rows=50), opt_cfg), seed=8)
    opt_other = _train(other, steps=6)  # (the rows of v-000001, not v-000005's)
    he.save(tmp_path / "elsewhere", other, opt_other)  # (its changes now count from there: none since)
    he.save(root, other, opt_other, keep=2)
    assert _linked(root, "v-000006") == {"a": set(), "b": set()}


def test_compaction_keeps_the_base_files_no_delta_wrote_as_links_and_loads_as_the_chain(tmp_path, monkeypatch):
    """he.checkpoint.compact puts a tiered table's chain together in its full base's range files
    (each at most _PIECE_BYTES; a delta's spans follow its changed rows), linking those no delta
    wrote a row of and putting the others together from the chain."""
    opt_cfg = OPTIMIZERS["adam"]
    ref, ec, pairs, root = _trained_pair(tmp_path, monkeypatch, opt_cfg, seed=3, steps=4)
    he.save(root, ec, pairs[1][1], keep=3, incremental=True)  # v-000001: full
    touched = train_alike(pairs, _low(30), torch.Generator().manual_seed(6))
    he.save(root, ec, pairs[1][1], keep=3, incremental=True)  # v-000002: the rows below 30
    more = train_alike(pairs, _low(25, by=150), torch.Generator().manual_seed(7))
    he.save(root, ec, pairs[1][1], keep=3, incremental=True)  # v-000003: rows 150..175
    done = Path(he.checkpoint.compact(root, keep=3))
    base, full = (he.checkpoint.read_manifest(root / v) for v in ("v-000001", done.name))
    assert "incremental" not in full
    listed = {s["file"] for t in full["tables"].values() for s in t["shards"]} | {"dense.pt", "optimizer.pt"}
    assert set(full["files"]) == listed and {p.name for p in (done / "tables").iterdir()} == {
        f.split("/")[1] for f in listed if f.startswith("tables/")
    }
    for q in ("a", "b"):
        assert [(s["row_start"], s["row_end"]) for s in full["tables"][q]["shards"]] == [
            (s["row_start"], s["row_end"]) for s in base["tables"][q]["shards"]
        ]
        same = _same_file(root, full, q, done.name, "v-000001")
        assert same == _untouched(full, q, touched[q] | more[q]) and len(same) >= 5, (q, same)
    for tiered in (None, he.Tiered(tmp_path / "b", cache_rows=50)):
        m = he.EmbeddingCollection(_tables(tiered, opt_cfg), seed=1)
        he.load(done, m, he.wrap_optimizer(torch.optim.SGD(m.parameters(), lr=0.1), m))
        _same(_state(m), _state(ref))


def test_evictions_are_written_in_the_step_and_a_failed_write_is_a_clear_error_that_changes_nothing(
    tmp_path, monkeypatch
):
    """A dense table's evictions are written in the lookup, not by the writer thread (whose reads of
    the pages written would share the disk with a prefetch's); a write that fails raises a clear
    error before the lookup changes anything, and the batch goes through once the disk writes."""
    from hybridembed.storage import tiered_file as T

    monkeypatch.setattr(T, "_writers", None)  # (the writer thread, made at its first write)
    opt_cfg = OPTIMIZERS["adagrad"]
    models = [
        he.EmbeddingCollection(_tables(t, opt_cfg), seed=3) for t in (None, he.Tiered(tmp_path, 60, mapped=False))
    ]
    opts = [he.wrap_optimizer(torch.optim.SGD(m.parameters(), lr=0.1), m) for m in models]
    g = torch.Generator().manual_seed(5)
    batches = [_batch(g) for _ in range(16)]

    def step(i: int, b: dict) -> None:
        opts[i].zero_grad()
        sum((v * torch.linspace(-1, 2, v.shape[1])).sum() for v in models[i](b).values()).backward()
        opts[i].step()

    for b in batches[:6]:
        step(0, b), step(1, b)
    st = models[1].storage_of("a")
    assert st.stats()["disk_writes"] > 0 and T._writers is None, st.stats()
    monkeypatch.setattr(T, "_io", lambda: None)  # (Python's calls, which raise the error)

    def failing(fd, bufs, at):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(T.os, "pwritev", failing)
    failed = None
    for i, b in enumerate(batches[6:], 6):
        before = _state(models[1])
        try:
            step(1, b)
        except he.HybridEmbedError as e:
            assert re.search(r"writing [\d,]+ rows failed \(Input/output error\)", str(e)), e
            failed = i
            break
        step(0, b)
    assert failed is not None
    _same(_state(models[1]), before)
    monkeypatch.undo()
    for b in batches[failed:]:
        step(0, b), step(1, b)
    _same(_state(models[1]), _state(models[0]))


def test_files_are_mapped_where_the_rows_take_an_eighth_of_the_memory_and_a_truncated_one_is_a_clear_error(
    tmp_path, monkeypatch
):
    """Tiered(mapped=None) maps a group's files where its rows take at most 1/8 of the memory this
    process may use (its cgroup's limit where lower); a mapped file cut short under the table
    raises at its next read or write (not SIGBUS), and the table's rows are as they were."""
    from hybridembed.storage import mapped

    rows_bytes = (300 + 200) * 8 * 4  # (the two tables of _tables: 500 rows x 8 float32)
    monkeypatch.setattr(mapped, "memory_limit", lambda: 8 * rows_bytes - 1)
    small = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "a", cache_rows=60)), seed=1)
    assert small.storage_of("a")._rows_file.map is None
    monkeypatch.setattr(mapped, "memory_limit", lambda: 8 * rows_bytes)
    ec = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "b", cache_rows=60), OPTIMIZERS["adagrad"]), seed=1)
    st = ec.storage_of("a")
    assert st._rows_file.map is not None
    _train(ec, steps=6)
    assert st.stats()["evictions"] > 0
    os.truncate(st._rows_file.path, 100)
    with pytest.raises(he.HybridEmbedError, match="shorter than its rows"):
        ec.state_dict()
    with pytest.raises(he.HybridEmbedError, match="shorter than its rows"):
        _train(ec, steps=6)
    # not mapped (read and written by system calls): the same error, not rows read back as zeros
    # after an eviction's write grew the file again
    ec = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "c", cache_rows=60, mapped=False)), seed=1)
    st = ec.storage_of("a")
    _train(ec, steps=6)
    assert st._rows_file.map is None and st.stats()["disk_writes"] > 0
    os.truncate(st._rows_file.path, 0)
    with pytest.raises(he.HybridEmbedError, match="shorter than its rows"):
        _train(ec, steps=6)
    assert os.path.getsize(st._rows_file.path) == 0


def test_mapped_files_the_page_cache_holds_and_the_cache_ask_for_huge_pages(tmp_path, monkeypatch):
    """A mapped file is advised into 2 MiB pages where it takes at most the share of memory that
    Tiered(mapped=None) maps (one fault a huge page after a write-back); a file mapped beyond it
    (mapped=True) is not (a fault would read 2 MiB for a row). The cache's rows are, and start at 0."""
    from hybridembed.storage import mapped, tiered_file

    advised: list[int] = []
    monkeypatch.setattr(tiered_file, "advise_huge_pages", lambda t: advised.append(t.numel()) or True)
    ec = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "a", cache_rows=60), OPTIMIZERS["adam"]), seed=1)
    he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec)
    st = ec.storage_of("a")
    files = [st._rows_file, *st._state_files.values()]
    assert sorted(advised) == sorted(f.map.numel() for f in files) and len(files) == 3
    assert torch.equal(st.weight, torch.zeros_like(st.weight))
    advised.clear()
    monkeypatch.setattr(mapped, "memory_limit", lambda: 8 * 100)  # (less than the rows: mapped only when asked)
    big = he.EmbeddingCollection(_tables(he.Tiered(tmp_path / "b", cache_rows=60, mapped=True)), seed=1)
    assert big.storage_of("a")._rows_file.map is not None and advised == []


def test_memory_limit_reads_the_cgroups_limit(tmp_path, monkeypatch):
    """The machine's memory, or a v2 / v1 cgroup's limit where lower ("max": none)."""
    from hybridembed.storage import mapped

    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    root = tmp_path / "cg"
    (root / "job").mkdir(parents=True)
    (root / "memory" / "job").mkdir(parents=True)
    proc = tmp_path / "proc-cgroup"
    real = Path.read_text

    def read_text(self, *a, **k):
        if str(self) == "/proc/self/cgroup":
            return real(proc, *a, **k)
        if str(self).startswith("/sys/fs/cgroup"):
            return real(root / str(self)[len("/sys/fs/cgroup/") :], *a, **k)
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", read_text)
    proc.write_text("0::/job\n")
    (root / "job" / "memory.max").write_text("max\n")
    assert mapped.memory_limit() == machine
    (root / "job" / "memory.max").write_text(f"{1 << 30}\n")
    assert mapped.memory_limit() == min(machine, 1 << 30)
    proc.write_text("4:cpu,cpuacct:/job\n3:memory:/job\n")
    (root / "memory" / "job" / "memory.limit_in_bytes").write_text(f"{1 << 29}\n")
    assert mapped.memory_limit() == min(machine, 1 << 29)
    (root / "job" / "sub").mkdir()  # (a limit on a cgroup above the process's)
    (root / "job" / "sub" / "memory.max").write_text("max\n")
    (root / "job" / "memory.max").write_text(f"{1 << 28}\n")
    proc.write_text("0::/job/sub\n")
    assert mapped.memory_limit() == min(machine, 1 << 28)
    assert mapped.map_limit(None) == mapped.memory_limit() // 8 and mapped.map_limit(False) == -1


def test_a_tiered_tables_memory_counts_its_cache_and_bookkeeping(tmp_path):
    """``memory_bytes`` of a dense tiered table: its cached rows and state, the (R,) map, the
    cache's bookkeeping and the recency queue; not its rows on disk."""
    t = he.TableConfig("t", 10_000, 8, tiered=he.Tiered(str(tmp_path), cache_rows=500))
    ec = he.EmbeddingCollection([t])
    st = ec.storage_of("t")
    free = st.free.numel() * 8  # (the free slots' stack: all of them before a lookup)
    want = 500 * 8 * 4 + 10_000 * 4 + 500 * (8 + 8 + 4 + 1 + 1) + free + (2 * 500 + 1024) * 4 + 2 * 1024 * 8
    assert st.memory_bytes == want
    assert st.memory_bytes < 10_000 * 8 * 4  # (less than the rows it holds)


def test_tiered_names_paths_and_files_that_are_not_the_tables_own_are_refused(tmp_path):
    """A name that would put files outside Tiered(path) or a NUL in the path; a dynamic cache beyond
    int32 slots; a `dynamic` that is not a Dynamic; a lock file that is a directory and a rows file
    that is a symbolic link (to a file the table would overwrite): clear errors, nothing written."""
    from hybridembed.config import MAX_SLOTS

    t = he.Tiered(tmp_path / "t", cache_rows=5)
    for name in ("sub/a", "/abs", "a\\b", "a\x00b"):
        with pytest.raises(he.ConfigError, match="names its files"):
            he.TableConfig(name, 10, 4, tiered=t)
    with pytest.raises(he.ConfigError, match="path must be a directory path"):
        he.Tiered(str(tmp_path) + "/a\x00b", cache_rows=5)
    with pytest.raises(he.ConfigError, match="at most 2147483646"):
        he.TableConfig("a", None, 4, dynamic=he.Dynamic(), tiered=he.Tiered(tmp_path, MAX_SLOTS + 1))
    for dyn in ("x", True):
        with pytest.raises(he.ConfigError, match="dynamic must be a he.Dynamic"):
            he.TableConfig("a", None, 4, dynamic=dyn, tiered=t)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.lock").mkdir()
    with pytest.raises(he.ConfigError, match="a.lock: cannot make this table group's lock file"):
        he.EmbeddingCollection([he.TableConfig("a", 10, 4, tiered=t)])
    victim = tmp_path / "victim"
    victim.write_bytes(b"mine")
    (tmp_path / "t" / "b.rows").symlink_to(victim)
    with pytest.raises(he.ConfigError, match="b.rows: cannot make it"):
        he.EmbeddingCollection([he.TableConfig("b", 10, 4, tiered=t)])
    assert victim.read_bytes() == b"mine"
    # a group's files are named by its first table and how many follow, after a '.' (no table's name
    # has one): a table named as the old '+' form of a group is its own group's, not refused
    t = he.Tiered(tmp_path / "u", cache_rows=5)
    ec = he.EmbeddingCollection([he.TableConfig(n, 10, d, tiered=t) for n, d in (("a", 4), ("b", 4), ("a+1", 8))])
    assert sorted(p.name for p in (tmp_path / "u").glob("*.rows")) == ["a+1.rows", "a.1.rows"]
    ec({"a": torch.tensor([1]), "b": torch.tensor([2]), "a+1": torch.tensor([3])})


@pytest.mark.parametrize("loops", [True, False])
def test_a_lookup_that_cannot_read_its_rows_keeps_the_free_slots_and_the_rows(tmp_path, monkeypatch, loops):
    """A rows file cut short under a mapped table with free cache slots left: the lookup raises and
    takes no slot (the Numba loops or torch's ops); the file made whole again, it reads the rows."""
    if not loops:
        monkeypatch.setattr(tiered_mod, "_kernel", lambda: None)
    ref = he.EmbeddingCollection([he.TableConfig("a", 1000, 8)], seed=1).eval()
    ec = he.EmbeddingCollection([he.TableConfig("a", 1000, 8, tiered=he.Tiered(tmp_path, cache_rows=100))], seed=1)
    ec.eval()
    st = ec.storage_of("a")
    ec({"a": torch.arange(10)})
    free, slot_of, size = st.free.clone(), st.slot_of.clone(), os.path.getsize(st._rows_file.path)
    os.truncate(st._rows_file.path, size // 2)
    with pytest.raises(he.HybridEmbedError, match="shorter than its rows"):
        ec({"a": torch.arange(10, 30)})
    assert torch.equal(st.free, free) and torch.equal(st.slot_of, slot_of)
    os.truncate(st._rows_file.path, size)
    torch.testing.assert_close(
        ec({"a": torch.arange(10, 30)})["a"], ref({"a": torch.arange(10, 30)})["a"], rtol=0, atol=0
    )
    assert st.free.numel() == free.numel() - 20
