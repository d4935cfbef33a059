"""``hybridembed.storage.Storage``: the protocol both storages implement, and its row access
by range (dense) and by id (both), which checkpoints and resharding stand on.

python -m pytest -q tests/storage/test_protocol.py
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

import hybridembed as he
from hybridembed.storage import DenseStorage, HashStorage, Storage

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "hybridembed"

OPTIMIZERS = {  # state: none, per element, row-wise, two per element
    "sgd": lambda: he.optim.SGD(lr=0.1),
    "adagrad": lambda: he.optim.Adagrad(lr=0.1),
    "rowwise": lambda: he.optim.RowWiseAdagrad(lr=0.1),
    "adam": lambda: he.optim.Adam(lr=0.1),
}


def trained(opt: str, steps: int = 3, seed: int = 0) -> he.EmbeddingCollection:
    """Dense tables a (5 rows) and b (7 rows) in one storage, dynamic table d; trained so the
    rows and the optimizer state differ from their initial values."""
    o = OPTIMIZERS[opt]()
    ec = he.EmbeddingCollection(
        [
            he.TableConfig("a", 5, 4, optimizer=o),
            he.TableConfig("b", 7, 4, optimizer=o),
            he.TableConfig("d", None, 4, optimizer=o, dynamic=he.Dynamic(capacity=8)),
        ],
        seed=seed,
    )
    optim = he.wrap_optimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), ec)
    for i in range(steps):
        out = ec({"a": torch.tensor([0, 2 + i % 2]), "b": torch.tensor([1, 6]), "d": torch.tensor([40, -3 - i])})
        sum((v * torch.arange(1.0, 5.0)).sum() for v in out.values()).backward()
        optim.step()
        optim.zero_grad()
    return ec


def snapshot(st) -> dict[str, torch.Tensor]:
    return {"weight": st.weight.detach().clone(), **{k: v.clone() for k, v in st.state.items()}}


def assert_unchanged(st, before: dict[str, torch.Tensor]) -> None:
    after = snapshot(st)
    assert sorted(after) == sorted(before)
    for k in before:  # (a dynamic table's free slots hold whatever torch.empty gave: NaN equals NaN here)
        torch.testing.assert_close(after[k], before[k], rtol=0, atol=0, equal_nan=True, msg=k)


# --- the protocol -----------------------------------------------------------------------------
def _members() -> list[str]:
    return [n for n in vars(Storage) if not n.startswith("_")] + list(Storage.__annotations__)


@pytest.mark.parametrize("table", ["a", "d"])
def test_both_storages_satisfy_the_protocol(table):
    st = trained("adam").storage_of(table)
    assert isinstance(st, Storage)
    assert st.keyed == (table == "d") and st.kind == ("dynamic" if st.keyed else "dense")  # kind: manifest data
    for name in _members():  # every member, and every method with the protocol's parameters
        assert hasattr(st, name), name
        want = getattr(Storage, name, None)
        if inspect.isfunction(want):
            got = getattr(type(st), name)
            assert list(inspect.signature(got).parameters) == list(inspect.signature(want).parameters), name


def test_an_object_without_the_methods_is_not_a_storage():
    assert not isinstance(torch.nn.Linear(2, 2), Storage)
    assert {"resolve", "read_range", "write_range", "read_ids", "write_ids", "stats"} <= set(_members())


@pytest.mark.parametrize("table", ["b", "d"])
def test_resolve_then_read_rows_is_the_lookup(table):
    ec = trained("sgd").eval()
    st = ec.storage_of(table)
    ids = torch.tensor([3, 0, 3]) if table == "b" else torch.tensor([40, -3, 999])  # 999: never seen
    plan = st.resolve(ids + st.row_offset[table], [st.table_index[table]], [3], train=False)
    slots, _ = plan.commit()
    want = ec({"a": torch.tensor([0]), "b": ids if table == "b" else torch.tensor([0]), "d": ids})
    assert torch.equal(st.read_rows(slots), want[table] if table == "b" else ec.lookup("d", ids))


# --- dense: rows and columns by range ---------------------------------------------------------
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_read_range_is_the_rows_and_their_optimizer_state(opt):
    st = trained(opt).storage_of("b")
    got = st.read_range("b", 2, 6, col_start=1, col_stop=3)
    start = st.row_offset["b"]  # 5: b sits after a in the group
    assert sorted(got) == sorted(["weight", *st.state])
    assert torch.equal(got["weight"], st.weight.detach()[start + 2 : start + 6, 1:3])
    for k, v in st.state.items():
        want = v[start + 2 : start + 6, 1:3] if v.dim() == 2 else v[start + 2 : start + 6]  # row-wise: per row
        assert torch.equal(got[k], want), k
    if opt != "sgd":
        assert any(bool((v != v.flatten()[0]).any()) for v in st.state.values())  # trained: not all initial
    got["weight"].zero_()  # copies, not views
    assert not torch.equal(st.read_range("b", 2, 6, 1, 3)["weight"], got["weight"])


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_write_range_round_trips_and_changes_only_that_range(opt):
    src, dst = trained(opt, seed=0).storage_of("b"), trained(opt, steps=1, seed=5).storage_of("b")
    before = snapshot(dst)
    piece = src.read_range("b", 1, 4, col_start=2)  # rows 1..3, columns 2..3
    dst.write_range("b", 1, piece, col_start=2)
    assert all(torch.equal(v, piece[k]) for k, v in dst.read_range("b", 1, 4, col_start=2).items())
    after = snapshot(dst)
    rows = slice(dst.row_offset["b"] + 1, dst.row_offset["b"] + 4)
    for k, v in after.items():  # outside the block: exactly as before
        outside = torch.ones_like(v, dtype=torch.bool)
        if v.dim() == 2:
            outside[rows, 2:] = False
        else:
            outside[rows] = False
        assert torch.equal(v[outside], before[k][outside]), k
    # the whole table: read_range of all rows and columns, written back into a third storage
    third = trained(opt, steps=2, seed=7).storage_of("b")
    third.write_range("b", 0, src.read_range("b", 0, 7))
    assert all(torch.equal(v, src.read_range("b", 0, 7)[k]) for k, v in third.read_range("b", 0, 7).items())


def test_write_range_takes_any_subset_of_the_keys():
    st = trained("adam").storage_of("a")
    before = snapshot(st)
    st.write_range("a", 4, {"exp_avg": torch.full((1, 2), 7.0)}, col_start=1)
    assert torch.equal(st.state["exp_avg"][4, 1:3], torch.full((2,), 7.0))
    assert torch.equal(st.weight.detach(), before["weight"])
    assert torch.equal(st.state["exp_avg_sq"], before["exp_avg_sq"])
    before = snapshot(st)
    with pytest.raises(he.HybridEmbedError, match="'exp_avg_sq' has 3 columns, expected 2"):
        st.write_range("a", 0, {"weight": torch.ones(2, 2), "exp_avg_sq": torch.ones(2, 3)})
    assert_unchanged(st, before)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda st: st.read_range("b", 5, 8), r"rows \[5, 8\) are outside the table's rows \[0, 7\)"),
        (lambda st: st.read_range("b", -1, 2), r"rows \[-1, 2\)"),
        (lambda st: st.read_range("b", 3, 2), r"rows \[3, 2\)"),
        (lambda st: st.read_range("b", 0, 2, 3, 5), r"columns \[3, 5\) are outside the table's columns \[0, 4\)"),
        (lambda st: st.read_range("b", 0, 2.5), "bounds must be ints"),
        (lambda st: st.read_range("zz", 0, 1), r"table 'zz' is not in this storage; it holds: a, b"),
        (lambda st: st.write_range("b", 5, {"weight": torch.ones(3, 4)}), r"rows \[5, 8\) are outside"),
        (lambda st: st.write_range("b", 0, {"weight": torch.ones(2, 3)}, col_start=2), r"columns \[2, 5\)"),
        (lambda st: st.write_range("b", -1, {"weight": torch.ones(1, 4)}), r"rows \[-1, 0\)"),
        (lambda st: st.write_range("b", 0, {"weight": torch.ones(2, 4), "sum": torch.ones(3)}), "3 rows"),
        (lambda st: st.write_range("b", 0, {"sum": torch.ones(2, 4)}), r"'sum' must be \(K,\)"),
        (lambda st: st.write_range("b", 0, {"momentum": torch.ones(2)}), "allowed keys: weight, sum"),
        (lambda st: st.write_range("b", 0, {"weight": torch.ones(2, 4, dtype=torch.int64)}), "floating point"),
        (lambda st: st.write_range("b", 0, {}), "nothing to write"),
        (lambda st: st.write_ids("b", torch.tensor([1, 7]), torch.ones(2, 4)), r"id 7 is outside the table's rows"),
        (lambda st: st.write_ids("b", torch.tensor([1, 1]), torch.ones(2, 4)), "more than once"),
        (lambda st: st.write_ids("b", torch.tensor([1, 2]), torch.ones(3, 4)), "2 ids but 3 rows"),
    ],
)
def test_bad_ranges_and_data_are_refused_before_any_change(call, match):
    st = trained("rowwise").storage_of("b")  # state "sum" is row-wise: (R,)
    before = snapshot(st)
    with pytest.raises(he.HybridEmbedError, match=match):
        call(st)
    assert_unchanged(st, before)


def test_dense_read_ids_and_write_ids_are_the_rows_by_number():
    src, dst = trained("adagrad").storage_of("b"), trained("adagrad", steps=1, seed=3).storage_of("b")
    ids, rows, state = src.read_ids("b")
    assert torch.equal(ids, torch.arange(7)) and torch.equal(rows, src.table_rows("b"))
    pick = torch.tensor([5, 0])
    dst.write_ids("b", pick, rows[pick], {k: v[pick] for k, v in state.items()})
    _, got, got_state = dst.read_ids("b")
    assert torch.equal(got[pick], rows[pick]) and torch.equal(got_state["sum"][pick], state["sum"][pick])
    assert src.table_ids("b") is None


# --- dynamic: rows by id ------------------------------------------------------------------------
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_dynamic_read_ids_write_ids_round_trip(opt):
    a, b = trained(opt), trained(opt, steps=1, seed=4)
    src, dst = a.storage_of("d"), b.storage_of("d")
    ids, rows, state = src.read_ids("d")
    assert torch.equal(ids, torch.tensor([-5, -4, -3, 40])) and torch.equal(ids, src.table_ids("d"))
    assert rows.shape == (4, 4) and all(v.shape[0] == 4 for v in state.values())
    inserted = dst.table_stats("d")["inserted"]
    dst.write_ids("d", ids, rows, state)  # -5 and -4 are new to dst; -3 and 40 are overwritten
    got_ids, got_rows, got_state = dst.read_ids("d")
    assert torch.equal(got_ids, ids) and torch.equal(got_rows, rows)
    assert sorted(got_state) == sorted(state) and all(torch.equal(got_state[k], v) for k, v in state.items())
    assert dst.stats("d")["rows"] == 4 and dst.table_stats("d")["inserted"] == inserted  # not a lookup
    assert torch.equal(b.eval().lookup("d", ids), a.eval().lookup("d", ids))  # lookups find the written rows


def test_dynamic_write_ids_keeps_other_rows_and_refuses_what_does_not_fit():
    st = trained("adam").storage_of("d")  # capacity 8, 4 rows held
    ids, rows, state = st.read_ids("d")
    st.write_ids("d", torch.tensor([100]), torch.full((1, 4), 2.0))  # rows only: its state starts initial
    got_ids, got_rows, got_state = st.read_ids("d")
    assert torch.equal(got_ids, torch.tensor([-5, -4, -3, 40, 100]))
    assert torch.equal(got_rows[:4], rows) and torch.equal(got_rows[4], torch.full((4,), 2.0))
    assert all(torch.equal(got_state[k][:4], v) and not got_state[k][4].any() for k, v in state.items())
    before = snapshot(st)
    with pytest.raises(he.HybridEmbedError, match="4 new ids do not fit: 5 of its 8 rows are in use"):
        st.write_ids("d", torch.tensor([1, 2, 3, 40, 4]), torch.zeros(5, 4))
    with pytest.raises(he.HybridEmbedError, match="allowed keys: weight, exp_avg, exp_avg_sq"):
        st.write_ids("d", torch.tensor([1]), torch.zeros(1, 4), {"sum": torch.zeros(1, 4)})
    with pytest.raises(he.HybridEmbedError, match="read them with read_ids"):
        st.read_range("d", 0, 1)
    with pytest.raises(he.HybridEmbedError, match="write them with write_ids"):
        st.write_range("d", 0, {"weight": torch.zeros(1, 4)})
    assert_unchanged(st, before)
    assert torch.equal(st.table_ids("d"), got_ids)


def test_stats_of_a_table_and_of_the_storage():
    ec = trained("rowwise")
    dense, dyn = ec.storage_of("a"), ec.storage_of("d")
    row = 4 * 4 + 4  # 4 float32 columns + the row-wise state
    assert dense.stats("b") == {"rows": 7, "memory_bytes": 7 * row}
    assert dense.stats() == {"rows": 12, "memory_bytes": dense.memory_bytes} and dense.memory_bytes == 12 * row
    s = dyn.stats("d")
    assert s["rows"] == s["size"] == 4 and s["memory_bytes"] == 4 * row and s["capacity"] == 8
    assert dyn.stats()["lookups"] == s["lookups"] == 6 and dyn.stats()["memory_bytes"] == dyn.memory_bytes


# --- no kind strings outside the storages ---------------------------------------------------------
_KIND_BRANCH = re.compile(
    r"""\.kind\s*(?:[!=]=|(?:not\s+)?in)\s*[("'\[]*\s*["'](?:dense|dynamic)["']"""
    r"""|["'](?:dense|dynamic)["']\s*[!=]=\s*[\w.\[\]"']*\.kind\b"""
)


def test_no_module_outside_storage_branches_on_the_storage_kind():
    assert _KIND_BRANCH.search('if st.kind == "dense":') and _KIND_BRANCH.search("x = 'dynamic' != t.kind")
    assert _KIND_BRANCH.search('if t.kind in ("dense", "x"):') and not _KIND_BRANCH.search('if s.get("kind") == y:')
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if (SRC / "storage") in path.parents:
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if _KIND_BRANCH.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "branch on storage.keyed or a Storage method, not the kind string:\n" + "\n".join(found)


def test_the_classes_are_the_storages_of_a_collection():
    ec = trained("sgd")
    assert type(ec.storage_of("a")) is DenseStorage and type(ec.storage_of("d")) is HashStorage
