"""``benchmarks/bench_assemble.py`` at a tiny size: both ways give the same rows and both are timed
(no timing is asserted)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from hybridembed.kernels import cpu_assemble

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_assemble.py"


def test_both_ways_run_on_both_hotness_levels_and_the_numba_pass_is_put_back():
    pytest.importorskip("numba")
    spec = importlib.util.spec_from_file_location("bench_assemble", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    before = cpu_assemble.assemble
    runs = mod.main(["--tables", "3", "--rows", "500", "--dim", "8", "--batch", "64", "--steps", "2"])
    assert cpu_assemble.assemble is before
    assert {r["hotness"] for r in runs} == {"one", "multi"}
    for r in runs:
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("numba_ms", "eager_ms"))
