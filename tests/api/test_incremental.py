"""Incremental and background checkpoints of a one-process model: a chain of deltas loads bit
for bit like a full save at the same step; a delta alone or a chain with a gap is refused,
naming the missing version; a failed save counts its rows as changed again; a background save
commits what the model held when it was called."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import hybridembed as he
from hybridembed import checkpoint as ckpt
from hybridembed.checkpoint import layout as ck_layout
from hybridembed.checkpoint import manifest as ck_manifest
from hybridembed.checkpoint import snapshot as ck_snapshot
from tests.api.test_checkpoint import assert_identical, batch, build, snapshot, train

EVICTING = {"query_dynamic": he.Dynamic(capacity=6, eviction="lru")}  # rows dropped between saves too


def _manifest(path, version):
    return json.loads((path / version / "manifest.json").read_text())


@pytest.mark.parametrize("opt_name", ["adagrad", "adam"])
def test_a_chain_of_five_deltas_loads_like_a_full_save(tmp_path, opt_name):
    model, opt = build(opt_name, **EVICTING)
    train(model, opt, range(2))
    chain = tmp_path / "chain"
    he.save(chain, model, opt, incremental=True)  # no version yet: a full one
    for i in range(5):
        train(model, opt, range(2 + i, 3 + i))
        with torch.no_grad():  # looked up, not updated: recency and counts change, and rows are admitted
            model(batch(100 + i))
        opt.step()  # (no gradients: the rows looked up may be evicted again)
        he.save(chain, model, opt, incremental=True, extra={"i": i})
    full = tmp_path / "full"
    he.save(full, model, opt)
    m = _manifest(chain, "v-000006")
    assert m["incremental"]["length"] == 5 and m["incremental"]["parent"]["version"] == "v-000005"
    assert m["incremental"]["base"]["version"] == "v-000001" and "incremental" not in _manifest(chain, "v-000001")
    assert sorted(p.name for p in chain.iterdir()) == ["LATEST", *(f"v-00000{i}" for i in range(1, 7))]  # keep=1
    shards = m["tables"]["hybridembed.user"]["shards"][0]
    assert 0 < shards["changed"] < shards["rows"]  # only the rows the last step touched

    results = []
    for path in (chain, full):
        fresh, fresh_opt = build(opt_name, **EVICTING)
        he.load(path, fresh, fresh_opt)
        results.append(snapshot(fresh, fresh_opt))
    assert_identical(results[0], results[1])
    assert_identical(results[0], snapshot(model, opt))
    # ...and the loaded chain trains on like the model that saved it
    fresh, fresh_opt = build(opt_name, **EVICTING)
    he.load(chain, fresh, fresh_opt)
    train(fresh, fresh_opt, range(7, 9))
    train(model, opt, range(7, 9))
    assert_identical(snapshot(fresh, fresh_opt), snapshot(model, opt))


def test_a_delta_is_smaller_than_a_full_version(tmp_path):
    ec = he.EmbeddingCollection(
        [he.TableConfig("big", 20_000, 16), he.TableConfig("dyn", None, 16, dynamic=he.Dynamic())]
    )
    opt = he.wrap_optimizer(torch.optim.Adagrad(ec.parameters(), lr=0.1), ec)

    def step(seed):
        g = torch.Generator().manual_seed(seed)
        out = ec(
            {
                "big": torch.randint(0, 20_000, (64, 2), generator=g),
                "dyn": torch.randint(0, 10**9, (64, 2), generator=g),
            }
        )
        opt.zero_grad()
        (out["big"].sum() + out["dyn"].sum()).backward()
        opt.step()

    for s in range(50):
        step(s)
    he.save(tmp_path / "c", ec, opt, incremental=True)
    step(99)
    he.save(tmp_path / "c", ec, opt, incremental=True)
    sizes = [sum(f["bytes"] for rel, f in _manifest(tmp_path / "c", v)["files"].items() if rel.startswith("tables/"))
             for v in ("v-000001", "v-000002")]  # fmt: skip
    assert sizes[1] < sizes[0] / 20, sizes


def test_a_delta_alone_or_a_chain_with_a_gap_is_refused_naming_the_missing_version(tmp_path):
    model, opt = build("adagrad")
    path = tmp_path / "c"
    for i in range(4):
        train(model, opt, range(i, i + 1))
        he.save(path, model, opt, incremental=True)
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copytree(path / "v-000004", alone / "v-000004")
    (alone / "LATEST").write_text("v-000004\n")
    fresh, fresh_opt = build("adagrad")
    before = snapshot(fresh, fresh_opt)
    with pytest.raises(he.CheckpointError, match=r"changed since version v-000003, which is missing"):
        he.load(alone, fresh, fresh_opt)
    shutil.rmtree(path / "v-000002")  # a gap in the middle of the chain
    with pytest.raises(
        he.CheckpointError, match=r"version v-000003 holds only the rows changed since version v-000002"
    ):
        he.load(path, fresh, fresh_opt)
    assert_identical(snapshot(fresh, fresh_opt), before)  # nothing changed
    # a parent replaced by another save (same name, another id) is refused too
    other = tmp_path / "other"
    he.save(other, model, opt)
    shutil.rmtree(path / "v-000003")
    shutil.copytree(other / "v-000001", path / "v-000003")
    with pytest.raises(he.CheckpointError, match=r"saved on top of version v-000003 with id"):
        he.load(path, fresh, fresh_opt)


def test_max_chain_and_a_model_not_saved_there_start_a_full_version(tmp_path):
    model, opt = build("adagrad")
    path = tmp_path / "c"
    kinds = []
    for i in range(5):
        train(model, opt, range(i, i + 1))
        v = he.save(path, model, opt, incremental=True, max_chain=2)
        kinds.append(json.loads((Path(v) / "manifest.json").read_text()).get("incremental", {}).get("length", 0))
    assert kinds == [0, 1, 2, 0, 1]
    # a model that was never saved to or loaded from this checkpoint: its next save is full
    other, other_opt = build("adagrad")
    v = he.save(path, other, other_opt, incremental=True)
    assert "incremental" not in json.loads((Path(v) / "manifest.json").read_text())
    # loading the current version makes the next save incremental on top of it
    he.load(path, model, opt)
    train(model, opt, range(9, 10))
    v = he.save(path, model, opt, incremental=True)
    assert json.loads((Path(v) / "manifest.json").read_text())["incremental"]["length"] == 1
    with pytest.raises(he.CheckpointError, match="max_chain must be an int >= 1"):
        he.save(path, model, opt, incremental=True, max_chain=0)
    with pytest.raises(he.CheckpointError, match="incremental must be True or False"):
        he.save(path, model, opt, incremental="yes")


def test_a_failed_incremental_save_counts_its_rows_as_changed_again(tmp_path, monkeypatch):
    model, opt = build("adagrad", **EVICTING)
    path = tmp_path / "c"
    train(model, opt, range(2))
    he.save(path, model, opt, incremental=True)
    train(model, opt, range(2, 4))
    real = ck_layout._write_file

    def failing(p, obj):
        if p.parent.name == "tables":
            raise ck_layout._WriteError(p, OSError(28, "No space left on device"))
        real(p, obj)

    monkeypatch.setattr(ck_layout, "_write_file", failing)
    with pytest.raises(he.CheckpointError, match="No space left on device"):
        he.save(path, model, opt, incremental=True)
    monkeypatch.setattr(ck_layout, "_write_file", real)
    assert (path / "LATEST").read_text().strip() == "v-000001"
    train(model, opt, range(4, 5))
    he.save(path, model, opt, incremental=True)  # holds the rows of steps 2..4, not only step 4's
    fresh, fresh_opt = build("adagrad", **EVICTING)
    he.load(path, fresh, fresh_opt)
    assert_identical(snapshot(fresh, fresh_opt), snapshot(model, opt))


def test_a_background_save_commits_the_state_it_was_called_with(tmp_path):
    model, opt = build("adam", **EVICTING)
    train(model, opt, range(3))
    path = tmp_path / "c"
    handle = he.save(path, model, opt, background=True, extra={"step": 3})
    at_save = snapshot(model, opt)
    train(model, opt, range(3, 5))  # training goes on while the files are written
    assert handle.wait().endswith("v-000001") and handle.done()
    handle2 = he.save(path, model, opt, incremental=True, background=True)
    at_save2 = snapshot(model, opt)
    train(model, opt, range(5, 6))
    fresh, fresh_opt = build("adam", **EVICTING)
    assert he.load(path, fresh, fresh_opt)  # waits for nothing: another model
    handle2.wait()
    for path_, want in ((path / "v-000001", at_save), (path, at_save2)):
        fresh, fresh_opt = build("adam", **EVICTING)
        he.load(path_, fresh, fresh_opt)
        assert_identical(snapshot(fresh, fresh_opt), want)
    assert json.loads((path / "v-000002" / "manifest.json").read_text())["incremental"]["length"] == 1


def test_a_failed_background_save_raises_at_wait_and_keeps_the_previous_version(tmp_path, monkeypatch):
    model, opt = build("adagrad")
    path = tmp_path / "c"
    train(model, opt, range(2))
    he.save(path, model, opt)
    real = ck_layout._write_file

    def failing(p, obj):
        if p.name == "dense.pt":
            raise ck_layout._WriteError(p, OSError(28, "No space left on device"))
        real(p, obj)

    monkeypatch.setattr(ck_layout, "_write_file", failing)
    handle = he.save(path, model, opt, background=True, incremental=True)
    with pytest.raises(he.CheckpointError, match="No space left on device"):
        handle.wait()
    monkeypatch.setattr(ck_layout, "_write_file", real)
    assert (path / "LATEST").read_text().strip() == "v-000001"
    assert sorted(p.name for p in path.iterdir()) == ["LATEST", "v-000001"]
    # the next save of the model does not hang on the failed one and writes every change since v-000001
    train(model, opt, range(2, 3))
    he.save(path, model, opt, incremental=True)
    fresh, fresh_opt = build("adagrad")
    he.load(path, fresh, fresh_opt)
    assert_identical(snapshot(fresh, fresh_opt), snapshot(model, opt))


def test_an_incremental_manifest_is_format_3_and_its_chain_fields_are_checked(tmp_path):
    model, opt = build("adagrad")
    path = tmp_path / "c"
    for i in range(2):
        train(model, opt, range(i, i + 1))
        he.save(path, model, opt, incremental=True)
    assert _manifest(path, "v-000001")["format_version"] == 2  # a full version: readable by older readers
    m = _manifest(path, "v-000002")
    assert m["format_version"] == 3 and isinstance(m["id"], str) and m["id"] != _manifest(path, "v-000001")["id"]
    m.pop("manifest_sha256")
    m["incremental"]["parent"]["version"] = 7
    (path / "v-000002" / "manifest.json").write_text(json.dumps(ck_manifest._sealed(m)))
    fresh, fresh_opt = build("adagrad")
    with pytest.raises(he.CheckpointError, match=r"field 'incremental.parent.version': expected a string, got 7"):
        he.load(path, fresh, fresh_opt)


def test_compact_writes_a_chain_again_as_one_full_version(tmp_path):
    model, opt = build("adam", **EVICTING)
    path = tmp_path / "c"
    for i in range(4):
        train(model, opt, range(i, i + 1))
        he.save(path, model, opt, incremental=True, extra={"i": i})
    written = ckpt.compact(path)
    assert written.endswith("v-000005") and (path / "LATEST").read_text().strip() == "v-000005"
    m = _manifest(path, "v-000005")
    assert "incremental" not in m and m["format_version"] == 2 and m["extra"] == {"i": 3}
    assert sorted(p.name for p in path.iterdir()) == ["LATEST", "v-000005"]  # keep=1: the chain is gone
    assert ckpt.compact(path) == written  # already full: nothing to do
    fresh, fresh_opt = build("adam", **EVICTING)
    he.load(path, fresh, fresh_opt)
    assert_identical(snapshot(fresh, fresh_opt), snapshot(model, opt))
    # the model's next incremental save: a full one (it did not save or load the compacted version)
    train(model, opt, range(5, 6))
    assert "incremental" not in json.loads(
        (Path(he.save(path, model, opt, incremental=True)) / "manifest.json").read_text()
    )
    with pytest.raises(he.CheckpointError, match="keep must be an int >= 1"):
        ckpt.compact(path, keep=0)
    with pytest.raises(he.CheckpointError, match="verify must be True or False"):
        ckpt.compact(path, verify="no")


def _chain_equals_model(path, model, opt):
    fresh, fresh_opt = build("adagrad")
    he.load(path, fresh, fresh_opt)
    assert_identical(snapshot(fresh, fresh_opt), snapshot(model, opt))


def test_a_save_whose_copy_fails_counts_its_rows_as_changed_again(tmp_path, monkeypatch):
    model, opt = build("adagrad")
    train(model, opt, range(2))
    he.save(tmp_path / "c", model, opt, incremental=True)
    train(model, opt, range(2, 3))

    def boom(*a, **k):
        raise RuntimeError("out of memory (simulated)")

    real = ck_snapshot._snapshot_dense
    monkeypatch.setattr(ck_snapshot, "_snapshot_dense", boom)
    with pytest.raises(RuntimeError, match="out of memory"):
        he.save(tmp_path / "c", model, opt, incremental=True)
    monkeypatch.setattr(ck_snapshot, "_snapshot_dense", real)
    train(model, opt, range(3, 4))
    he.save(tmp_path / "c", model, opt, incremental=True)
    _chain_equals_model(tmp_path / "c", model, opt)


def test_state_the_model_did_not_load_or_a_new_optimizer_makes_the_next_delta_whole(tmp_path):
    model, opt = build("adagrad")
    train(model, opt, range(2))
    he.save(tmp_path / "c", model, opt)
    # loaded without the optimizer: the rows' state is not the version's, the next save is full
    fresh, fresh_opt = build("adagrad")
    he.load(tmp_path / "c", fresh)
    train(fresh, fresh_opt, range(2, 3))
    v = he.save(tmp_path / "c", fresh, fresh_opt, incremental=True)
    assert "incremental" not in json.loads((Path(v) / "manifest.json").read_text())
    _chain_equals_model(tmp_path / "c", fresh, fresh_opt)
    # a new optimizer after a save: every row's state is new, the next delta holds every row
    new_opt = he.wrap_optimizer(torch.optim.Adagrad(fresh.parameters(), lr=0.1, lr_decay=0.01), fresh)
    train(fresh, new_opt, range(3, 4))
    he.save(tmp_path / "c", fresh, new_opt, incremental=True)
    _chain_equals_model(tmp_path / "c", fresh, new_opt)


def test_a_save_without_then_with_the_optimizer_commits_a_full_version_and_says_so(tmp_path):
    model, opt = build("adagrad")
    train(model, opt, range(2))
    he.save(tmp_path / "c", model, incremental=True)  # no optimizer state
    train(model, opt, range(2, 3))
    v = he.save(tmp_path / "c", model, opt, incremental=True)  # the state changed: a full version
    assert v.endswith("v-000002") and "incremental" not in json.loads((Path(v) / "manifest.json").read_text())
    _chain_equals_model(tmp_path / "c", model, opt)
