"""Dynamic tables at their edges: the whole int64 id range, string ids, eval mode, input
errors, and a save/load round trip resumed in a fresh process."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hybridembed as he
from tests import warm

DIM = 3
SEED = 5
ROOT = Path(__file__).resolve().parents[2]
I64_MIN, I64_MAX = -(2**63), 2**63 - 1


def make(dynamic=None, combiner="sum", name="a"):
    dynamic = dynamic if dynamic is not None else he.Dynamic()
    return he.EmbeddingCollection([he.TableConfig(name, None, DIM, combiner=combiner, dynamic=dynamic)], seed=SEED)


def init_rows(ids, name="a"):
    """Row-keyed initial values (the default initializer, uniform(-0.05, 0.05))."""
    return he.init.generate(he.init.uniform(), SEED, name, torch.tensor(ids, dtype=torch.int64), DIM)


def rows_by_id(ec, name="a"):
    ids, rows = ec.dynamic_rows(name)
    return {i: r for i, r in zip(ids.tolist(), rows)}


# --- the id range ------------------------------------------------------------------------------
def test_ids_across_the_whole_int64_range_each_get_their_own_row():
    ec = make()
    opt = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.5), ec)
    extreme = [I64_MIN, I64_MAX, -1, -5, 0, 2**32, 2**62, I64_MIN + 1]
    j = he.Jagged.from_lists([[i] for i in extreme])  # -1 is an id here, not padding
    target = torch.arange(len(extreme) * DIM, dtype=torch.float32).reshape(len(extreme), DIM)
    out = ec({"a": j})["a"]
    assert torch.equal(out, init_rows(extreme))
    assert len({tuple(r.tolist()) for r in out}) == len(extreme)  # all distinct rows
    (out * target).sum().backward()
    opt.step()
    got = rows_by_id(ec)
    assert sorted(got) == sorted(extreme)
    for k, i in enumerate(extreme):
        assert torch.equal(got[i], init_rows([i])[0] - 0.5 * target[k]), i
    # the same ids again, as a padded 2-D tensor (where -1 is padding), hit the same rows
    padded = torch.tensor([[I64_MIN, -1], [I64_MAX, -5]])
    out = ec({"a": padded})["a"]
    assert torch.equal(out[0], got[I64_MIN])
    assert torch.equal(out[1], got[I64_MAX] + got[-5])
    stats = ec.dynamic_stats()["a"]
    assert stats["size"] == len(extreme) and stats["hits"] == 3 and stats["inserted"] == len(extreme)


def test_dense_table_still_rejects_negative_ids_and_dynamic_accepts_them():
    ec = he.EmbeddingCollection(
        [he.TableConfig("dense", 10, DIM), he.TableConfig("dyn", None, DIM, dynamic=he.Dynamic())],
        features={"fd": "dense", "fy": "dyn"},
    )
    with pytest.raises(he.InvalidInputError, match="fd") as e:
        ec({"fd": he.Jagged.from_lists([[1, -3]]), "fy": he.Jagged.from_lists([[-3]])})
    assert e.value.feature == "fd" and e.value.position == 1
    assert ec.dynamic_rows("dyn")[0].numel() == 0  # refused before any row was made
    out = ec({"fd": he.Jagged.from_lists([[1]]), "fy": he.Jagged.from_lists([[-3]])})
    assert torch.equal(out["fy"][0], he.init.generate(he.init.uniform(), 0, "dyn", torch.tensor([-3]), DIM)[0])


BAD_INPUTS = [
    pytest.param(torch.tensor([1.0, 2.0]), "integer", id="float-tensor"),
    pytest.param(he.Jagged(torch.tensor([1.0, 2.0]), torch.tensor([0, 2])), "integer", id="float-jagged"),
    pytest.param(he.Jagged(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1, 3])), "non-decreasing", id="offsets-dec"),
    pytest.param(he.Jagged(torch.tensor([1, 2, 3]), torch.tensor([1, 3])), r"offsets\[0\]", id="offsets-start"),
    pytest.param(he.Jagged(torch.tensor([1, 2, 3]), torch.tensor([0, 2])), r"offsets\[-1\]", id="offsets-end"),
    pytest.param(he.Jagged(torch.tensor([1, 2]), torch.tensor([[0, 2]])), "offsets", id="offsets-2d"),
]


@pytest.mark.parametrize("bad,words", BAD_INPUTS)
def test_malformed_input_to_a_dynamic_table_names_the_feature_and_touches_nothing(bad, words):
    ec = he.EmbeddingCollection(
        [he.TableConfig("t", None, DIM, dynamic=he.Dynamic(capacity=8))], features={"good": "t", "clicks": "t"}
    )
    ec({"good": torch.tensor([1]), "clicks": torch.tensor([2])})
    before = ec.dynamic_stats()["t"]
    with pytest.raises(he.InvalidInputError, match=words) as e:
        ec({"good": torch.tensor([7]), "clicks": bad})
    assert e.value.feature == "clicks" and "clicks" in str(e.value)
    assert ec.dynamic_rows("t")[0].tolist() == [1, 2]  # 7 got no row: refused before any lookup
    assert ec.dynamic_stats()["t"] == before


# --- string ids ----------------------------------------------------------------------------------
def _blake2b_int64(text):  # the documented hash, written independently
    v = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")
    return v - 2**64 if v >= 2**63 else v


def test_string_ids_are_hashed_stably_to_the_same_rows():
    words = ["fr", "de", "abc", "", "日本"]
    assert [he.init.stable_hash64(w) for w in words] == [_blake2b_int64(w) for w in words]
    ec = make()
    out = ec({"a": [["fr", "de"], ["fr"], ["abc", "abc"]]})["a"]
    h = {w: he.init.stable_hash64(w) for w in words}
    init = dict(zip(words, init_rows([h[w] for w in words])))
    assert torch.equal(out[1], init["fr"])
    assert torch.equal(out[0], init["fr"] + init["de"])
    assert torch.equal(out[2], init["abc"] + init["abc"])
    assert ec.dynamic_rows("a")[0].tolist() == sorted([h["fr"], h["de"], h["abc"]])
    out2 = ec({"a": he.Jagged.from_lists([["de"], ["abc"]])})["a"]  # the same strings, the same rows
    assert torch.equal(out2[0], init["de"]) and torch.equal(out2[1], init["abc"])
    stats = ec.dynamic_stats()["a"]
    assert stats["size"] == 3 and stats["hits"] == 2


def test_stable_hash64_is_the_same_in_a_fresh_process():
    code = "import hybridembed.init as i; print(i.stable_hash64('abc'), i.stable_hash64('user:42'))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [str(he.init.stable_hash64("abc")), str(he.init.stable_hash64("user:42"))]
    assert he.init.stable_hash64("abc") == _blake2b_int64("abc")


# --- eval mode -------------------------------------------------------------------------------------
def test_eval_reads_known_rows_and_the_default_for_unknown_ids_without_making_rows():
    ec = make(he.Dynamic(default_value=0.25), combiner="mean")
    opt = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec)
    out = ec({"a": torch.tensor([[1, 2], [3, -1]])})["a"]
    out.sum().backward()
    opt.step()
    opt.zero_grad()
    known = rows_by_id(ec)
    stats = ec.dynamic_stats()["a"]
    ec.eval()
    default = torch.full((DIM,), 0.25)
    out = ec({"a": torch.tensor([[1, 50], [2, 3], [60, 70]])})["a"]
    assert torch.equal(out[0], (known[1] + default) / 2)
    assert torch.equal(out[1], (known[2] + known[3]) / 2)
    assert torch.equal(out[2], default)
    with torch.no_grad():
        ec({"a": torch.tensor([80])})
    assert sorted(rows_by_id(ec)) == [1, 2, 3]
    assert ec.dynamic_stats()["a"] == stats
    ec.train()
    ec({"a": torch.tensor([50])})
    assert sorted(rows_by_id(ec)) == [1, 2, 3, 50]


# --- save / load ------------------------------------------------------------------------------------
def test_a_checkpoint_that_does_not_fit_is_refused_and_the_table_keeps_its_rows():
    """A checkpoint is all or nothing."""
    big = make(he.Dynamic(capacity=8))
    big({"a": torch.arange(6)})
    small = make(he.Dynamic(capacity=4))
    small({"a": torch.tensor([100, 101])})
    ids, rows = small.dynamic_rows("a")
    with pytest.raises((he.HybridEmbedError, RuntimeError), match="capacity"):
        small.load_state_dict(big.state_dict())
    got_ids, got_rows = small.dynamic_rows("a")
    assert got_ids.tolist() == ids.tolist() and torch.equal(got_rows, rows)


def test_state_dict_round_trip_in_process_restores_rows_and_counters():
    ec = make(he.Dynamic(capacity=6, min_count=2, evict_fraction=0.5))
    for s in range(5):
        ec({"a": torch.tensor([s, s, s + 1, 10 + s])})
    assert 12 not in ec.dynamic_rows("a")[0].tolist()
    sd = ec.state_dict()
    assert sorted(k.split(".", 1)[1] for k in sd) == sorted(
        ["ids", "weight", "last_seen", "freq", "stats", "clock", "sketch", "generator"]
    )
    fresh = make(he.Dynamic(capacity=6, min_count=2, evict_fraction=0.5))
    fresh.load_state_dict(sd)
    _assert_identical(fresh.state_dict(), sd)
    assert fresh.dynamic_stats() == ec.dynamic_stats()
    # the sketch came along: 12 was seen once before saving, so one more sighting admits it
    fresh({"a": torch.tensor([12])})
    assert 12 in fresh.dynamic_rows("a")[0].tolist()


# --- save / load, resumed in a fresh process ---------------------------------------------------------
RESUME_STEPS = 4


def _build(admit_probability):
    dyn = he.Dynamic(capacity=9, min_count=2, evict_fraction=0.25, admit_probability=admit_probability)
    tables = [
        he.TableConfig("u", None, 4, dynamic=dyn),
        he.TableConfig("v", None, 4, combiner="mean", dynamic=dyn),
        he.TableConfig("w", None, 2, dynamic=dyn),
        he.TableConfig("d", 30, 4),
    ]
    ec = he.EmbeddingCollection(tables, features={"u1": "u", "u2": "u", "v": "v", "w": "w", "d": "d"}, seed=11)
    opt = he.wrap_optimizer(torch.optim.Adagrad(ec.parameters(), lr=0.3, lr_decay=0.05), ec)
    return ec, opt


def _batch(step):
    """Fixed batches: ids from a window that slides with the step, so rows are admitted,
    hit and evicted all along; each id appears once or twice per batch."""
    g = torch.Generator().manual_seed(1000 + step)
    inputs, targets = {}, {}
    for f, dim in (("u1", 4), ("u2", 4), ("v", 4), ("w", 2), ("d", 4)):
        hi = 30 if f == "d" else 6 + 3 * step
        lo = 0 if f == "d" else 3 * step
        inputs[f] = torch.randint(lo, hi, (4, 3), generator=g)
        inputs[f][0, 2] = -1  # some padding
        targets[f] = torch.randn(4, dim, generator=g)
    return inputs, targets


def _train(ec, opt, steps):
    outs = []
    for s in steps:
        inputs, targets = _batch(s)
        opt.zero_grad()
        out = ec(inputs)
        sum(((out[f] - targets[f]) ** 2).sum() for f in sorted(out)).backward()
        opt.step()
        outs.append({f: v.detach().clone() for f, v in out.items()})
    return outs


def _result(ec, opt, outs):
    return {"outs": outs, "model": ec.state_dict(), "opt": opt.state_dict()["sparse"]}


def _resume(admit_probability, ckpt, out_path):
    """Run in the fresh process: load the checkpoint into a new model and keep training."""
    torch.set_num_threads(1)  # as the test process (conftest.py)
    ec, opt = _build(admit_probability)
    state = torch.load(ckpt, weights_only=False)
    ec.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    outs = _train(ec, opt, range(state["next_step"], state["next_step"] + RESUME_STEPS))
    torch.save(_result(ec, opt, outs), out_path)


def _assert_identical(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert sorted(a) == sorted(b), where
        for k in a:
            _assert_identical(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for k, (x, y) in enumerate(zip(a, b)):
            _assert_identical(x, y, f"{where}[{k}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("admit_probability", [1.0, 0.7])
def test_save_load_in_a_fresh_process_resumes_bit_identically(tmp_path, admit_probability):
    ec, opt = _build(admit_probability)
    first = 6
    _train(ec, opt, range(first))
    stats = ec.dynamic_stats()
    assert all(stats[t]["evicted"] > 0 and stats[t]["rejected"] > 0 for t in ("u", "v", "w"))  # both matter
    ckpt, out_path = tmp_path / "ckpt.pt", tmp_path / "resumed.pt"
    torch.save({"model": ec.state_dict(), "opt": opt.state_dict(), "next_step": first}, ckpt)
    assert "u.sketch" in ec.state_dict()
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
        "from tests.storage.test_dynamic_io import _resume; "
        f"_resume({admit_probability!r}, {str(ckpt)!r}, {str(out_path)!r})"
    )
    (tmp_path / "resume.py").write_text(code)
    proc = warm.Script(tmp_path / "resume.py", [], dict(os.environ), tmp_path / "out", tmp_path / "err", cwd=ROOT)
    outs = _train(ec, opt, range(first, first + RESUME_STEPS))  # meanwhile, the original keeps going
    here = _result(ec, opt, outs)
    assert proc.wait(300) == 0, (tmp_path / "err").read_text()
    there = torch.load(out_path, weights_only=False)
    after = ec.dynamic_stats()
    assert all(after[t]["evicted"] > stats[t]["evicted"] for t in ("u", "v", "w"))  # eviction after resuming
    assert all(after[t]["inserted"] > stats[t]["inserted"] for t in ("u", "v", "w"))
    for s, (a, b) in enumerate(zip(here["outs"], there["outs"])):
        for f in a:
            assert torch.equal(a[f], b[f]), f"resumed step {s}: output of feature {f} differs"
    _assert_identical(here["model"], there["model"], "model")
    _assert_identical(here["opt"], there["opt"], "opt")
