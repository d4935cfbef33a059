"""The fused CPU step (``kernels="numba"``, the CPU default where Numba is installed) against the
eager ops and against plain PyTorch: the same rows and optimizer state after several steps,
for every fused optimizer, every kind of input, dense and dynamic tables, one and two threads.

    python -m pytest -q tests/kernels/test_cpu_fused.py
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import hybridembed as he
from hybridembed.errors import ConfigError
from hybridembed.input.jagged import bag_index
from hybridembed.kernels import backend, cpu_fused
from hybridembed.kernels.lookup import sorted_segments
from hybridembed.optim import sparse as so

pytest.importorskip("numba")

OPTIMIZERS = {
    "sgd": so.SGD(lr=0.1),
    "sgd_wd_max": so.SGD(lr=0.1, weight_decay=0.05, maximize=True),
    "adagrad": so.Adagrad(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
    "adagrad_wd": so.Adagrad(lr=0.1, weight_decay=0.1),
    "rowwise": so.RowWiseAdagrad(lr=0.1),
    "adam": so.Adam(lr=0.01),
    "adam_wd_max": so.Adam(lr=0.01, weight_decay=0.01, maximize=True),
}


def _inputs(g: torch.Generator, kind: str, rows: int) -> dict:
    if kind == "one":  # one-hot: 1-D ids
        return {f: torch.randint(0, rows // 4, (64,), generator=g) for f in ("a", "b", "c")}
    long = kind.startswith(("long", "wide"))  # ("wide": ids over every row, not a quarter of them)
    lengths = torch.randint(4, 13, (32,), generator=g) if long else torch.randint(0, 6, (32,), generator=g)
    if kind in ("one_jagged", "as_many"):  # one id a bag given as a Jagged; as many ids as bags, not one each
        lengths = torch.ones(32, dtype=torch.int64)
        if kind == "as_many":
            lengths[::4], lengths[1::4] = 0, 2
    n = int(lengths.sum())
    ids = torch.randint(0, rows if kind.startswith("wide") else rows // 4, (n,), generator=g)
    ids[torch.rand(n, generator=g) < 0.3] = 2  # a hot id: long runs
    w = torch.rand(n, generator=g) if kind.endswith("weighted") else None
    return {f: he.Jagged.from_lengths(ids, lengths, w) for f in ("a", "b", "c")}


def _loss(out: dict, g: torch.Generator, layout: str) -> torch.Tensor:
    """``apart``: each output times its own random tensor; ``cat``: a dense slot and the outputs
    concatenated as a model does (DLRM's ``cat([x] + ly, 1)``), times one random tensor; ``inplace``:
    the same after an output was changed in place."""
    if layout == "apart":
        return sum((v * torch.randn(v.shape, generator=g, dtype=v.dtype)).sum() for v in out.values())
    a, b, c = out["a"], out["b"], out["c"]
    if layout == "inplace":
        a.mul_(2.0)
    x = torch.randn(a.shape, generator=g, dtype=a.dtype, requires_grad=True)
    z = torch.cat([x, a, b, c], 1)
    return (z * torch.randn(z.shape, generator=g, dtype=z.dtype)).sum()


def _train(
    kernels: str,
    opt: so.SparseOptimizer,
    kind: str,
    *,
    dtype=torch.float32,
    dynamic=False,
    steps=4,
    twice=False,
    layout="apart",
    dim=8,
    t1_combiner="mean",
):
    tables = [
        he.TableConfig(
            n, None if dynamic else 200, dim, dtype=dtype, optimizer=opt, combiner=t1_combiner if n == "t1" else "sum",
            dynamic=dynamic if isinstance(dynamic, he.Dynamic) else he.Dynamic() if dynamic else None,
        )
        for n in ("t0", "t1")
    ]  # fmt: skip
    ec = he.EmbeddingCollection(
        tables, {"a": "t0", "b": "t0", "c": "t1"}, seed=3, kernels=kernels
    )  # two features share t0
    wrapped = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec)
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        wrapped.zero_grad()
        for _ in range(2 if twice else 1):  # two backwards before one step: their gradients add up
            b = _inputs(g, kind, 200)
            _loss(ec(b), g, layout).backward()
        wrapped.step()
    return ec, wrapped


def _state(ec) -> dict:
    return {k: v for k, v in ec.state_dict().items()}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("kind", ["one", "bags", "weighted", "one_jagged", "as_many"])
def test_fused_step_equals_the_eager_ops(name, kind):
    opt = OPTIMIZERS[name]
    eager, _ = _train("eager", opt, kind)
    fused, wrapped = _train("numba", opt, kind)
    assert set(wrapped.fused_steps) == {"t0", "t1"} and min(wrapped.fused_steps.values()) == 4
    want, got = _state(eager), _state(fused)
    assert want.keys() == got.keys()
    for k in want:  # the rows and every optimizer state tensor
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("dim", [1, 13, 24])
@pytest.mark.parametrize("name", ["rowwise", "adagrad_wd"])
def test_fused_step_equals_the_eager_ops_at_widths_that_are_not_eight_elements(name, dim):
    """Row-wise Adagrad sums a row's squares eight elements abreast, then the rest one by one."""
    want, _ = _train("eager", OPTIMIZERS[name], "bags", dim=dim)
    got, _ = _train("numba", OPTIMIZERS[name], "bags", dim=dim)
    want, got = _state(want), _state(got)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("name", ["sgd", "rowwise", "adam_wd_max"])
def test_one_id_bags_in_the_model_s_gradient_buffer_equal_the_eager_ops(name):
    """One id a bag given as a Jagged (seen at the step) with the outputs concatenated as a model
    does (each bag's gradient row read where the model left it)."""
    want, _ = _train("eager", OPTIMIZERS[name], "one_jagged", layout="cat")
    got, _ = _train("numba", OPTIMIZERS[name], "one_jagged", layout="cat")
    want, got = _state(want), _state(got)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("layout", ["apart", "cat"])
@pytest.mark.parametrize("kind", ["one", "bags", "long", "long_weighted"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_sgd_applies_each_id_in_place_as_the_eager_ops(monkeypatch, layout, kind, dynamic):
    """One id a bag (each id's gradient row its own, or the model's), bags of 0 to 5 and of 4 to 12
    ids: SGD without weight decay adds each id's gradient to its row where it lies (no grouping, no
    reduction); with weight decay the rows are reduced first. Either way the eager step's rows; on
    1 and 2 threads the same, bit for bit."""
    monkeypatch.setattr(cpu_fused, "_MIN_PER_THREAD", 64)
    dynamic = he.Dynamic(min_count=2) if dynamic else False  # (ids seen once read the default row, never updated)
    real, calls = cpu_fused._sgd_in_place, []
    monkeypatch.setattr(cpu_fused, "_sgd_in_place", lambda *a: calls.append(1) or real(*a))
    threads = torch.get_num_threads()
    for name, in_place in (("sgd", True), ("sgd_max", True), ("sgd_wd_max", False)):
        opt = OPTIMIZERS.get(name) or so.SGD(lr=0.1, maximize=True)
        ref = _train("eager", opt, kind, dynamic=dynamic, layout=layout)[0]
        want = {**_state(ref), **{f"{i}.row0": st.weight.detach()[0] for i, st in enumerate(ref.storages)}}
        got = []
        try:
            for n in (1, 2):
                torch.set_num_threads(n)
                calls.clear()
                ec = _train("numba", opt, kind, dynamic=dynamic, layout=layout)[0]
                got.append({**_state(ec), **{f"{i}.row0": st.weight.detach()[0] for i, st in enumerate(ec.storages)}})
                assert len(calls) == (4 * len(ec.storages) if in_place else 0), (name, len(calls))  # (a call a step)
        finally:
            torch.set_num_threads(threads)
        for k in want:
            torch.testing.assert_close(
                got[0][k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k, name=name: f"{name} {k}: {m}"
            )
            assert torch.equal(got[0][k], got[1][k]), (name, k)  # (each row's ids in batch order either way)


@pytest.mark.parametrize("dynamic", [False, True])
def test_sgd_on_bags_that_repeat_rows_takes_the_grouped_step_as_the_eager_ops(monkeypatch, dynamic):
    """Multi-hot bags with more ids a distinct row than ``_GROUPED_SGD_REPEATS``: SGD without
    weight decay sums each row's gradients first (no id applied in place); below it, in place.
    Either way the eager step's rows."""
    monkeypatch.setattr(cpu_fused, "_COUNTED_MIN", 16)  # (the test's small batches are counted)
    monkeypatch.setattr(cpu_fused, "_MIN_PER_THREAD", 64)
    dynamic = he.Dynamic(min_count=2) if dynamic else False
    real, calls = cpu_fused._sgd_in_place, []
    monkeypatch.setattr(cpu_fused, "_sgd_in_place", lambda *a: calls.append(1) or real(*a))
    opt = so.SGD(lr=0.1, maximize=True)
    want = _state(_train("eager", opt, "long", dynamic=dynamic)[0])
    for threshold, in_place in ((1.5, False), (1e9, True)):  # ("long": 4 to 12 ids a bag, 30% one hot id)
        monkeypatch.setattr(cpu_fused, "_GROUPED_SGD_REPEATS", threshold)
        calls.clear()
        ec = _train("numba", opt, "long", dynamic=dynamic)[0]
        assert (len(calls) > 0) == in_place, (threshold, len(calls))
        got = _state(ec)
        for k in want:
            torch.testing.assert_close(
                got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k, t=threshold: f"{t} {k}: {m}"
            )


def test_repeats_counts_ids_a_distinct_row_on_any_number_of_threads(monkeypatch):
    monkeypatch.setattr(cpu_fused, "_COUNTED_MIN", 16)
    monkeypatch.setattr(cpu_fused, "_MIN_PER_THREAD", 64)
    g = torch.Generator().manual_seed(3)
    threads = torch.get_num_threads()
    try:
        for rows in (64, 1000, 4099):
            ids = torch.randint(0, rows, (500,), generator=g)
            ids[::3] = rows - 1  # (the last row, its word's last bits)
            want = 500 / ids.unique().numel()
            for n in (1, 2):
                torch.set_num_threads(n)
                assert cpu_fused.repeats(ids, rows) == pytest.approx(want, rel=1e-12), (rows, n)
                assert cpu_fused.repeats(ids.to(torch.int32), rows) == pytest.approx(want, rel=1e-12)
    finally:
        torch.set_num_threads(threads)
    ids = torch.randint(0, 100, (500,), generator=g)
    for bad in (-1, 100):  # (an id out of range: not counted, nothing written past the bits)
        wrong = ids.clone()
        wrong[250] = bad
        assert cpu_fused.repeats(wrong, 100) == 0.0
    assert cpu_fused.repeats(ids[:10], 100) == 0.0  # (fewer ids than _COUNTED_MIN)
    assert cpu_fused.repeats(ids, 500 * cpu_fused._MARKED_ROWS + 1) == 0.0  # (too few ids for the rows)


@pytest.mark.parametrize("name", ["adagrad", "rowwise", "adam"])
def test_float64_dynamic_and_twice_backward_equal_the_eager_ops(name):
    opt = OPTIMIZERS[name]
    for kw in ({"dtype": torch.float64}, {"dynamic": True}, {"twice": True}):
        want = _state(_train("eager", opt, "bags", **kw)[0])
        fused, wrapped = _train("numba", opt, "bags", **kw)
        got = _state(fused)
        assert wrapped.fused_steps, kw
        tol = 1e-12 if kw.get("dtype") == torch.float64 else 1e-6
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=tol, atol=tol, msg=lambda m, k=k, kw=kw: f"{kw} {k}: {m}")


def test_fused_adagrad_equals_torch_optim_on_plain_embedding_bags():
    """The independent reference: nn.EmbeddingBag(sparse=True) + torch.optim.Adagrad."""
    ref = nn.EmbeddingBag(100, 6, mode="sum", sparse=True)
    ec = he.EmbeddingCollection(
        [he.TableConfig("t", 100, 6, optimizer=so.Adagrad(lr=0.05, lr_decay=0.01))], kernels="numba"
    )
    with torch.no_grad():
        ec.storage_of("t").weight.copy_(ref.weight)
    opt_ref = torch.optim.Adagrad(ref.parameters(), lr=0.05, lr_decay=0.01)
    opt = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.05), ec)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        lengths = torch.randint(0, 5, (40,), generator=g)
        ids = torch.randint(0, 30, (int(lengths.sum()),), generator=g)
        up = torch.randn(40, 6, generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
        opt_ref.zero_grad()
        ref(ids, offsets).backward(up)
        opt_ref.step()
        opt.zero_grad()
        ec({"t": he.Jagged.from_lengths(ids, lengths)})["t"].backward(up)
        opt.step()
    assert opt.fused_steps["t"] == 5
    torch.testing.assert_close(ec.weight("t"), ref.weight.detach(), rtol=1e-5, atol=1e-6)


def test_two_threads_split_the_rows_and_equal_one(monkeypatch):
    """Batches large enough for one slice of rows per thread."""
    monkeypatch.setattr(cpu_fused, "_MIN_PER_THREAD", 64)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(_state(_train("numba", OPTIMIZERS["rowwise"], "bags")[0]))
    finally:
        torch.set_num_threads(threads)
    for k in results[0]:
        assert torch.equal(results[0][k], results[1][k]), k  # (each row's sum in batch order either way)


def test_reduced_rows_take_the_fused_update_with_a_given_row_statistic():
    """``apply_gradient``: rows already reduced (a sharded job's, a parameter server's), with and
    without the whole rows' mean squares (column slices of row-wise Adagrad)."""
    for stat in (None, torch.rand(3)):
        stores = []
        for kernels in ("eager", "numba"):
            ec = he.EmbeddingCollection(
                [he.TableConfig("t", 10, 4, optimizer=so.RowWiseAdagrad(lr=0.1))], kernels=kernels
            )
            he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec)
            st = ec.storage_of("t")
            for _ in range(3):
                st.apply_gradient(
                    torch.tensor([7, 1, 4]),
                    torch.randn(3, 4, generator=torch.Generator().manual_seed(5)),
                    st.hparams,
                    *(() if stat is None else (stat,)),
                )
            stores.append(st)
        torch.testing.assert_close(stores[1].weight.detach(), stores[0].weight.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(stores[1].state["sum"], stores[0].state["sum"], rtol=1e-6, atol=1e-7)


def test_what_the_kernels_do_not_implement_runs_the_eager_ops():
    for opt, dtype in (
        (so.SGD(lr=0.1, momentum=0.9), torch.float32),
        (so.RMSprop(lr=0.01), torch.float32),
        (so.Adagrad(lr=0.1), torch.bfloat16),
    ):
        ec = he.EmbeddingCollection([he.TableConfig("t", 20, 4, optimizer=opt, dtype=dtype)], kernels="numba")
        wrapped = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec)
        ec({"t": torch.tensor([1, 2, 2])})["t"].sum().backward()
        wrapped.step()
        assert not wrapped.fused_steps, (opt, dtype)
        assert not torch.equal(ec.weight("t")[2], ec.weight("t")[3])  # (it trained)


@pytest.mark.parametrize("layout", ["cat", "inplace"])
@pytest.mark.parametrize("kind", ["one", "bags"])
def test_outputs_concatenated_by_the_model_are_read_where_they_lie(layout, kind, monkeypatch):
    """The features' gradients, views of the model's concatenation: the step reads each bag's
    row there (no (S, D) copy), and equals the eager ops (one and two backwards a step, a
    dynamic table); an output changed in place: joined as before, equal too."""
    seen = []
    real = cpu_fused._in_place

    def spy(grads):
        got = real(grads)
        seen.append(got[0] is not None)
        return got

    monkeypatch.setattr(cpu_fused, "_in_place", spy)
    for kw in ({}, {"twice": True}, {"dynamic": True}):
        opt = OPTIMIZERS["rowwise" if kw else "adam"]
        want = _state(_train("eager", opt, kind, layout=layout, **kw)[0])
        seen.clear()
        fused, wrapped = _train("numba", opt, kind, layout=layout, **kw)
        # (cat: the group's three features in the model's buffer; inplace: a's gradient is the in-place
        # op's own tensor, so the group's are joined as autograd joins them)
        assert seen and all(seen) if layout == "cat" else not any(seen), (kw, seen)
        assert min(wrapped.fused_steps.values()) == 4
        got = _state(fused)
        for k in want:
            torch.testing.assert_close(
                got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k, kw=kw: f"{kw} {k}: {m}"
            )


def test_outputs_apart_are_joined_as_autograd_joins_them():
    assert cpu_fused._in_place([torch.zeros(3, 4), torch.zeros(2, 4)]) == (None, None)
    z = torch.zeros(5, 12)
    source, rows_of = cpu_fused._in_place([z[:, 4:8], z[:, 8:12]])
    assert source.shape == (15, 4) and rows_of.tolist() == [1, 4, 7, 10, 13, 2, 5, 8, 11, 14]
    _, rows_of = cpu_fused._in_place([z[1:3, 4:8], z[:4, 8:12]])  # (batch sizes apart)
    assert rows_of.tolist() == [4, 7, 2, 5, 8, 11]
    assert cpu_fused._in_place([z[:, 2:6]]) == (None, None)  # (columns not on a row boundary of D)


def test_clipping_sees_the_kept_gradient_in_place():
    ec, _ = _train("numba", OPTIMIZERS["sgd"], "one", steps=0)
    ref, _ = _train("eager", OPTIMIZERS["sgd"], "one", steps=0)
    g = torch.Generator().manual_seed(1)
    b = _inputs(g, "one", 200)
    for m in (ec, ref):
        _loss(m(b), torch.Generator().manual_seed(2), "cat").backward()
    norms = [he.clip_grad_norm_(m.parameters(), 0.5) for m in (ec, ref)]
    torch.testing.assert_close(norms[0], norms[1])
    for n in ("t0", "t1"):
        torch.testing.assert_close(ec.storage_of(n).weight.grad.to_dense(), ref.storage_of(n).weight.grad.to_dense())


def test_clipping_sees_the_kept_gradient():
    ec, _ = _train("numba", OPTIMIZERS["sgd"], "bags", steps=0)
    ec({"a": torch.tensor([1, 1, 2]), "b": torch.tensor([3]), "c": torch.tensor([4])})["a"].sum().backward()
    norm = he.clip_grad_norm_(ec.parameters(), 1e9)
    st = ec.storage_of("t0")
    assert st.weight.grad is not None and not st._deferred  # made into the eager sparse gradient
    assert float(norm) > 0


def test_without_numba_the_cpu_runs_eager_with_one_log_line(monkeypatch, caplog):
    cpu_fused.available.cache_clear()
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba -> ImportError
    monkeypatch.delitem(sys.modules, "hybridembed.kernels._numba_kernels", raising=False)
    monkeypatch.delattr(sys.modules["hybridembed.kernels"], "_numba_kernels", raising=False)
    try:
        with caplog.at_level(logging.INFO, logger="hybridembed"):
            assert not cpu_fused.available() and not cpu_fused.available()
            ec = he.EmbeddingCollection([he.TableConfig("t", 20, 4)])  # kernels="auto"
            wrapped = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec)
            ec({"t": torch.tensor([1, 2])})["t"].sum().backward()
            wrapped.step()
        assert not wrapped.fused_steps
        lines = [r for r in caplog.records if "Numba" in r.getMessage()]
        assert len(lines) == 1 and "eager" in lines[0].getMessage()
        assert backend.describe("auto", "cpu") == "eager"
        with pytest.raises(ConfigError, match="needs Numba"):
            he.EmbeddingCollection([he.TableConfig("t", 20, 4)], kernels="numba")
    finally:
        cpu_fused.available.cache_clear()


def test_auto_takes_the_fused_step_on_the_cpu():
    assert backend.describe("auto", "cpu") == "numba" and backend.describe("eager", "cpu") == "eager"
    _, wrapped = _train("auto", OPTIMIZERS["rowwise"], "one", steps=1)
    assert wrapped.fused_steps == {"t0": 1, "t1": 1}


@pytest.mark.parametrize("name", ["sgd_wd_max", "adagrad_wd", "rowwise", "adam_wd_max"])
def test_a_scaled_fused_step_equals_the_scaled_reduced_rows(name):
    """A sharded job's mean over ranks (``apply_fused(hp, scale)``) scales each distinct row's
    summed gradient in the kernel: the same rows and state as the reduced rows scaled first
    (the eager path's order), for a scale that is not a power of two."""
    stores = []
    for fused in (True, False):
        ec = he.EmbeddingCollection([he.TableConfig("t", 50, 8, optimizer=OPTIMIZERS[name])], kernels="numba")
        he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec)
        st = ec.storage_of("t")
        g = torch.Generator().manual_seed(3)
        for _ in range(3):
            ids = torch.randint(0, 50, (40, 3), generator=g)
            (ec({"t": ids})["t"] * torch.randn(40, 8, generator=g)).sum().backward()
            if fused:
                st.apply_fused(st.hparams, 1 / 3)
            else:
                rows, grad = st.grad_rows()
                st.apply_gradient(rows, grad * (1 / 3), st.hparams)
        stores.append(st)
    torch.testing.assert_close(stores[0].weight.detach(), stores[1].weight.detach(), rtol=1e-6, atol=1e-7)
    for k in stores[1].state:
        torch.testing.assert_close(stores[0].state[k], stores[1].state[k], rtol=1e-6, atol=1e-7)


_FORKED_POOL = r"""
import os, signal, sys
from hybridembed.kernels import cpu_fused as cf
cf._run(lambda lo, hi: None, [(0, 1), (1, 2)], (), ())  # (the parent's pool made and used)
pid = os.fork()
if pid == 0:
    signal.alarm(30)  # (a hung child ends itself)
    got = []
    cf._run(lambda lo, hi: got.append(lo), [(0, 1), (1, 2), (2, 3)], (), ())
    os._exit(0 if sorted(got) == [0, 1, 2] else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_runs_the_step_on_threads_of_its_own():
    """A process forked after the step's thread pool was made (a warm server forking ranks) gets
    a pool of its own: the parent's pool has no threads in the child, and work sent to it waited
    forever."""
    r = subprocess.run([sys.executable, "-c", _FORKED_POOL], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_merged_row_sets_equal_the_sum_by_index_in_set_order(dtype):
    """Sets of distinct ascending ids (ranks' touched rows) merged: their union ascending, each row
    summed in the sets' order and divided, bit for bit as ``index_add_`` into zeros set after set."""
    g = torch.Generator().manual_seed(3)
    ids = [torch.randperm(50, generator=g)[:n].sort().values for n in (20, 0, 35, 1)]
    rows = [torch.randn(i.numel(), 4, generator=g, dtype=dtype) * 1e3 for i in ids]
    got_ids, got = cpu_fused.merge_rows(ids, rows, 3.0)
    union, where = torch.unique(torch.cat(ids), return_inverse=True)
    ref = torch.zeros(union.numel(), 4, dtype=dtype)
    for at, r in zip(where.split([i.numel() for i in ids]), rows):
        ref.index_add_(0, at, r)
    assert torch.equal(got_ids, union) and torch.equal(got, ref / 3)
    # what it does not take: the caller sums another way
    assert cpu_fused.merge_rows([ids[0].flip(0), ids[2]], [rows[0], rows[2]], 1.0) is None  # (not ascending)
    assert cpu_fused.merge_rows([ids[0], ids[2]], [rows[0], rows[2].to(torch.bfloat16)], 1.0) is None
    with pytest.raises(ValueError, match="one D"):  # (rows that do not match their ids: never read out of bounds)
        cpu_fused.merge_rows([ids[0], ids[2]], [rows[0], rows[2][:-1]], 1.0)
    with pytest.raises(ValueError, match="one D"):
        cpu_fused.merge_rows([ids[0], ids[2]], [rows[0], rows[2][:, :3]], 1.0)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bags", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_ids_grouped_by_counting_equal_the_sorted_ids_and_their_gathers(threads, bags, weighted, monkeypatch):
    """group_by_row's (distinct rows, each sorted id's gradient row, segments, multipliers) are
    those of the stable sort and the gathers after it, element for element."""
    monkeypatch.setattr(cpu_fused, "_MIN_PER_THREAD", 1000)
    g = torch.Generator().manual_seed(threads + 2 * bags + 4 * weighted)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for nrows, n in ((1000, 70_000), (300_001, 80_000), (1 << 17, 1 << 16)):  # (rows in 1, 5 and 2 buckets)
            ids = torch.randint(0, nrows, (n,), generator=g)
            ids[: n // 3] = torch.randint(0, 50, (n // 3,), generator=g)  # (long runs)
            ids[-7:] = torch.tensor([0, nrows - 1] * 3 + [nrows - 1])
            ids = ids[torch.randperm(n, generator=g)]
            bag_of = torch.randint(0, n // 3, (n,), generator=g) if bags else None
            psw = torch.rand(n, generator=g, dtype=torch.float64) if weighted else None
            got = cpu_fused.group_by_row(ids, nrows, bag_of, psw, torch.float32)
            uniq, perm, seg = sorted_segments(ids, nrows)
            assert got is not None
            assert torch.equal(got[0], uniq) and torch.equal(got[2].long(), seg)
            assert torch.equal(got[1].long(), perm if bag_of is None else bag_of.index_select(0, perm))
            assert got[3] is None if psw is None else torch.equal(got[3], psw.index_select(0, perm).float())
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mapped", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_bags_given_as_they_are_group_as_each_id_s_bag_row_does(threads, mapped, weighted, monkeypatch):
    """group_by_row reads a BagRows' bags (offsets, each bag's row) where they lie: the same grouping
    as with each id's row made first (bag_rows), empty bags at the ends and between included; the
    sort's path (few ids) makes the rows itself."""
    monkeypatch.setattr(cpu_fused, "_MIN_PER_THREAD", 1000)
    g = torch.Generator().manual_seed(threads + 2 * mapped + 4 * weighted)
    lengths = torch.randint(0, 6, (30_000,), generator=g)
    lengths[:5] = lengths[100:200] = lengths[-7:] = 0
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    n, nrows = int(offsets[-1]), 5_000
    ids = torch.randint(0, nrows, (n,), generator=g)
    rows_of = torch.randperm(40_000, generator=g)[:30_000] if mapped else None
    psw = torch.rand(n, generator=g) if weighted else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        made = cpu_fused.bag_rows(offsets, n, rows_of)
        lazy = cpu_fused.BagRows(offsets.to(torch.int32), n, rows_of)
        want = cpu_fused.group_by_row(ids, nrows, made, psw, torch.float32)
        got = cpu_fused.group_by_row(ids, nrows, lazy, psw, torch.float32)
        assert want is not None and got is not None
        for a, b in zip(want, got):
            assert (a is None and b is None) or torch.equal(a, b)
        grad = torch.randn(40_000 if mapped else 30_000, 4, generator=g)
        few = cpu_fused.BagRows(offsets[:11], int(offsets[10]), None if rows_of is None else rows_of[:10])
        uniq, rows = cpu_fused.reduce_kept(ids[: few.n], grad, few, None, nrows)  # (the sort's path)
        ref = torch.zeros(nrows, 4).index_add_(0, ids[: few.n], grad[few.tensor()])
        assert torch.equal(uniq, ids[: few.n].unique()) and torch.allclose(rows, ref[uniq])
    finally:
        torch.set_num_threads(before)


def test_ids_are_grouped_by_counting_only_when_many_and_in_range():
    many = torch.arange(1 << 16) % 1000
    assert cpu_fused.group_by_row(many, 1000, None, None, torch.float32) is not None
    assert cpu_fused.group_by_row(many, 1000 * (1 << 16), None, None, torch.float32) is None  # (few for the rows)
    assert cpu_fused.group_by_row(many[:1000], 1000, None, None, torch.float32) is None  # (few ids)
    for bad in (-1, 1000):
        ids = many.clone()
        ids[-1] = bad
        assert cpu_fused.group_by_row(ids, 1000, None, None, torch.float32) is None  # (the sort's path reports it)


@pytest.mark.parametrize("name", ["rowwise", "adagrad_wd", "adam_wd_max", "sgd_wd_max"])
@pytest.mark.parametrize("kind", ["one", "bags", "weighted", "wide"])
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("way", ["walked", "grouped", "direct_walk", "direct_sums"])
def test_a_step_with_ids_grouped_by_counting_equals_the_sorted_one_bit_for_bit(name, kind, dynamic, way, monkeypatch):
    """Small batches made to take the counting sort (small buckets, no minimum), or the sums
    straight into a small table's rows: the same rows and state as the sort's step, bit for bit
    (each row's ids summed in batch order either way; where ids carry multipliers, the walk within
    rounding, the direct sums not taken), walked bucket by bucket (``_walked``: each bucket's rows
    summed in the core's cache and stepped at once), grouped then reduced (``group_by_row``, as a
    sharded job's reductions use it), walked straight (``_direct_walk``) and summed straight
    (``_direct``, the reduction of ``reduce_kept``)."""
    monkeypatch.setattr(cpu_fused, "_DIRECT_BYTES", 0)  # (the reference: the sort's path)
    # (the direct ways take no multipliers: t1 summed, so only per-id weights carry any)
    kw = {"dynamic": dynamic, "t1_combiner": "mean" if way in ("walked", "grouped") else "sum"}
    sorted_state = _state(_train("numba", OPTIMIZERS[name], kind, **kw)[0])
    calls = []

    def spy(fn):
        return lambda *a: calls.append(r := fn(*a)) or r

    if way == "walked":
        monkeypatch.setattr(cpu_fused, "_walked", spy(cpu_fused._walked))
    elif way == "grouped":
        monkeypatch.setattr(cpu_fused, "_walked", lambda *a: False)
        monkeypatch.setattr(cpu_fused, "group_by_row", spy(cpu_fused.group_by_row))
    else:
        monkeypatch.setattr(cpu_fused, "_DIRECT_BYTES", 1 << 30)
        monkeypatch.setattr(cpu_fused, "_DIRECT_WALK_IDS", 0)
        if way == "direct_walk":
            monkeypatch.setattr(cpu_fused, "_direct_walk", spy(cpu_fused._direct_walk))
        else:
            monkeypatch.setattr(cpu_fused, "_direct_walk", lambda *a: False)
            monkeypatch.setattr(cpu_fused, "_walked", lambda *a: False)
            monkeypatch.setattr(cpu_fused, "_direct", spy(cpu_fused._direct))
    monkeypatch.setattr(cpu_fused, "_COUNTED_MIN", 0)
    monkeypatch.setattr(cpu_fused, "_COUNTED_ROWS", 1 << 20)
    monkeypatch.setattr(cpu_fused, "_BUCKET_SHIFT", 3)  # (walked: 64 rows a bucket, its least)
    monkeypatch.setattr(cpu_fused, "_MIN_PER_THREAD", 16)
    counted = _state(_train("numba", OPTIMIZERS[name], kind, **kw)[0])
    taken = [c is not None and c is not False for c in calls]
    # (the direct ways leave batches with multipliers, per-id weights, to the sort)
    assert taken and (not any(taken) if way.startswith("direct") and kind == "weighted" else all(taken))
    for k in sorted_state:
        if way in ("walked", "direct_walk") and (k.startswith("t1") or kind == "weighted"):
            # (ids with multipliers: t1's "mean", per-id weights: embedding_bag may fuse each
            # multiply-add, the bucket walk (the straight walk leaves them to it) rounds the product
            # first: equal to the rounding only)
            torch.testing.assert_close(counted[k], sorted_state[k], rtol=1e-5, atol=1e-6, msg=k)
        else:
            assert torch.equal(counted[k], sorted_state[k]), k


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype, dim", [(torch.float32, 40), (torch.float64, 300)])
@pytest.mark.parametrize("way", ["walked", "direct_walk"])
def test_the_step_walked_bucket_by_bucket_equals_the_sorted_one_at_any_width(threads, dtype, dim, way, monkeypatch):
    """Rows of 3 and of 38 cache lines (the prefetch's straight hints and its loop), float64,
    dynamic tables (the default row never updated), ids with and without multipliers (a "mean"
    table), several buckets (or ranges of rows) a thread, one and two threads: the walk's rows and
    state (bucket by bucket, or straight) are the sorted step's, bit for bit where no id has a
    multiplier (the straight walk leaves those to the sort)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    monkeypatch.setattr(cpu_fused, "_DIRECT_BYTES", 0)  # (the reference: the sort's path)
    try:
        for dynamic, combiner in ((False, "sum"), (True, "sum"), (False, "mean"), (True, "mean")):
            opt, kw = (
                OPTIMIZERS["adam_wd_max"],
                {"dtype": dtype, "dim": dim, "dynamic": dynamic, "t1_combiner": combiner},
            )
            want = _state(_train("numba", opt, "wide", **kw)[0])
            with monkeypatch.context() as m:
                calls, name = [], "_walked" if way == "walked" else "_direct_walk"
                walk = getattr(cpu_fused, name)
                m.setattr(cpu_fused, name, lambda *a, calls=calls, walk=walk: calls.append(r := walk(*a)) or r)
                m.setattr(cpu_fused, "_DIRECT_BYTES", 0 if way == "walked" else 1 << 30)
                m.setattr(cpu_fused, "_DIRECT_WALK_IDS", 0)
                m.setattr(cpu_fused, "_COUNTED_MIN", 0)
                m.setattr(cpu_fused, "_COUNTED_ROWS", 1 << 20)
                m.setattr(cpu_fused, "_MIN_PER_THREAD", 16)
                m.setattr(cpu_fused, "_BUCKET_SHIFT", 3)  # (64 rows a bucket: several a thread)
                got = _state(_train("numba", opt, "wide", **kw)[0])
            assert calls and (all(calls) if way == "walked" or combiner == "sum" else not any(calls))
            for k in want:
                if combiner == "mean":  # (each id's multiplier: walked bucket by bucket either way)
                    torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
                else:
                    assert torch.equal(got[k], want[k]), (dynamic, k)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_each_id_s_gradient_row_is_its_bag_s_row_in_one_pass(threads, monkeypatch):
    monkeypatch.setattr(cpu_fused, "_MIN_PER_THREAD", 8)
    g = torch.Generator().manual_seed(threads)
    lengths = torch.randint(0, 5, (300,), generator=g)
    lengths[:3] = 0  # (empty bags, at the start and between)
    lengths[100:110] = 0
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    n = int(offsets[-1])
    rows_of = torch.randperm(1000, generator=g)[:300]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        bags = bag_index(offsets, n)
        assert torch.equal(cpu_fused.bag_rows(offsets, n, None), bags)
        assert torch.equal(cpu_fused.bag_rows(offsets.to(torch.int32), n, rows_of), rows_of.index_select(0, bags))
        assert cpu_fused.bag_rows(offsets[:1], 0, None).numel() == 0
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_sums_straight_into_a_small_table_leave_ids_out_of_range_to_the_sort_and_step_nothing(threads, monkeypatch):
    """An id outside the table (the lookup refuses it first; this is the kernels' own guard): the
    straight sums give up (the sort's path takes the batch) and the straight walk steps no row, on
    any thread, whichever thread's rows the id would have been among."""
    monkeypatch.setattr(cpu_fused, "_MIN_PER_THREAD", 4)
    monkeypatch.setattr(cpu_fused, "_DIRECT_WALK_IDS", 0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ec = he.EmbeddingCollection([he.TableConfig("t", 50, 4)], kernels="numba", seed=1)
        (storage,) = ec.storages
        he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec, sparse=he.optim.RowWiseAdagrad(lr=0.1))
        grad = torch.randn(32, 4)
        for bad in (-1, 50, 10**6):
            ids = torch.tensor([3, 40, bad, 5] * 8)
            assert cpu_fused._direct(ids, grad, None, None, 50) is None
            hpa, opt, maximize = cpu_fused._hparams(storage, storage.hparams)
            weight = storage.weight.detach().clone()
            assert not cpu_fused._direct_walk(storage, ids, grad, None, None, storage.hparams, hpa, opt, maximize)
            assert torch.equal(storage.weight.detach(), weight)
        ids = torch.tensor([3, 40, 7, 5] * 8)
        assert cpu_fused._direct_walk(storage, ids, grad, None, None, storage.hparams, hpa, opt, maximize)
        assert not torch.equal(storage.weight.detach(), weight)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("name, dtype", [(n, torch.float32) for n in OPTIMIZERS] + [("adam_wd_max", torch.float64)])
def test_parts_summed_as_the_rows_are_stepped_equal_their_sums_applied_bit_for_bit(
    name, dtype, parts, threads, monkeypatch
):
    """A replicated table's ranks' reduced rows (``RowParts``: per rank distinct ascending ids) stepped
    where they lie, each row's sum made as it is stepped: the rows, the state and the rows marked
    changed equal the parts merged first then applied (``RowParts.summed`` + ``apply_gradient``)."""
    from hybridembed.optim.hooks import RowParts

    monkeypatch.setattr(cpu_fused, "_MIN_PER_THREAD", 16)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    stepped, real = [], cpu_fused.apply_parts
    monkeypatch.setattr(cpu_fused, "apply_parts", lambda *a: stepped.append(1) or real(*a))
    stores = []
    for ours in (True, False):
        cfg = he.TableConfig("t", 300, 13, optimizer=OPTIMIZERS[name], dtype=dtype)
        ec = he.EmbeddingCollection([cfg], kernels="numba")
        he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec)
        st = ec.storage_of("t")
        st.track_changes()
        g = torch.Generator().manual_seed(4)
        for step in range(3):
            sizes = [(0, 120, 299)[(step + k) % 3] for k in range(parts)]  # (an empty part, a part of most rows)
            ids = [torch.randperm(300, generator=g)[:n].sort().values for n in sizes]
            rows = [torch.randn(i.numel(), 13, generator=g, dtype=dtype) for i in ids]
            p = RowParts(ids, rows, float(parts))
            if ours:
                st.apply_parts(p, st.hparams)
            else:
                s = p.summed(dtype, dtype)
                st.apply_gradient(s.ids, s.rows, st.hparams)
        stores.append(st)
    a, b = stores
    assert len(stepped) == 3 and a.step == b.step == 3  # (every step merged as stepped)
    assert torch.equal(a.weight.detach(), b.weight.detach())
    for k in b.state:
        assert torch.equal(a.state[k], b.state[k]), k
    assert torch.equal(a._changed, b._changed)


def test_parts_the_merged_step_does_not_take_are_summed_first(monkeypatch):
    """Ids not strictly ascending, out of the table's rows, or rows of another dtype or width: the
    parts are summed first (the eager sums' path) and nothing was stepped from them before."""
    from hybridembed.optim.hooks import RowParts

    ec = he.EmbeddingCollection([he.TableConfig("t", 20, 4, optimizer=OPTIMIZERS["rowwise"])], kernels="numba")
    he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec)
    st = ec.storage_of("t")
    ok = [torch.tensor([1, 5, 9]), torch.tensor([0, 5])]
    rows = [torch.ones(3, 4), torch.ones(2, 4)]
    assert cpu_fused.parts_ready(st, ok, rows) is not None
    for ids, rs in [
        ([torch.tensor([5, 1, 9]), ok[1]], rows),  # (not ascending)
        ([torch.tensor([1, 5, 5]), ok[1]], rows),  # (a repeat)
        ([torch.tensor([1, 5, 20]), ok[1]], rows),  # (past the table)
        ([torch.tensor([-1, 5, 9]), ok[1]], rows),
        (ok, [rows[0].double(), rows[1]]),
        (ok, [rows[0][:, :3], rows[1]]),
        (ok[:1], rows[:1]),  # (one part: nothing to merge)
    ]:
        assert cpu_fused.parts_ready(st, ids, rs) is None
    calls = []
    monkeypatch.setattr(cpu_fused, "apply_parts", lambda *a: calls.append(a))
    before = st.weight.detach().clone()
    st.apply_parts(RowParts([torch.tensor([5, 1, 9]), ok[1]], rows, 2.0), st.hparams)  # (not ascending: by index)
    assert not calls and st.step == 1
    changed = (st.weight.detach() != before).any(1).nonzero().squeeze(1)
    assert changed.tolist() == [0, 1, 5, 9]


@pytest.mark.parametrize("rows", [1, 64, 65, 1000, 5000])
def test_distinct_rows_by_a_bit_a_row_equal_torch_unique(rows):
    """Distinct row numbers, each id's place among them and each row's first id, without a sort:
    what ``torch.unique(return_inverse=True)`` and a scatter of first positions give; None where
    the rows are too many for the ids, an id is out of range, or there are none."""
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(0, rows, (300,), generator=g)
    uniq, inverse, first = cpu_fused.distinct_rows(ids, rows)
    want, where = torch.unique(ids, return_inverse=True)
    assert torch.equal(uniq, want) and torch.equal(inverse, where)
    assert torch.equal(first, torch.full_like(want, 300).scatter_reduce_(0, where, torch.arange(300), "amin"))
    assert cpu_fused.distinct_rows(torch.tensor([0, rows]), rows) is None  # (out of range)
    assert cpu_fused.distinct_rows(torch.tensor([-1]), rows) is None
    assert cpu_fused.distinct_rows(torch.zeros(0, dtype=torch.int64), rows) is None
    assert cpu_fused.distinct_rows(torch.tensor([3]), 64 * 1024 + 1) is None  # (a bit a row past the ids' bytes)
