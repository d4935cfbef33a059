"""The ways a group's batch is assembled (one Numba pass on the CPU; per feature, or per group for small
batches) agree."""

from __future__ import annotations

import pytest
import torch

import hybridembed as he
from hybridembed.kernels import cpu_assemble, cpu_fused
from hybridembed.modules import assemble


def make(seed: int):
    tables = [
        he.TableConfig("a", 30, 4, combiner="mean"),
        he.TableConfig("b", 20, 4),
        he.TableConfig("c", 10, 4, combiner="sqrtn"),
        he.TableConfig("d", None, 4, dynamic=he.Dynamic()),
        he.TableConfig("e", None, 4, dynamic=he.Dynamic()),
    ]
    return he.EmbeddingCollection(
        tables, features={"a": "a", "b": "b", "b2": "b", "c": "c", "d": "d", "e": "e"}, seed=seed
    )


def inputs(seed: int, hotness: int | None = None):
    """Random bags of 0..3 ids, or with ``hotness`` every bag that many ids (the per-group path's (F, c) views)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for f, rows in (("a", 30), ("b", 20), ("b2", 20), ("c", 10), ("d", 1000), ("e", 50)):
        lengths = torch.randint(0, 4, (6,), generator=g) if hotness is None else torch.full((6,), hotness)
        ids = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
        w = torch.rand(ids.numel(), generator=g) if f in ("a", "c") else None
        out[f] = he.Jagged.from_lengths(ids.to(torch.int32 if f == "b" else torch.int64), lengths, w)
    return out


@pytest.mark.parametrize("hotness", [None, 1, 3])
@pytest.mark.parametrize("seed", range(3))
def test_small_and_large_assembly_give_the_same_outputs_gradients_and_errors(monkeypatch, seed, hotness):
    results = []
    numba = cpu_assemble.assemble
    calls = []
    for threshold in (None, 0, 1 << 30):  # one Numba pass / every group per feature / every group per group
        way = (lambda *a: calls.append(r := numba(*a)) or r) if threshold is None else (lambda *a: None)
        monkeypatch.setattr(cpu_assemble, "assemble", way)
        monkeypatch.setattr(assemble, "SMALL_PER_FEATURE", threshold or 0)
        ec = make(seed)
        out = ec(inputs(seed, hotness))
        sum(v.sum() for v in out.values()).backward()
        grads = [s.weight.grad.coalesce().to_dense() for s in ec.storages]
        bad = inputs(seed + 100, hotness)
        bad["b2"].values[-1:] = 20  # out of range
        with pytest.raises(he.InvalidInputError) as err:
            ec(bad)
        results.append((out, grads, str(err.value)))
    assert calls and all(c is not None for c in calls) == cpu_fused.available()  # (the Numba pass ran)
    (o1, g1, e1), *others = results
    for o2, g2, e2 in others:
        for k in o1:
            torch.testing.assert_close(o1[k], o2[k], rtol=0, atol=0)
        for a, b in zip(g1, g2):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert e1 == e2 and "b2" in e1


@pytest.mark.parametrize("hotness", [None, 1, 3])
@pytest.mark.parametrize("seed", range(3))
def test_single_feature_paths_equal_the_grouped_forward(seed, hotness):
    """lookup (dense: _lookup_dense), lookup_rows and lookup_many give the forward's rows and gradients."""
    ec = make(seed)
    x = inputs(seed, hotness)
    ref = ec(x)
    sum(v.sum() for v in ref.values()).backward()
    ref_grads = [s.weight.grad.coalesce().to_dense() for s in ec.storages]
    for s in ec.storages:
        s.weight.grad = None
    alone = {f: ec.lookup(f, x[f]) for f in x}
    many = dict(zip(x, ec.lookup_many(list(x.items()))))
    for f in x:
        torch.testing.assert_close(alone[f], ref[f], rtol=0, atol=0)
        torch.testing.assert_close(many[f], ref[f], rtol=0, atol=0)
    sum(v.sum() for v in alone.values()).backward()
    for s, g in zip(ec.storages, ref_grads):
        torch.testing.assert_close(s.weight.grad.coalesce().to_dense(), g, rtol=1e-6, atol=1e-6)
    if hotness == 1:
        ids = x["b"].values
        torch.testing.assert_close(ec.lookup_rows("b", ids), ref["b"], rtol=0, atol=0)
        with pytest.raises(he.InvalidInputError, match="'b'.*out of range"):
            ec.lookup_rows("b", torch.tensor([1, 20]))
        with pytest.raises(he.InvalidInputError, match="lookup_rows takes"):
            ec.lookup_rows("d", ids)


def test_the_numba_pass_runs_for_the_numba_backends_only(monkeypatch):
    """kernels="eager" (the reference path) assembles with torch ops; "auto" takes the Numba pass where it runs."""
    calls = []
    numba = cpu_assemble.assemble
    monkeypatch.setattr(cpu_assemble, "assemble", lambda *a: calls.append(r := numba(*a)) or r)
    for kernels, want in (("eager", False), ("auto", cpu_fused.available())):
        calls.clear()
        ec = he.EmbeddingCollection([he.TableConfig("t", 10, 4)], kernels=kernels)
        ec({"t": he.Jagged.from_lists([[1, 2], [3]])})
        assert bool(calls) == want, kernels
