"""Interleaved timing and the allocator option shared by ``benchmarks/`` and ``hybridembed bench``
(with :func:`~hybridembed.synthetic.powerlaw_ids`, the workloads' ids)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..synthetic import powerlaw_ids

__all__ = ["powerlaw_ids", "Timing", "time_interleaved", "add_allocator_option"]


def add_allocator_option(parser: argparse.ArgumentParser) -> None:
    """``--tune-allocator`` / ``--no-tune-allocator`` (default on), as every benchmark takes it."""
    parser.add_argument(
        "--tune-allocator",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="call hybridembed.tune_cpu_allocator() first, so glibc reuses large blocks (default on; "
        "it affects every contender alike); --no-tune-allocator keeps glibc's defaults",
    )


@dataclass
class Timing:
    name: str
    times_ms: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def spread(self) -> float:
        """Half the interquartile range, in ms."""
        if len(self.times_ms) < 4:
            return (max(self.times_ms) - min(self.times_ms)) / 2
        q = statistics.quantiles(self.times_ms, n=4)
        return (q[2] - q[0]) / 2

    def record(self, batch: int) -> dict[str, Any]:
        """The JSON fields every benchmark reports for one contender."""
        return {
            "median_ms": self.median,
            "spread_ms": self.spread,
            "min_ms": min(self.times_ms),
            "times_ms": self.times_ms,
            "samples_per_s": batch / (self.median / 1e3),
        }


def time_interleaved(fns: Mapping[str, Callable[[], object]], steps: int = 10, warmup: int = 2) -> dict[str, Timing]:
    """Times each callable ``steps`` times, round-robin so machine noise hits all alike.

    Warm-up calls are excluded; report medians.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(steps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {k: Timing(k, v) for k, v in times.items()}
