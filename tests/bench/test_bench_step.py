"""``benchmarks/bench_step.py`` at a tiny size, and the byte floor it reports
(``hybridembed.bench.floor``) against a count by hand (no timing is asserted)."""

from __future__ import annotations

import math

import torch

import hybridembed as he
from hybridembed.bench.floor import copy_bandwidth, step_bytes
from tests.bench import load_script


def test_step_bytes_counts_each_part_by_hand():
    batch = {
        "a": he.Jagged.from_lengths(torch.tensor([3, 3, 5, 7]), torch.tensor([1, 2, 0, 1])),  # 4 ids, 3 distinct
        "b": he.Jagged.from_lengths(torch.tensor([1, 2]), torch.tensor([0, 1, 1, 0])),  # 2 ids, 2 distinct
    }
    got = step_bytes(batch, 4, 8, state_bytes_per_row=4)
    n, u, t, b, row = 6, 5, 2, 4, 32
    forward = 8 * n + 8 * t * (b + 1) + row * u + row * t * b
    update = 8 * n + row * t * b + 2 * row * u + 2 * 4 * u
    assert got == {"ids": n, "distinct_rows": u, "forward": forward, "update": update, "step": forward + update}
    assert step_bytes(batch, 4, 8, 4, dynamic=True)["step"] == forward + update + 2 * 16 * u


def test_copy_bandwidth_is_a_rate():
    assert 1e6 < copy_bandwidth("cpu", 4, 3) < 1e13


def test_the_step_runs_and_reports_its_floor():
    mod = load_script("bench_step")
    res = mod.main(["--tables", "3", "--rows", "500", "--dim", "8", "--batch", "32", "--steps", "2"])
    bw = res["copy_bandwidth_bytes_per_s"]
    assert {(r["optimizer"], r["hotness"]) for r in res["runs"]} == {
        (o, h) for o in ("sgd", "rowwise_adagrad") for h in ("one", "multi")
    }
    for r in res["runs"]:
        assert math.isclose(r["floor_ms"], r["floor_bytes"] / bw * 1e3)
        for k in ("hybridembed", "per_table"):
            assert math.isclose(r[f"{k}_fraction_of_floor"], r["floor_ms"] / r[f"{k}_ms"])
