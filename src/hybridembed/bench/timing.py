"""Interleaved timing and the allocator option shared by ``benchmarks/`` and ``hybridembed bench``
(with :func:`~hybridembed.synthetic.powerlaw_ids`, the workloads' ids).

On CUDA a call is timed from an idle device to an idle device: ``torch.cuda.synchronize``
before the clock starts and before it stops (kernels run asynchronously; without it the clock
measures the launches only). Every contender pays the same two syncs per call.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..synthetic import powerlaw_ids
from ..utils import allocator_tuned, get_logger, tune_cpu_allocator

__all__ = [
    "powerlaw_ids",
    "Timing",
    "time_interleaved",
    "device_sync",
    "add_allocator_option",
    "apply_allocator_option",
]

log = get_logger(__name__)


def add_allocator_option(parser: argparse.ArgumentParser) -> None:
    """``--tune-allocator`` / ``--no-tune-allocator``, as every benchmark takes it (apply it with
    :func:`apply_allocator_option`)."""
    parser.add_argument(
        "--tune-allocator",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="default: as 'import hybridembed' left glibc's allocator (tuned, unless "
        "HYBRIDEMBED_TUNE_ALLOCATOR=0 was set); --tune-allocator: call hybridembed.tune_cpu_allocator(); "
        "--no-tune-allocator: do not (glibc's own thresholds need HYBRIDEMBED_TUNE_ALLOCATOR=0 in the "
        "environment, as the import tunes them otherwise). It affects every contender alike",
    )


def apply_allocator_option(args: argparse.Namespace) -> bool:
    """Applies ``--tune-allocator``; returns whether glibc's allocator is tuned for this run.

    ``--no-tune-allocator`` cannot undo the tuning ``import hybridembed`` did (glibc has no way
    back to its adaptive thresholds), so it warns and says how to opt out instead.
    """
    if args.tune_allocator:
        tune_cpu_allocator()
    elif args.tune_allocator is False and allocator_tuned():
        log.warning(
            "--no-tune-allocator: the allocator was already tuned when hybridembed was imported; "
            "set HYBRIDEMBED_TUNE_ALLOCATOR=0 in the environment to run with glibc's defaults"
        )
    return allocator_tuned()


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


def device_sync(device: torch.device | str | None) -> Callable[[], None]:
    """What waits for ``device`` to finish its queued work: ``torch.cuda.synchronize`` on a CUDA
    device, nothing on the CPU (its ops return when done)."""
    dev = torch.device(device if device is not None else "cpu")
    if dev.type == "cuda":
        return lambda: torch.cuda.synchronize(dev)
    return lambda: None


def time_interleaved(
    fns: Mapping[str, Callable[[], object]], steps: int = 10, warmup: int = 2, device: torch.device | str | None = None
) -> dict[str, Timing]:
    """Times each callable ``steps`` times, round-robin so machine noise hits all alike.

    Warm-up calls are excluded; report medians. ``device``: where the callables run; on CUDA
    each call is timed between two synchronizations (:func:`device_sync`).
    """
    sync = device_sync(device)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(steps):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {k: Timing(k, v) for k, v in times.items()}
