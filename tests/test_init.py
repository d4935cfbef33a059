"""Tests for ``hybridembed.init``: row-keyed initializers (placement never changes the math).

Run: python -m pytest -q tests/test_init.py

Statistics are checked on 100k samples against closed forms; determinism is checked
by generating the same rows in different calls, placements and processes.
"""

import math
import os
import subprocess
import sys

import pytest
import torch

import hybridembed as he

N_ROWS, DIM = 25_000, 4  # 100k samples
SE = 5 / math.sqrt(N_ROWS * DIM)  # five standard errors of a mean, in units of the std


def sample(spec, seed=0, table="t", rows=N_ROWS, dim=DIM, dtype=torch.float64):
    return he.init.generate(spec, seed=seed, table=table, rows=torch.arange(rows), dim=dim, dtype=dtype)


def phi(x):
    return math.exp(-x * x / 2) / math.sqrt(2 * math.pi)


def Phi(x):
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def truncnorm_moments(mean, std, a, b):
    al, be = (a - mean) / std, (b - mean) / std
    z = Phi(be) - Phi(al)
    m = mean + std * (phi(al) - phi(be)) / z
    var = std**2 * (1 + (al * phi(al) - be * phi(be)) / z - ((phi(al) - phi(be)) / z) ** 2)
    return m, math.sqrt(var)


def uncorrelated(x, y, tol=0.03):
    x, y = x - x.mean(), y - y.mean()
    return abs(float((x * y).sum() / (x.norm() * y.norm()))) < tol


# --- statistics ----------------------------------------------------------------------------


@pytest.mark.parametrize("mean, std", [(0.0, 1.0), (0.5, 2.0), (-3.0, 0.01)])
def test_normal_statistics(mean, std):
    v = sample(he.init.normal(mean=mean, std=std))
    assert v.shape == (N_ROWS, DIM) and v.dtype == torch.float64
    assert abs(float(v.mean()) - mean) < SE * std
    assert abs(float(v.std()) / std - 1) < 0.02
    z = (v - mean) / std
    assert abs(float((z.abs() < 1).double().mean()) - 0.6827) < 0.01
    assert abs(float((z.abs() < 2).double().mean()) - 0.9545) < 0.006
    assert abs(float((z > 0).double().mean()) - 0.5) < 0.01
    assert float(z.abs().max()) < 6.5


def test_normal_default_is_standard():
    v = sample(he.init.normal())
    assert abs(float(v.mean())) < SE and abs(float(v.std()) - 1) < 0.02


@pytest.mark.parametrize(
    "mean, std, a, b", [(0.0, 1.0, -2.0, 2.0), (0.1, 1.0, -1.0, 1.5), (0.0, 0.02, -0.04, 0.04), (1.0, 2.0, 0.0, 6.0)]
)
def test_truncated_normal_statistics(mean, std, a, b):
    v = sample(he.init.truncated_normal(mean=mean, std=std, a=a, b=b))
    assert float(v.min()) >= a and float(v.max()) <= b
    m, s = truncnorm_moments(mean, std, a, b)
    assert abs(float(v.mean()) - m) < SE * s
    assert abs(float(v.std()) / s - 1) < 0.02
    # no mass piled on the bounds (a clamp of a plain normal would put ~2-30% there)
    assert float(((v == a) | (v == b)).double().mean()) < 1e-3
    # both ends are reached
    width = b - a
    assert float(v.min()) < a + 0.01 * width and float(v.max()) > b - 0.01 * width


def test_truncated_normal_default_bounds():
    v = sample(he.init.truncated_normal())
    assert float(v.min()) >= -2 and float(v.max()) <= 2
    m, s = truncnorm_moments(0.0, 1.0, -2.0, 2.0)
    assert abs(float(v.std()) / s - 1) < 0.02


@pytest.mark.parametrize("a, b", [(-0.05, 0.05), (-0.3, 0.7), (2.0, 2.5)])
def test_uniform_statistics(a, b):
    v = sample(he.init.uniform(a, b))
    assert float(v.min()) >= a and float(v.max()) < b
    assert abs(float(v.mean()) - (a + b) / 2) < SE * (b - a) / math.sqrt(12)
    assert abs(float(v.std()) / ((b - a) / math.sqrt(12)) - 1) < 0.02
    hist = torch.histc(v, bins=10, min=a, max=b) / v.numel()
    assert float((hist - 0.1).abs().max()) < 0.01


def test_uniform_default_is_keras():
    v = sample(he.init.uniform())
    assert float(v.min()) >= -0.05 and float(v.max()) < 0.05
    assert float(v.min()) < -0.049 and float(v.max()) > 0.049


@pytest.mark.parametrize(
    "spec, value",
    [(he.init.constant(3.25), 3.25), (he.init.constant(-1e-3), -1e-3), (he.init.zeros(), 0.0), (he.init.ones(), 1.0)],
)
def test_constant_initializers(spec, value):
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        v = sample(spec, rows=100, dim=3, dtype=dtype)
        assert v.dtype == dtype and v.shape == (100, 3)
        assert torch.equal(v, torch.full((100, 3), value, dtype=dtype))


def test_default_table_init_is_uniform_keras():
    ec = he.EmbeddingCollection([he.TableConfig("t", 5000, 8)])
    w = ec.weight("t")
    assert float(w.min()) >= -0.05 and float(w.max()) < 0.05
    assert abs(float(w.std()) - 0.1 / math.sqrt(12)) < 0.002


@pytest.mark.parametrize(
    "spec", [he.init.normal(), he.init.uniform(), he.init.truncated_normal()], ids=["normal", "uniform", "trunc"]
)
def test_elements_are_uncorrelated(spec):
    v = sample(spec, rows=20_000, dim=4)
    assert uncorrelated(v[:, 0], v[:, 1])  # neighbouring columns
    assert uncorrelated(v[:-1, 0], v[1:, 0])  # neighbouring rows
    assert uncorrelated(v[:, 0], sample(spec, seed=1, rows=20_000, dim=4)[:, 0])  # neighbouring seeds
    assert uncorrelated(v[:, 0], sample(spec, table="u", rows=20_000, dim=4)[:, 0])  # other table
    assert v.unique().numel() > 0.99 * v.numel()


def test_float32_output_is_the_float64_value_rounded():
    spec = he.init.normal(std=0.3)
    assert torch.equal(sample(spec, dtype=torch.float32), sample(spec, dtype=torch.float64).float())


# --- keyed by (seed, table, row) only ------------------------------------------------------

SPECS = [he.init.normal(0.1, 0.5), he.init.truncated_normal(0.0, 1.0, -1.0, 1.0), he.init.uniform(-1, 1)]
SPEC_IDS = ["normal", "trunc", "uniform"]


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_a_row_does_not_depend_on_the_other_rows_in_the_call(spec):
    full = he.init.generate(spec, seed=3, table="items", rows=torch.arange(1000), dim=5)
    g = torch.Generator().manual_seed(1)
    for rows in (
        torch.tensor([999, 5, 500]),
        torch.randperm(1000, generator=g),
        torch.tensor([7, 7, 7, 3]),
        torch.tensor([42]),
        torch.arange(500, 1000, dtype=torch.int32),
    ):
        part = he.init.generate(spec, seed=3, table="items", rows=rows, dim=5)
        assert torch.equal(part, full[rows.long()])
    assert he.init.generate(spec, seed=3, table="items", rows=torch.tensor([], dtype=torch.int64), dim=5).shape == (
        0,
        5,
    )


def test_chunking_does_not_change_values():
    # more elements than one internal chunk: rows near the end must equal rows generated alone
    spec = he.init.normal()
    n = 300_000
    full = he.init.generate(spec, seed=0, table="big", rows=torch.arange(n), dim=1)
    rows = torch.tensor([0, 262_143, 262_144, 262_145, n - 1])
    assert torch.equal(full[rows], he.init.generate(spec, seed=0, table="big", rows=rows, dim=1))
    assert torch.equal(full[rows], he.init.generate(spec, seed=0, table="big", rows=rows.flip(0), dim=1).flip(0))


def test_columns_of_a_row_differ():
    # a row's values must not repeat across its columns
    v = he.init.generate(he.init.uniform(), seed=0, table="t", rows=torch.arange(100), dim=16)
    assert all(len(set(r)) == 16 for r in v.tolist())


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_seed_and_table_change_the_values(spec):
    rows = torch.arange(2000)
    base = he.init.generate(spec, seed=0, table="items", rows=rows, dim=4)
    for other in (
        he.init.generate(spec, seed=1, table="items", rows=rows, dim=4),
        he.init.generate(spec, seed=2**40, table="items", rows=rows, dim=4),
        he.init.generate(spec, seed=0, table="items2", rows=rows, dim=4),
        he.init.generate(spec, seed=0, table="Items", rows=rows, dim=4),
        he.init.generate(spec, seed=0, table="item", rows=rows, dim=4),
    ):
        assert float((base == other).double().mean()) < 0.01
    # different rows of one table differ too
    assert float((base[:-1] == base[1:]).double().mean()) < 0.01
    # the same arguments give the same values
    assert torch.equal(base, he.init.generate(spec, seed=0, table="items", rows=rows, dim=4))


def test_seed_and_table_are_not_concatenated_ambiguously():
    # ("1", "2x") and ("12", "x") must be different keys
    spec = he.init.normal()
    rows = torch.arange(100)
    a = he.init.generate(spec, seed=1, table="2x", rows=rows, dim=2)
    b = he.init.generate(spec, seed=12, table="x", rows=rows, dim=2)
    assert not torch.equal(a, b)


def test_large_and_negative_row_ids():
    # dynamic tables key rows by any int64 id
    spec = he.init.normal()
    rows = torch.tensor([-(2**63), -1, 0, 2**40, 2**63 - 1])
    v = he.init.generate(spec, seed=0, table="t", rows=rows, dim=3)
    assert torch.isfinite(v).all()
    assert len({tuple(r) for r in v.tolist()}) == 5
    assert torch.equal(v[3:4], he.init.generate(spec, seed=0, table="t", rows=rows[3:4], dim=3))


# --- placement independence through the module ---------------------------------------------


@pytest.mark.parametrize("spec", SPECS + [he.init.uniform()], ids=SPEC_IDS + ["default"])
def test_module_rows_do_not_depend_on_table_size_or_group_position(spec):
    small = he.EmbeddingCollection([he.TableConfig("t", 1000, 8, init=spec)], seed=5)
    big = he.EmbeddingCollection([he.TableConfig("t", 10_000, 8, init=spec)], seed=5)
    grouped = he.EmbeddingCollection(
        [
            he.TableConfig("a", 123, 8, init=spec),
            he.TableConfig("other_dim", 50, 3, init=spec),
            he.TableConfig("b", 77, 8, combiner="mean", init=spec),
            he.TableConfig("t", 10_000, 8, init=spec),
        ],
        features={"x": "a", "y": "b", "z": "t", "w": "other_dim", "z2": "t"},
        seed=5,
    )
    assert grouped.storage_of("t").row_offset["t"] == 200  # really placed after a and b
    assert grouped.storage_of("t") is grouped.storage_of("a")
    expect = he.init.generate(spec, seed=5, table="t", rows=torch.arange(1000), dim=8)
    assert torch.equal(small.weight("t"), expect)
    assert torch.equal(big.weight("t")[:1000], expect)
    assert torch.equal(grouped.weight("t")[:1000], expect)
    # and the rows of the storage outside t are the other tables', not t's
    assert torch.equal(grouped.weight("a"), he.init.generate(spec, seed=5, table="a", rows=torch.arange(123), dim=8))


def test_module_seed_changes_every_table():
    a = he.EmbeddingCollection([he.TableConfig("t", 500, 4), he.TableConfig("u", 500, 4)], seed=0)
    b = he.EmbeddingCollection([he.TableConfig("t", 500, 4), he.TableConfig("u", 500, 4)], seed=1)
    for t in ("t", "u"):
        assert float((a.weight(t) == b.weight(t)).double().mean()) < 0.01
    assert float((a.weight("t") == a.weight("u")).double().mean()) < 0.01


def test_module_dtype_only_rounds_the_value():
    spec = he.init.normal(std=0.1)
    w32 = he.EmbeddingCollection([he.TableConfig("t", 300, 4, init=spec)]).weight("t")
    w64 = he.EmbeddingCollection([he.TableConfig("t", 300, 4, init=spec, dtype=torch.float64)]).weight("t")
    w16 = he.EmbeddingCollection([he.TableConfig("t", 300, 4, init=spec, dtype=torch.bfloat16)]).weight("t")
    assert w64.dtype == torch.float64 and w16.dtype == torch.bfloat16
    assert torch.equal(w64.float(), w32)
    assert torch.equal(w64.to(torch.bfloat16), w16)


def test_the_numba_uniforms_are_the_torch_ops_bits(monkeypatch):
    """On the CPU with Numba the uniforms come from one loop (``kernels/_numba_init.py``); they are
    the bits of the torch ops (which a CUDA table, and a CPU without Numba, compute): every kind,
    one key or one a row, negative and extreme ids, a column offset, float32 and float64."""
    from hybridembed import init as I

    loop = I._numba_init()
    if loop is None:
        pytest.skip("Numba does not import here")
    calls = []

    class Counted:
        @staticmethod
        def uniform01(*args):
            calls.append(args[0].shape[0])
            return loop.uniform01(*args)

    g = torch.Generator().manual_seed(3)
    extreme = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 2**40, -(2**40)])
    rows = torch.cat([extreme, torch.randint(-(2**63), 2**63 - 1, (300,), generator=g)])
    keys = torch.randint(-(2**63), 2**63 - 1, (rows.numel(),), generator=g)
    for spec in SPECS:
        for key in (I.table_key(7, "items"), keys):
            for col_start, dtype in ((0, torch.float32), (5, torch.float64)):
                monkeypatch.setattr(I, "_numba_init", lambda: Counted)
                got = I.generate_keyed(spec, key, rows, 9, dtype, col_start=col_start)
                monkeypatch.setattr(I, "_numba_init", lambda: None)
                want = I.generate_keyed(spec, key, rows, 9, dtype, col_start=col_start)
                assert torch.equal(got, want), (spec, col_start)
    assert len(calls) >= 2 * 2 * len(SPECS) and set(calls) == {rows.numel()}


# --- the same values in a fresh process ------------------------------------------------------

_CHILD = r"""
import sys, torch, hybridembed as he
specs = [he.init.normal(0.1, 0.5), he.init.truncated_normal(0.0, 1.0, -1.0, 1.0), he.init.uniform(-1, 1)]
out = {f"gen{i}": he.init.generate(s, seed=7, table="items", rows=torch.arange(200), dim=6) for i, s in enumerate(specs)}
ec = he.EmbeddingCollection([he.TableConfig("a", 30, 4), he.TableConfig("items", 100, 4, init=specs[0])], seed=7)
out["module"] = ec.weight("items").clone()
torch.save(out, sys.argv[1])
"""


def test_same_seed_same_values_in_a_fresh_process(tmp_path):
    path = tmp_path / "child.pt"
    env = dict(os.environ, PYTHONHASHSEED="12345")  # Python's str hash differs from this process's
    subprocess.run([sys.executable, "-c", _CHILD, str(path)], check=True, env=env, timeout=120)
    child = torch.load(path)
    for i, s in enumerate(SPECS):
        assert torch.equal(child[f"gen{i}"], he.init.generate(s, seed=7, table="items", rows=torch.arange(200), dim=6))
    ec = he.EmbeddingCollection([he.TableConfig("items", 100, 4, init=SPECS[0])], seed=7)
    assert torch.equal(child["module"], ec.weight("items"))


# --- config validation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda: he.init.Init("bogus"), id="unknown-kind"),
        pytest.param(lambda: he.init.Init("zeros"), id="zeros-is-not-a-kind"),
        pytest.param(lambda: he.init.normal(std=0.0), id="normal-std-0"),
        pytest.param(lambda: he.init.normal(std=-1.0), id="normal-std-neg"),
        pytest.param(lambda: he.init.normal(std=float("nan")), id="normal-std-nan"),
        pytest.param(lambda: he.init.normal(std=float("inf")), id="normal-std-inf"),
        pytest.param(lambda: he.init.normal(mean=float("inf")), id="normal-mean-inf"),
        pytest.param(lambda: he.init.normal(mean=float("nan")), id="normal-mean-nan"),
        pytest.param(lambda: he.init.truncated_normal(std=0.0), id="trunc-std-0"),
        pytest.param(lambda: he.init.truncated_normal(a=1.0, b=1.0), id="trunc-empty"),
        pytest.param(lambda: he.init.truncated_normal(a=2.0, b=-2.0), id="trunc-reversed"),
        pytest.param(lambda: he.init.truncated_normal(a=float("-inf")), id="trunc-inf-bound"),
        pytest.param(lambda: he.init.truncated_normal(b=float("nan")), id="trunc-nan-bound"),
        pytest.param(lambda: he.init.uniform(1.0, 0.0), id="uniform-reversed"),
        pytest.param(lambda: he.init.uniform(0.5, 0.5), id="uniform-empty"),
        pytest.param(lambda: he.init.uniform(float("nan"), 1.0), id="uniform-nan"),
        pytest.param(lambda: he.init.uniform(0.0, float("inf")), id="uniform-inf"),
        pytest.param(lambda: he.init.constant(float("nan")), id="constant-nan"),
        pytest.param(lambda: he.init.constant(float("inf")), id="constant-inf"),
        pytest.param(lambda: he.TableConfig("t", 10, 4, init="normal"), id="table-init-str"),
        pytest.param(lambda: he.TableConfig("t", 10, 4, init=None), id="table-init-none"),
        pytest.param(lambda: he.TableConfig("t", 10, 4, init=torch.nn.init.normal_), id="table-init-torch-fn"),
    ],
)
def test_bad_init_config_raises_config_error(build):
    with pytest.raises(he.ConfigError) as info:
        build()
    assert isinstance(info.value, ValueError) and isinstance(info.value, he.HybridEmbedError)
    assert str(info.value)


def test_init_is_frozen_and_readable():
    spec = he.init.normal(std=0.01)
    with pytest.raises(AttributeError):
        spec.std = 1.0  # type: ignore[misc]
    assert "normal" in repr(spec) and "0.01" in repr(spec)
    assert he.init.zeros() == he.init.constant(0.0)
    assert he.init.truncated_normal(a=-1, b=1).low == -1.0
