"""The CPU assembly's one Numba pass (kernels.cpu_assemble) against the joined tensors made with torch ops."""

from __future__ import annotations

import pytest
import torch

import hybridembed as he
from hybridembed.kernels import cpu_assemble, cpu_fused

pytestmark = pytest.mark.skipif(not cpu_fused.available(), reason="needs Numba")


def reference(jagged, shifts, seq):
    """(ids, offsets, every bag one id) by torch ops, sequence features' ids each a bag."""
    ids, offsets, base = [], [], 0
    for j, k, q in zip(jagged, shifts, seq):
        ids.append(j.values.to(torch.int64) + k)
        c = j.values.numel()
        offsets.append(torch.arange(base, base + c) if q else j.offsets[:-1].to(torch.int64) + base)
        base += c
    offsets = torch.cat(offsets + [torch.tensor([base])])
    return torch.cat(ids), offsets, bool((offsets.diff() == 1).all())


def features(g, kinds):
    """Features of random bags: ``one`` (one id a bag), ``bags`` (0..4 ids), ``seq`` (a sequence feature)."""
    out = []
    for kind in kinds:
        b = int(torch.randint(0, 40, (), generator=g))
        lengths = torch.ones(b, dtype=torch.int64) if kind == "one" else torch.randint(0, 5, (b,), generator=g)
        out.append(he.Jagged.from_lengths(torch.randint(0, 100, (int(lengths.sum()),), generator=g), lengths))
    return out


@pytest.mark.parametrize("per_thread", [1 << 18, 8])  # (one thread; the features split between threads)
@pytest.mark.parametrize("kinds", [["one"] * 5, ["bags", "one", "seq", "bags"], ["one", "one", "one", "bags"]])
def test_the_features_are_joined_as_the_torch_ops_join_them(monkeypatch, per_thread, kinds):
    monkeypatch.setattr(cpu_assemble, "_MIN_IDS_PER_THREAD", per_thread)
    g = torch.Generator().manual_seed(len(kinds) + per_thread)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for _ in range(5):
            jagged = features(g, kinds)
            jagged[0] = he.Jagged(jagged[0].values.to(torch.int32), jagged[0].offsets.to(torch.int32))  # (widened)
            seq = [k == "seq" for k in kinds]
            shifts = [100 * i for i in range(len(kinds))]
            ids, offsets, one = reference(jagged, shifts, seq)
            n = ids.numel()
            s = sum(j.values.numel() if q else j.offsets.numel() - 1 for j, q in zip(jagged, seq))
            got = cpu_assemble.assemble(jagged, shifts, [100] * len(kinds), seq, n, s)
            assert got is not None and got[2] and got[3] == one
            assert torch.equal(got[0], ids)
            assert (got[1] is None) if one else torch.equal(got[1], offsets)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    "spoil",
    ["id below 0", "id past the rows", "first offset", "last offset", "decreasing", "decreasing in a sequence"],
)
def test_each_bad_input_fails_the_checks(spoil):
    g = torch.Generator().manual_seed(0)
    jagged = features(g, ["bags", "one", "seq"])
    while min(j.values.numel() for j in jagged) < 3:
        jagged = features(g, ["bags", "one", "seq"])
    seq, rows = [False, False, True], [100, 100, -1]
    which = 2 if spoil.endswith("sequence") else 0
    v, o = jagged[which].values.clone(), jagged[which].offsets.clone()
    if spoil == "id below 0":
        v[1] = -1
    elif spoil == "id past the rows":
        v[-1] = 100
    elif spoil == "first offset":
        o[0] = 1
    elif spoil == "last offset":
        o[-1] -= 1
    else:  # (the offsets go down and up again: first and last still right)
        o[1], o[2] = o[2] + 1, o[2]
    jagged[which] = _Unchecked(v, o)
    n = sum(j.values.numel() for j in jagged)
    s = sum(j.values.numel() if q else j.offsets.numel() - 1 for j, q in zip(jagged, seq))
    got = cpu_assemble.assemble(jagged, [0, 100, 200], rows, seq, n, s)
    assert got is not None and got[2] is False
    # a dynamic table's negative ids are its own (no bounds)
    if spoil == "id below 0":
        assert cpu_assemble.assemble(jagged, [0, 100, 200], [-1, 100, -1], seq, n, s)[2] is True


class _Unchecked:
    """A Jagged's two tensors, as the collection hands them over, without the structure checks."""

    def __init__(self, values, offsets):
        self.values, self.offsets = values, offsets
