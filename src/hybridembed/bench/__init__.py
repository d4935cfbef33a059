"""Benchmark workloads and timing (the ``hybridembed bench`` command builds on these)."""

from .timing import Timing, powerlaw_ids, time_interleaved

__all__ = ["Timing", "powerlaw_ids", "time_interleaved"]
