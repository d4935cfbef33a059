"""``benchmarks/bench_group.py`` at a tiny size: both hotness levels run, the counting sort is taken
where the batch has many ids for its rows and not where it has few (no timing is asserted)."""

from __future__ import annotations

import math

import pytest

from tests.bench import load_script


def test_both_hotness_levels_run_and_take_the_counting_where_it_pays():
    pytest.importorskip("numba")
    mod = load_script("bench_group")
    runs = mod.main(["--tables", "2", "--rows", "1000", "--batch", "4096", "--dim", "8", "--steps", "1"])
    by = {r["hotness"]: r for r in runs}
    assert by["multi"]["counting_taken"] and not by["one"]["counting_taken"]
    for r in runs:
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("counted_ms", "sorted_ms"))
