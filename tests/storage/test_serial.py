"""``hybridembed.storage.serial``: one (de)serialisation of a table for state dicts and checkpoints.

python -m pytest -q tests/storage/test_serial.py
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridembed as he
from hybridembed.storage import serial


def collection(capacity: int | None = None, steps: int = 3) -> he.EmbeddingCollection:
    dyn = he.Dynamic(min_count=2, sketch_width=32, capacity=capacity)
    ec = he.EmbeddingCollection([he.TableConfig("a", 6, 3), he.TableConfig("b", None, 3, dynamic=dyn)], seed=1)
    for _ in range(steps):  # ids seen twice get rows
        ec({"a": torch.tensor([[1, 2]]), "b": torch.tensor([[5, 7, 9]])})
    return ec


def test_entries_round_trip_through_check_and_load():
    src, dst = (
        collection(),
        he.EmbeddingCollection(
            [he.TableConfig("a", 6, 3), he.TableConfig("b", None, 3, dynamic=he.Dynamic(min_count=2, sketch_width=32))],
            seed=9,
        ),
    )
    for name in ("a", "b"):
        entry = serial.table_entry(src.storage_of(name), name)
        assert serial.check_entry(dst.storage_of(name), name, entry) == ([], [])
        serial.load_entry(dst.storage_of(name), name, entry)
    assert torch.equal(dst.weight("a"), src.weight("a"))
    assert all(torch.equal(x, y) for x, y in zip(dst.dynamic_rows("b"), src.dynamic_rows("b")))
    assert sorted(serial.table_entry(src.storage_of("b"), "b")) == sorted([*serial.DYNAMIC_KEYS, "generator", "sketch"])


BAD = {
    "missing": (lambda e: e.pop("freq"), None),
    "freq": (lambda e: e.__setitem__("freq", e["freq"][:-1]), r"b\.freq: expected \(3,\) integers"),
    "ids-float": (lambda e: e.__setitem__("ids", e["ids"].double()), r"b\.ids: expected \(K,\) integer ids"),
    "duplicate-ids": (lambda e: e.__setitem__("ids", torch.tensor([5, 5, 7])), r"b\.ids: an id appears more than once"),
    "stats": (lambda e: e.__setitem__("stats", e["stats"][:2]), r"b\.stats: expected"),
    "clock": (lambda e: e.__setitem__("clock", torch.zeros(2, dtype=torch.int64)), r"b\.clock: expected one integer"),
    "sketch": (lambda e: e.__setitem__("sketch", torch.zeros(4, 64, dtype=torch.int32)), r"sketch_width=32"),
    "generator": (lambda e: e.__setitem__("generator", torch.zeros(3, dtype=torch.uint8)), r"b\.generator: not a"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_dynamic_entry_is_refused_by_load_state_dict_and_nothing_changes(case):
    edit, words = BAD[case]
    sd = collection().state_dict()
    entry = {k[2:]: v for k, v in sd.items() if k.startswith("b.")}
    edit(entry)
    sd = {**{k: v for k, v in sd.items() if not k.startswith("b.")}, **{"b." + k: v for k, v in entry.items()}}
    sd["a.weight"] = torch.full((6, 3), 7.0)  # a good entry beside the bad one: not loaded either
    ec = collection()
    before = {k: v.clone() for k, v in ec.state_dict().items()}
    with pytest.raises(RuntimeError, match=words or r"Missing key\(s\) in state_dict: \"b\.freq\""):
        ec.load_state_dict(sd)
    if words is not None:  # (a missing key is torch's strict error after loading the rest)
        after = ec.state_dict()
        assert all(torch.equal(after[k], before[k]) for k in before)


def test_a_dynamic_entry_over_capacity_is_an_error_not_a_crash():
    sd = collection().state_dict()
    ec = collection(capacity=2, steps=0)
    before = {k: v.clone() for k, v in ec.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"b\.ids: 3 rows do not fit the table's capacity 2"):
        ec.load_state_dict(sd)
    after = ec.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_a_converted_dynamic_layer_reports_a_bad_entry_under_its_path():
    model = he.convert(nn.Sequential(nn.Embedding(10, 3)), tables={"0": {"dynamic": he.Dynamic()}})
    model(torch.tensor([1, 2, 3]))
    sd = model.state_dict()
    sd["0.last_seen"] = sd["0.last_seen"][:1]
    with pytest.raises(RuntimeError, match=r"0\.last_seen: expected \(3,\) integers"):
        model.load_state_dict(sd)
