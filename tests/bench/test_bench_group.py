"""``benchmarks/bench_group.py`` at a tiny size: both hotness levels run, the counting sort is taken
where the batch has many ids for its rows and not where it has few (no timing is asserted)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_group.py"


def test_both_hotness_levels_run_and_take_the_counting_where_it_pays():
    pytest.importorskip("numba")
    spec = importlib.util.spec_from_file_location("bench_group", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    runs = mod.main(["--tables", "2", "--rows", "1000", "--batch", "4096", "--dim", "8", "--steps", "1"])
    by = {r["hotness"]: r for r in runs}
    assert by["multi"]["counting_taken"] and not by["one"]["counting_taken"]
    for r in runs:
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("counted_ms", "sorted_ms"))
