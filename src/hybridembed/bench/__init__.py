"""Benchmark workloads and timing (the ``hybridembed bench`` command builds on these)."""

from .timing import Timing, add_allocator_option, apply_allocator_option, powerlaw_ids, time_interleaved

__all__ = ["Timing", "add_allocator_option", "apply_allocator_option", "powerlaw_ids", "time_interleaved"]
