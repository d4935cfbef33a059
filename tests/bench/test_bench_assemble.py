"""``benchmarks/bench_assemble.py`` at a tiny size: both ways give the same rows and both are timed
(no timing is asserted)."""

from __future__ import annotations

import math

import pytest

from hybridembed.kernels import cpu_assemble
from tests.bench import load_script


def test_both_ways_run_on_both_hotness_levels_and_the_numba_pass_is_put_back():
    pytest.importorskip("numba")
    mod = load_script("bench_assemble")
    before = cpu_assemble.assemble
    runs = mod.main(["--tables", "3", "--rows", "500", "--dim", "8", "--batch", "64", "--steps", "2"])
    assert cpu_assemble.assemble is before
    assert {r["hotness"] for r in runs} == {"one", "multi"}
    for r in runs:
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("numba_ms", "eager_ms"))
