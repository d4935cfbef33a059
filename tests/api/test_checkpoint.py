"""``he.save`` / ``he.load``: bit-identical resume in a fresh process, atomicity under crashes,
and a clear error (with nothing changed) for every kind of damage or mismatch."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import hybridembed as he
from hybridembed import checkpoint as ckpt
from hybridembed.checkpoint import layout as ck_layout
from hybridembed.checkpoint import lock as ck_lock
from hybridembed.checkpoint import manifest as ck_manifest
from tests import warm

ROOT = Path(__file__).resolve().parents[2]
HE_SRC = str(Path(he.__file__).resolve().parents[1])  # the subprocesses import the hybridembed tested here
D = 4
B = 6
K = 3  # steps before the checkpoint, and after it


class Net(nn.Module):
    """Two layers converted by he.convert (one made dynamic), an EmbeddingCollection with a
    dense and a dynamic table, and an MLP."""

    def __init__(self, tag_dim=D, tag_dtype=torch.float32, extra_table=False, drop_query=False, query_dynamic=None):
        super().__init__()
        self.user = nn.Embedding(50, D)
        self.items = nn.EmbeddingBag(40, D, mode="mean")
        tables = [he.TableConfig("tag", 10, tag_dim, dtype=tag_dtype)]
        if not drop_query:
            dynamic = query_dynamic or he.Dynamic()
            tables.append(he.TableConfig("query", None, D, combiner="mean", dynamic=dynamic))
        if extra_table:
            tables.append(he.TableConfig("more", 5, D))
        self.ec = he.EmbeddingCollection(tables, seed=3)
        self.mlp = nn.Sequential(nn.Linear(3 * D + tag_dim, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, b):
        e = self.ec({"tag": b["tag"], "query": b["query"]})
        x = torch.cat([self.user(b["user"]), self.items(b["items"]), e["tag"], e["query"]], 1)
        return self.mlp(x).squeeze(1)


def build(opt_name="adagrad", **kw):
    torch.manual_seed(0)
    model = he.convert(Net(**kw), tables={"user": {"dynamic": he.Dynamic()}}, seed=1)
    if opt_name == "adagrad":
        dense = torch.optim.Adagrad(model.parameters(), lr=0.1, lr_decay=0.01)
    else:
        dense = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, he.wrap_optimizer(dense, model)


def batch(step):
    g = torch.Generator().manual_seed(500 + step)
    tag = torch.randint(0, 10, (B, 2), generator=g)
    tag[0, 1] = -1  # padding
    return {
        "user": torch.randint(0, 20 + 10 * step, (B,), generator=g),  # new ids show up every step
        "items": torch.randint(0, 40, (B, 3), generator=g),
        "tag": tag,
        "query": [torch.randint(-(10**12), 10**12, (int(n),), generator=g).tolist() for n in torch.arange(B) % 3],
        "target": torch.randn(B, generator=g),
    }


def train(model, opt, steps):
    for s in steps:
        b = batch(s)
        opt.zero_grad()
        ((model(b) - b["target"]) ** 2).sum().backward()
        opt.step()


def snapshot(model, opt=None):
    """Everything training depends on, cloned: model state (dynamic rows by id) and optimizer state."""

    def clone(x):
        if torch.is_tensor(x):
            return x.detach().clone()
        if isinstance(x, dict):
            return {k: clone(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(clone(v) for v in x)
        return x

    return {"model": clone(model.state_dict()), "opt": clone(opt.state_dict()) if opt is not None else None}


def assert_identical(a, b, where="root"):
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert sorted(a, key=str) == sorted(b, key=str), where
        for k in a:
            assert_identical(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def trained(opt_name="adagrad", steps=K, **kw):
    model, opt = build(opt_name, **kw)
    train(model, opt, range(steps))
    return model, opt


# --- resume, bit for bit, in a fresh process ------------------------------------------------------------------
def test_resume_in_a_fresh_process_is_bit_identical(tmp_path):
    expected = {}
    for name in ("adagrad", "adam"):
        model, opt = trained(name)
        he.save(tmp_path / name, model, opt, extra={"step": K})
        train(model, opt, range(K, 2 * K))  # the uninterrupted run
        expected[name] = snapshot(model, opt)
    result = tmp_path / "resumed.pt"
    code = f"""
import sys, torch
sys.path[:0] = [{str(ROOT)!r}, {HE_SRC!r}]
import hybridembed as he
from tests.api.test_checkpoint import build, train, snapshot, K
torch.set_num_threads(1)
out = {{}}
for name in ("adagrad", "adam"):
    model, opt = build(name)
    manifest = he.load({str(tmp_path)!r} + "/" + name, model, opt)
    assert manifest["extra"] == {{"step": K}}, manifest["extra"]
    train(model, opt, range(K, 2 * K))
    out[name] = snapshot(model, opt)
torch.save(out, {str(result)!r})
"""
    env = {**os.environ, "HYBRIDEMBED_LOG_LEVEL": "WARNING"}
    rc, _, err = warm.run_code(code, env, cwd=ROOT, timeout=300)  # (a new process, forked warm)
    assert rc == 0, err[-3000:]
    got = torch.load(result, weights_only=True)
    for name in ("adagrad", "adam"):
        assert_identical(got[name], expected[name], name)
    manifest = ckpt.read_manifest(tmp_path / "adam")
    t = manifest["tables"]
    assert sorted(t) == ["ec.query", "ec.tag", "hybridembed.items", "hybridembed.user"]
    assert t["hybridembed.items"]["shards"] == [
        {"file": "tables/hybridembed.items.00000.pt", "row_start": 0, "row_end": 40}
    ]
    assert t["hybridembed.user"]["kind"] == "dynamic" and t["hybridembed.user"]["shape"] == [None, D]
    assert t["ec.query"]["optimizer_state"] == ["exp_avg", "exp_avg_sq"]
    assert manifest["optimizer"]["sparse"]["ec.tag"]["optimizer"] == "Adam"
    assert manifest["optimizer"]["dense"] == "Adam" and manifest["torch_version"] == torch.__version__
    for rel, spec in manifest["files"].items():
        assert (Path(manifest["path"]) / rel).stat().st_size == spec["bytes"] and len(spec["sha256"]) == 64


def test_model_only_checkpoint_and_plain_torch_optimizer(tmp_path):
    model, opt = trained("adagrad")
    he.save(tmp_path / "m", model)  # no optimizer
    fresh, fresh_opt = build("adagrad")
    he.load(tmp_path / "m", fresh)
    assert_identical(snapshot(fresh)["model"], snapshot(model)["model"])
    with pytest.raises(he.CheckpointError, match="no optimizer state"):
        he.load(tmp_path / "m", fresh, fresh_opt)
    plain = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    sgd = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    plain(torch.randn(4, 3)).sum().backward()
    sgd.step()
    he.save(tmp_path / "p", plain, sgd)
    other = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    other_sgd = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    he.load(tmp_path / "p", other, other_sgd)
    assert_identical(snapshot(other, other_sgd), snapshot(plain, sgd))


def test_loading_into_a_trained_model_restores_exactly_even_empty_dynamic_tables(tmp_path):
    model, opt = build("adam")  # untrained: its dynamic tables hold no rows yet
    he.save(tmp_path / "c", model, opt)
    expected = snapshot(model, opt)
    other, other_opt = trained("adam", steps=2)
    assert other.hybridembed.dynamic_rows("user")[0].numel() > 0
    he.load(tmp_path / "c", other, other_opt)
    assert other.hybridembed.dynamic_rows("user")[0].numel() == 0
    assert_identical(snapshot(other, other_opt), expected)
    train(other, other_opt, range(2))  # and it trains on
    train(model, opt, range(2))
    assert_identical(snapshot(other, other_opt), snapshot(model, opt))


# --- atomicity ---------------------------------------------------------------------------------------------------
def _versions(path):
    return sorted(p.name for p in Path(path).iterdir() if p.name != "LATEST")


@pytest.mark.parametrize("fail_at", [1, 3, 6, "commit"])
def test_a_save_that_fails_midway_leaves_the_old_checkpoint(tmp_path, monkeypatch, fail_at):
    model, opt = trained("adagrad", steps=1)
    he.save(tmp_path / "c", model, opt)
    before = snapshot(model, opt)
    train(model, opt, range(1, 2))
    calls = {"n": 0}
    real_write, real_commit = ck_layout._write_file, ck_layout._commit

    def write(path, obj):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise OSError("disk full (injected)")
        real_write(path, obj)

    def commit(root, version):
        raise OSError("crash before the pointer flip (injected)")

    monkeypatch.setattr(ck_layout, "_write_file", write)
    if fail_at == "commit":
        monkeypatch.setattr(ck_layout, "_commit", commit)
    with pytest.raises(he.CheckpointError, match=r"cannot write the checkpoint .*injected.*previous version"):
        he.save(tmp_path / "c", model, opt)
    assert _versions(tmp_path / "c") == ["v-000001"]  # the partial version is gone, the old one intact
    monkeypatch.setattr(ck_layout, "_write_file", real_write)
    monkeypatch.setattr(ck_layout, "_commit", real_commit)
    fresh, fresh_opt = build("adagrad")
    he.load(tmp_path / "c", fresh, fresh_opt)  # checksums verified
    assert_identical(snapshot(fresh, fresh_opt), before)


def test_a_process_killed_midway_leaves_the_old_checkpoint(tmp_path):
    code = f"""
import os, sys, torch
sys.path[:0] = [{str(ROOT)!r}, {HE_SRC!r}]
import hybridembed as he
from hybridembed import checkpoint as ckpt
from hybridembed.checkpoint import layout as ck_layout, lock as ck_lock, manifest as ck_manifest, snapshot as ck_snapshot
from tests.api.test_checkpoint import trained, train, snapshot
torch.set_num_threads(1)
model, opt = trained("adam", steps=1)
he.save({str(tmp_path / "c")!r}, model, opt)
torch.save(snapshot(model, opt), {str(tmp_path / "v1.pt")!r})
train(model, opt, range(1, 3))
real, n = ck_layout._write_file, [0]
def dying(path, obj):
    n[0] += 1
    if n[0] == 4:
        os._exit(17)  # no cleanup, no finally: as a kill -9 would
    real(path, obj)
ck_layout._write_file = dying
he.save({str(tmp_path / "c")!r}, model, opt)
"""
    env = {**os.environ, "HYBRIDEMBED_LOG_LEVEL": "WARNING"}
    rc, _, err = warm.run_code(code, env, cwd=ROOT, timeout=300)
    assert rc == 17, err[-3000:]
    leftovers = [n for n in _versions(tmp_path / "c") if n.startswith(".tmp-")]
    assert len(leftovers) == 1 and "v-000002" in leftovers[0]  # the dead save's partial version
    fresh, fresh_opt = build("adam")
    he.load(tmp_path / "c", fresh, fresh_opt)
    assert_identical(snapshot(fresh, fresh_opt), torch.load(tmp_path / "v1.pt", weights_only=True))
    train(fresh, fresh_opt, range(1, 2))
    he.save(tmp_path / "c", fresh, fresh_opt)  # the next save clears the leftovers
    assert _versions(tmp_path / "c") == ["v-000002"]


def test_keep_and_loading_an_older_version_by_its_directory(tmp_path):
    model, opt = trained("adagrad", steps=1)
    snaps = []
    for s in range(3):
        snaps.append(snapshot(model, opt))
        he.save(tmp_path / "c", model, opt, keep=2)
        train(model, opt, range(s + 1, s + 2))
    assert _versions(tmp_path / "c") == ["v-000002", "v-000003"]
    assert (tmp_path / "c" / "LATEST").read_text().strip() == "v-000003"
    fresh, fresh_opt = build("adagrad")
    he.load(tmp_path / "c" / "v-000002", fresh, fresh_opt)
    assert_identical(snapshot(fresh, fresh_opt), snaps[1])
    he.load(tmp_path / "c", fresh, fresh_opt)
    assert_identical(snapshot(fresh, fresh_opt), snaps[2])
    for n in range(4, 8):  # keep more than there are: none deleted until there are more
        he.save(tmp_path / "c", model, opt, keep=5)
        assert _versions(tmp_path / "c") == [f"v-{v:06d}" for v in range(max(2, n - 4), n + 1)]


def test_a_writer_stopped_while_deleting_an_old_version_leaves_no_half_version(tmp_path, monkeypatch):
    """An old version is renamed away before it is deleted: a writer that dies mid-delete leaves a
    leftover the next writer removes, never a version directory missing files (which a later writer
    keeping more versions would keep, and a load by its directory would find broken)."""
    model, opt = trained("adagrad", steps=1)
    he.save(tmp_path / "c", model, opt)
    real = ck_layout.shutil.rmtree

    def dies_midway(path, *args, **kwargs):  # one file deleted, then the process "dies"
        next(p for p in Path(path).rglob("*") if p.is_file()).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(ck_layout.shutil, "rmtree", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        he.save(tmp_path / "c", model, opt)
    monkeypatch.setattr(ck_layout.shutil, "rmtree", real)
    names = _versions(tmp_path / "c")
    assert "v-000001" not in names and "v-000002" in names, names  # (the half-deleted one has no version name)
    train(model, opt, range(1, 2))
    he.save(tmp_path / "c", model, opt, keep=3)
    assert _versions(tmp_path / "c") == ["v-000002", "v-000003"]  # (the leftover removed)
    fresh, fresh_opt = build("adagrad")
    he.load(tmp_path / "c" / "v-000002", fresh, fresh_opt)


def test_shards_written_by_several_ranks_load_as_one_table(tmp_path):
    """Split every table in two shards, as two ranks would write them: it loads the same."""
    model, opt = trained("adam")
    he.save(tmp_path / "c", model, opt)
    vdir = Path(ckpt.read_manifest(tmp_path / "c")["path"])
    manifest = json.loads((vdir / "manifest.json").read_text())
    for spec in manifest["tables"].values():
        (shard,) = spec["shards"]
        data = torch.load(vdir / shard["file"], weights_only=True)
        n = data["weight"].shape[0]
        cut = n // 2
        pieces = []
        for r, (lo, hi) in enumerate([(cut, n), (0, cut)]):  # out of order on purpose
            part = {k: v[lo:hi] if k in ("ids", "weight", "last_seen", "freq") else v for k, v in data.items()}
            part["state"] = {k: v[lo:hi] for k, v in data["state"].items()}
            if spec["kind"] == "dynamic" and r == 1:  # rank 1's counters: zero, they add up
                part["stats"] = torch.zeros_like(data["stats"])
            rel = shard["file"].replace(".00000.pt", f".rank{r}.pt")
            torch.save(part, vdir / rel)
            manifest["files"][rel] = {"bytes": (vdir / rel).stat().st_size, "sha256": ck_layout._sha256(vdir / rel)}
            pieces.append({"file": rel, "row_start": lo, "row_end": hi} if spec["kind"] == "dense" else {"file": rel})
        os.remove(vdir / shard["file"])
        del manifest["files"][shard["file"]]
        spec["shards"] = pieces
    _write_manifest(vdir, manifest)
    fresh, fresh_opt = build("adam")
    he.load(tmp_path / "c", fresh, fresh_opt)
    assert_identical(snapshot(fresh, fresh_opt), snapshot(model, opt))


# --- damage and mismatch: a clear error, nothing changed -----------------------------------------------------
@pytest.fixture
def saved(tmp_path):
    model, opt = trained("adagrad")
    he.save(tmp_path / "c", model, opt)
    return tmp_path / "c", Path(ckpt.read_manifest(tmp_path / "c")["path"])


def _flip_byte(p: Path):
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


DAMAGE = {
    "truncated": (
        lambda v: (v / "tables/ec.tag.00000.pt").write_bytes((v / "tables/ec.tag.00000.pt").read_bytes()[:100]),
        r"'tables/ec.tag.00000.pt' is truncated",
    ),
    "checksum": (lambda v: _flip_byte(v / "dense.pt"), r"'dense.pt': checksum mismatch"),
    "missing-file": (
        lambda v: os.remove(v / "tables/hybridembed.user.00000.pt"),
        r"'tables/hybridembed.user.00000.pt' is missing",
    ),
    "bad-json": (lambda v: (v / "manifest.json").write_text('{"format": "hybrid'), r"manifest.json is not valid JSON"),
    "unknown-version": (
        lambda v: (v / "manifest.json").write_text(
            json.dumps({**json.loads((v / "manifest.json").read_text()), "format_version": 99})
        ),
        r"format version 99 is unknown.*upgrade hybridembed",
    ),
    "no-pointer": (lambda v: os.remove(v.parent / "LATEST"), r"LATEST is missing"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_checkpoint_is_refused_and_the_model_is_unchanged(saved, case):
    path, vdir = saved
    damage, words = DAMAGE[case]
    damage(vdir)
    model, opt = trained("adagrad", steps=1)  # a different state than the checkpoint's
    before = snapshot(model, opt)
    with pytest.raises(he.CheckpointError, match=words):
        he.load(path, model, opt)
    assert_identical(snapshot(model, opt), before)


MISMATCH = {
    "dim-changed": ({"tag_dim": D + 2}, r"table 'ec.tag': dim changed: 4 in the checkpoint, 6 in the model"),
    "dtype-changed": ({"tag_dtype": torch.float64}, r"table 'ec.tag': dtype changed: float32 .* float64"),
    "table-missing": ({"extra_table": True}, r"table 'ec.more' is in the model but missing from the checkpoint"),
    "unexpected-table": ({"drop_query": True}, r"unexpected table 'ec.query' in the checkpoint"),
}


@pytest.mark.parametrize("case", list(MISMATCH))
def test_model_that_does_not_match_is_refused_and_unchanged(saved, case):
    path, _ = saved
    kw, words = MISMATCH[case]
    model, opt = build("adagrad", **kw)
    before = snapshot(model, opt)
    with pytest.raises(he.CheckpointError, match=words) as e:
        he.load(path, model, opt)
    assert "nothing was loaded" in str(e.value)
    assert_identical(snapshot(model, opt), before)


def test_optimizer_that_does_not_match_is_refused(saved):
    path, _ = saved
    model, opt = build("adam")
    before = snapshot(model, opt)
    with pytest.raises(he.CheckpointError, match=r"optimizer changed: Adagrad in the checkpoint, Adam here") as e:
        he.load(path, model, opt)
    assert "table 'ec.tag': optimizer Adagrad in the checkpoint, Adam here" in str(e.value)
    assert_identical(snapshot(model, opt), before)


def test_save_refuses_a_path_that_is_a_file_and_unserialisable_extra(tmp_path):
    model, opt = build()
    (tmp_path / "f").write_text("x")
    with pytest.raises(he.CheckpointError, match="not a directory"):
        he.save(tmp_path / "f", model)
    with pytest.raises(he.CheckpointError, match="JSON"):
        he.save(tmp_path / "c", model, extra={"x": object()})
    with pytest.raises(he.CheckpointError, match="no checkpoint"):
        he.load(tmp_path / "nothing", model)


# --- all or nothing: settings and file contents that do not fit the model ------------------------------
def test_a_dynamic_table_with_another_sketch_is_refused_and_unchanged(tmp_path):
    model, opt = trained(query_dynamic=he.Dynamic(min_count=2, sketch_width=64))
    he.save(tmp_path / "c", model, opt)
    other, other_opt = trained(steps=1, query_dynamic=he.Dynamic(min_count=2, sketch_width=128))
    before = snapshot(other, other_opt)
    with pytest.raises(he.CheckpointError, match=r"ec\.query\.sketch: .* 4 x 64 counters .*sketch_width=128") as e:
        he.load(tmp_path / "c", other, other_opt)
    assert "nothing was loaded" in str(e.value)
    assert_identical(snapshot(other, other_opt), before)
    plain, plain_opt = build()  # min_count=1 keeps no sketch: the saved one is not needed
    he.load(tmp_path / "c", plain, plain_opt)


def _rewrite(vdir: Path, rel: str, change) -> None:
    """Replace file ``rel`` of a version by ``change(its contents)``, with the manifest's size and
    checksums made to match: a consistent checkpoint that does not fit the model."""
    obj = torch.load(vdir / rel, weights_only=True)
    torch.save(change(obj), vdir / rel)
    manifest = json.loads((vdir / "manifest.json").read_text())
    manifest["files"][rel] = {"bytes": (vdir / rel).stat().st_size, "sha256": ck_layout._sha256(vdir / rel)}
    _write_manifest(vdir, manifest)


def _write_manifest(vdir: Path, manifest: dict) -> None:
    """Write an edited manifest with a checksum that matches it (as a writer of shards would)."""
    (vdir / "manifest.json").write_text(json.dumps(ck_manifest._sealed(manifest)))


def _bad_state(shard):
    shard["state"] = {k: v[:-1] for k, v in shard["state"].items()}  # one row short
    return shard


INCONSISTENT = {
    "optimizer-state-rows": (
        "tables/ec.tag.00000.pt",
        _bad_state,
        r"table 'ec.tag': file '.*': optimizer state 'sum' is \(9, 4\)",
    ),
    "dynamic-optimizer-state": (
        "tables/ec.query.00000.pt",
        _bad_state,
        r"table 'ec.query': file '.*': optimizer state 'sum' is",
    ),
    "dense-tensor-shape": (
        "dense.pt",
        lambda d: {**d, "mlp.0.weight": torch.zeros(3, 3)},
        r"'dense.pt': 'mlp.0.weight' is \(3, 3\) float32, the model's \(8, 16\) float32",
    ),
    "dynamic-counters": (
        "tables/hybridembed.user.00000.pt",
        lambda d: {**d, "freq": d["freq"][:-1]},
        r"hybridembed.user.*'freq' of shape \(\d+,\)",
    ),
    "row-dtype": (
        "tables/hybridembed.items.00000.pt",
        lambda d: {**d, "weight": d["weight"].double()},
        r"hybridembed.items.weight: dtype torch.float64, the table's is torch.float32",
    ),
}


@pytest.mark.parametrize("case", list(INCONSISTENT))
def test_file_contents_that_do_not_fit_are_refused_and_nothing_changes(saved, case):
    path, vdir = saved
    rel, change, words = INCONSISTENT[case]
    _rewrite(vdir, rel, change)
    model, opt = trained("adagrad", steps=1)
    before = snapshot(model, opt)
    with pytest.raises(he.CheckpointError, match=words) as e:
        he.load(path, model, opt)
    assert "nothing was loaded" in str(e.value)
    assert_identical(snapshot(model, opt), before)


# --- the manifest: checksummed, every field typed -----------------------------------------------------
def _manifest(vdir: Path) -> dict:
    return json.loads((vdir / "manifest.json").read_text())


def _refused(path, words):
    model, opt = trained("adagrad", steps=1)
    before = snapshot(model, opt)
    with pytest.raises(he.CheckpointError, match=words):
        he.load(path, model, opt)
    assert_identical(snapshot(model, opt), before)


def test_a_flipped_digit_in_extra_is_caught_by_the_manifest_checksum(tmp_path):
    model, opt = trained("adagrad")
    he.save(tmp_path / "c", model, opt, extra={"epoch": 3, "step": 120})
    vdir = Path(ckpt.read_manifest(tmp_path / "c")["path"])
    text = (vdir / "manifest.json").read_text()
    assert text.count('"epoch": 3') == 1
    (vdir / "manifest.json").write_text(text.replace('"epoch": 3', '"epoch": 7'))
    with pytest.raises(he.CheckpointError, match=r"manifest.json does not match its checksum .*'manifest_sha256'"):
        ckpt.read_manifest(tmp_path / "c")
    _refused(tmp_path / "c", "does not match its checksum")


def test_non_finite_floats_in_extra_are_stored_and_come_back(tmp_path):
    """nan, inf and -inf in extra (an AUC of held-out rows of one class is nan) are stored as strict
    JSON, covered by the checksum, and come back as floats from load, read_manifest and compact."""
    nan, inf = float("nan"), float("inf")
    extra = {"auc": nan, "x": inf, "nested": {"y": -inf, "list": [1.5, nan]}, "step": 3}

    def check(got):
        assert math.isnan(got["auc"]) and got["x"] == inf and got["nested"]["y"] == -inf and got["step"] == 3
        assert got["nested"]["list"][0] == 1.5 and math.isnan(got["nested"]["list"][1])

    model, opt = trained("adagrad", steps=1)
    he.save(tmp_path / "c", model, opt, extra=extra)
    fresh, fresh_opt = build("adagrad")
    check(he.load(tmp_path / "c", fresh, fresh_opt)["extra"])
    check(ckpt.read_manifest(tmp_path / "c")["extra"])
    train(model, opt, range(1, 2))  # an incremental version, compacted: extra stays as it was
    he.save(tmp_path / "c", model, opt, extra=extra, incremental=True)
    vdir = Path(ckpt.compact(tmp_path / "c"))
    check(ckpt.read_manifest(vdir)["extra"])
    text = (vdir / "manifest.json").read_text()

    def no_constants(name):
        raise AssertionError(f"the manifest holds {name}: not strict JSON")

    json.loads(text, parse_constant=no_constants)
    assert text.count('"nan"') == 2  # the stored form is covered by the checksum like any other field
    (vdir / "manifest.json").write_text(text.replace('"nan"', '"inf"', 1))
    with pytest.raises(he.CheckpointError, match="does not match its checksum"):
        ckpt.read_manifest(vdir)
    with pytest.raises(he.CheckpointError, match=r"extra\.a: the key '__float__' is reserved"):
        he.save(tmp_path / "c", model, opt, extra={"a": {"__float__": "nan"}})


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda m: m.__setitem__("extrb", m.pop("extra")), "does not match its checksum"),  # a changed key
        (lambda m: m["tables"]["ec.tag"].__setitem__("rows", 11), "does not match its checksum"),
        (lambda m: m.pop("manifest_sha256"), "has no checksum"),
    ],
    ids=["renamed-key", "changed-value", "no-checksum"],
)
def test_an_edited_manifest_is_refused(saved, edit, words):
    path, vdir = saved
    m = _manifest(vdir)
    edit(m)
    (vdir / "manifest.json").write_text(json.dumps(m))
    _refused(path, f"manifest.json {words}")


def _set(*keys, value):
    def edit(m):
        d = m
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value

    return edit


# every field with a wrong type (the checksum made to match, as a buggy writer would): one
# CheckpointError naming the file and the field, never an AttributeError/KeyError/TypeError
WRONG_TYPES = {
    "world_size": (_set("world_size", value="1"), "'world_size': expected an int >= 1"),
    "extra": (_set("extra", value=[1]), "'extra': expected an object"),
    "created": (_set("created", value=5), "'created': expected a string"),
    "tables": (_set("tables", value=[]), "'tables': expected an object"),
    "table": (_set("tables", "ec.tag", value="x"), "'tables.ec.tag': expected an object"),
    "kind": (_set("tables", "ec.tag", "kind", value="sparse"), "'tables.ec.tag.kind': expected 'dense' or 'dynamic'"),
    "shape": (_set("tables", "ec.tag", "shape", value=10), r"'tables.ec.tag.shape': expected \[rows, dim\]"),
    "shape-item": (_set("tables", "ec.tag", "shape", value=["10", 4]), r"'tables.ec.tag.shape': expected"),
    "dynamic-shape": (_set("tables", "ec.query", "shape", value=[5, 4]), r"'tables.ec.query.shape': expected \[null"),
    "dtype": (_set("tables", "ec.tag", "dtype", value=None), "'tables.ec.tag.dtype': expected a string"),
    "rows": (_set("tables", "ec.tag", "rows", value=-1), "'tables.ec.tag.rows': expected an int >= 0"),
    "optimizer_state": (
        _set("tables", "ec.tag", "optimizer_state", value="sum"),
        "'tables.ec.tag.optimizer_state': expected a list of strings",
    ),
    "shards": (_set("tables", "ec.tag", "shards", value={}), "'tables.ec.tag.shards': expected a non-empty list"),
    "shard": (_set("tables", "ec.tag", "shards", value=[3]), r"'tables.ec.tag.shards\[0\]': expected an object"),
    "row_end": (
        lambda m: m["tables"]["ec.tag"]["shards"][0].__setitem__("row_end", 10.0),
        r"'tables.ec.tag.shards\[0\].row_end': expected an int",
    ),
    "shard-file": (
        lambda m: m["tables"]["ec.tag"]["shards"][0].pop("file"),
        r"'tables.ec.tag.shards\[0\].file' is missing",
    ),
    "dynamic-settings": (_set("tables", "ec.query", "dynamic", value=1), "'tables.ec.query.dynamic': expected"),
    "dense": (_set("dense", value=None), "'dense': expected an object"),
    "dense-file": (_set("dense", "file", value=1), "'dense.file': expected a string"),
    "dense-tensors": (_set("dense", "tensors", value=[]), "'dense.tensors': expected an object"),
    "dense-tensor-shape": (
        lambda m: next(iter(m["dense"]["tensors"].values())).__setitem__("shape", "8x16"),
        r"'dense.tensors.mlp.0.weight.shape': expected a list of ints",
    ),
    "dense-other": (_set("dense", "other", value=None), "'dense.other': expected a list of strings"),
    "optimizer": (_set("optimizer", value="adagrad"), "'optimizer': expected an object or null"),
    "optimizer-kind": (_set("optimizer", "kind", value=1), "'optimizer.kind': expected 'hybrid' or 'torch'"),
    "optimizer-groups": (
        _set("optimizer", "dense_param_groups", value=[{"num_params": "3"}]),
        r"'optimizer.dense_param_groups\[0\].num_params': expected an int",
    ),
    "optimizer-sparse": (_set("optimizer", "sparse", value=[]), "'optimizer.sparse': expected an object"),
    "optimizer-step": (
        _set("optimizer", "sparse", "ec.tag", "step", value=None),
        "'optimizer.sparse.ec.tag.step': expected an int",
    ),
    "optimizer-hparams": (
        _set("optimizer", "sparse", "ec.tag", "hparams", value=0.1),
        "'optimizer.sparse.ec.tag.hparams': expected an object",
    ),
    "files": (_set("files", value=None), "'files': expected an object"),
    "file-bytes": (_set("files", "dense.pt", "bytes", value="12"), "'files.dense.pt.bytes': expected an int"),
    "file-sha": (_set("files", "dense.pt", "sha256", value=1), "'files.dense.pt.sha256': expected 64 hex digits"),
    "missing-field": (lambda m: m.pop("torch_version"), "'torch_version' is missing"),
}


@pytest.mark.parametrize("case", list(WRONG_TYPES))
def test_a_wrongly_typed_manifest_field_is_named(saved, case):
    path, vdir = saved
    edit, words = WRONG_TYPES[case]
    m = _manifest(vdir)
    edit(m)
    _write_manifest(vdir, m)
    with pytest.raises(he.CheckpointError, match=r"manifest.json is malformed; nothing was loaded:\n.*" + words):
        ckpt.read_manifest(path)
    _refused(path, words)


def test_a_truncated_manifest_and_a_latest_pointer_that_is_not_text(saved):
    path, vdir = saved
    data = (vdir / "manifest.json").read_bytes()
    (vdir / "manifest.json").write_bytes(data[: len(data) // 2])
    _refused(path, r"manifest.json is not valid JSON")
    (vdir / "manifest.json").write_bytes(data)
    (path / "LATEST").write_bytes(b"v-00\xff0001\n")
    _refused(path, r"LATEST is damaged: byte 4 is not text")
    model, opt = trained("adagrad", steps=1)
    he.save(path, model, opt)  # the next save replaces the damaged pointer
    he.load(path, *build())


@pytest.mark.parametrize("fails", ["torch.save", "rename"])
def test_a_write_failure_names_the_file_and_the_os_error(tmp_path, monkeypatch, fails):
    model, opt = trained("adagrad", steps=1)
    he.save(tmp_path / "c", model, opt)
    before = snapshot(model, opt)
    train(model, opt, range(1, 2))
    if fails == "torch.save":

        def full(obj, f, *a, **k):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(torch, "save", full)
        words = r"c/\.tmp-v-000002-\d+/tables/ec\.tag\.00000\.pt: No space left on device"
    else:

        def rename(src, dst):
            raise PermissionError(13, "Permission denied", str(src))

        monkeypatch.setattr(os, "rename", rename)
        words = r"c/\.tmp-v-000002-\d+: Permission denied"
    with pytest.raises(he.CheckpointError, match=r"cannot write the checkpoint .*" + words + r".*writable") as e:
        he.save(tmp_path / "c", model, opt)
    assert isinstance(e.value.__cause__, OSError)
    monkeypatch.undo()
    assert _versions(tmp_path / "c") == ["v-000001"]
    fresh, fresh_opt = build("adagrad")
    he.load(tmp_path / "c", fresh, fresh_opt)
    assert_identical(snapshot(fresh, fresh_opt), before)


# --- one writer per directory ---------------------------------------------------------------------------
def test_a_second_writer_is_refused_and_the_first_commits_its_rows(tmp_path, monkeypatch):
    """A save that published its version and is about to commit it holds the directory: another
    writer is refused and deletes nothing (it used to remove that version, reuse its name, and
    the first save committed the second's rows)."""
    path = tmp_path / "c"
    first, first_opt = trained("adagrad", steps=1)
    he.save(path, first, first_opt)  # v-000001
    train(first, first_opt, range(1, 2))
    expected = snapshot(first, first_opt)
    other, other_opt = trained("adagrad", steps=3)  # another writer's model: other rows
    reached, go = threading.Event(), threading.Event()
    real_commit = ck_layout._commit

    def slow_commit(root, version):  # the background save: v-000002 published, LATEST not yet replaced
        if threading.current_thread().name == "hybridembed-save":
            reached.set()
            go.wait(30)
        real_commit(root, version)

    monkeypatch.setattr(ck_layout, "_commit", slow_commit)
    handle = he.save(path, first, first_opt, background=True)
    try:
        assert reached.wait(30)
        assert (path / "v-000002").is_dir() and (path / "LATEST").read_text().strip() == "v-000001"
        who = rf"this process \(pid {os.getpid()}, host {re.escape(socket.gethostname())}\)"
        with pytest.raises(he.CheckpointError, match=rf"{who} is writing the checkpoint .*one writer at a time"):
            he.save(path, other, other_opt)
        assert sorted(p.name for p in path.iterdir()) == [".lock", "LATEST", "v-000001", "v-000002"]
    finally:
        go.set()
    assert handle.wait(30) == str(path / "v-000002")
    fresh, fresh_opt = build("adagrad")
    he.load(path, fresh, fresh_opt)
    assert_identical(snapshot(fresh, fresh_opt), expected)
    assert _versions(path) == ["v-000002"]  # the lock was released with the commit: no .lock left
    he.save(path, other, other_opt)  # and the next writer may write


def test_a_lock_held_by_another_process_refuses_writers_until_it_is_killed(tmp_path):
    """Released by the OS when its holder is killed, even while a child it forked (a data loader's
    worker, say) lives on."""
    path = tmp_path / "c"
    model, opt = trained("adagrad", steps=1)
    he.save(path, model, opt)
    code = f"""
import os, signal, sys, time
sys.path[:0] = [{HE_SRC!r}]
from pathlib import Path
from hybridembed import checkpoint as ckpt
from hybridembed.checkpoint import layout as ck_layout, lock as ck_lock, manifest as ck_manifest, snapshot as ck_snapshot
lock = ck_lock._lock(Path({str(path)!r}))
child = os.fork()
if child == 0:
    time.sleep(30)
    os._exit(0)
print("locked", child, flush=True)
sys.stdin.readline()
os.kill(os.getpid(), signal.SIGKILL)  # dies holding it: no release, no cleanup
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    child = None
    try:
        said = proc.stdout.readline().split()
        assert said[:1] == ["locked"]
        child = int(said[1])
        who = rf"another process \(pid {proc.pid}, host {re.escape(socket.gethostname())}\)"
        with pytest.raises(he.CheckpointError, match=rf"{who} is writing the checkpoint {re.escape(str(path))};"):
            he.save(path, model, opt)
        with pytest.raises(he.CheckpointError, match=who):
            ckpt.compact(path)
        fresh, fresh_opt = build("adagrad")
        he.load(path, fresh, fresh_opt)  # a load needs no lock
        assert_identical(snapshot(fresh, fresh_opt), snapshot(model, opt))
        assert _versions(path) == [".lock", "v-000001"]
        proc.stdin.write("die\n")
        proc.stdin.flush()
        assert proc.wait(30) == -signal.SIGKILL
        assert (path / ".lock").exists()  # left by the killed process, but no longer locked
        assert he.save(path, model, opt) == str(path / "v-000002")  # (its child still lives)
        assert _versions(path) == ["v-000002"]
    finally:
        proc.kill()
        proc.wait(30)
        if child is not None:
            os.kill(child, signal.SIGKILL)


def test_without_flock_the_lock_file_itself_is_the_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(ck_lock, "fcntl", None)  # as where flock is missing
    path = tmp_path / "c"
    path.mkdir()
    model, opt = trained("adagrad", steps=1)
    lock = ck_lock._lock(path)
    with pytest.raises(he.CheckpointError, match=r"this process \(pid \d+, .*one writer at a time"):
        he.save(path, model, opt)
    lock.release()
    he.save(path, model, opt)
    assert _versions(path) == ["v-000001"]
    # a file left by a dead process of this host is taken over; one of another host is not
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (path / ".lock").write_text(f"{int(dead.stdout)} {socket.gethostname()}\n")
    he.save(path, model, opt)
    (path / ".lock").write_text(f"{int(dead.stdout)} elsewhere\n")
    with pytest.raises(he.CheckpointError, match=r"another process \(pid \d+, host elsewhere\).*remove .*\.lock"):
        he.save(path, model, opt)
    assert _versions(path) == [".lock", "v-000002"]


def test_a_release_interrupted_after_closing_the_lock_can_be_repeated(tmp_path, monkeypatch):
    path = tmp_path / "c"
    path.mkdir()
    lock = ck_lock._lock(path)
    real_close = os.close

    def close_then_interrupt(fd):  # (Ctrl-C arriving right after the close returned)
        real_close(fd)
        raise KeyboardInterrupt

    monkeypatch.setattr(ck_lock.os, "close", close_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        lock.release()
    monkeypatch.setattr(ck_lock.os, "close", real_close)
    lock.release()  # (the cleanup's second release: nothing left to close, no EBADF)
    assert not (path / ".lock").exists()
    ck_lock._lock(path).release()  # (and the directory can be locked again)
