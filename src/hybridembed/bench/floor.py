"""The byte floor of an embedding training step: the bytes that must cross the memory bus at
least once, over a measured copy bandwidth (``benchmarks/bench_step.py`` on the CPU and
``benchmarks/bench_gpu.py`` on a GPU report each step's time against it).

Byte model (float32 rows of 4 D bytes, int64 ids of 8 bytes; N ids in the batch, U distinct
(table, id) pairs, T tables, B bags a table):

- forward = ids 8 N + offsets 8 T (B + 1) + distinct rows read 4 D U + pooled output 4 D T B
  (+ dynamic tables: one 16-byte index entry a distinct id, 16 U);
- update = ids 8 N + upstream gradient rows read 4 D T B + distinct rows read and written
  2 * 4 D U + optimizer state read and written 2 * (its bytes a row) * U (+ dynamic: 16 U);
- step = forward + update.

Repeated ids are counted once (a kernel may serve them from cache); gradients reduced per
distinct row are not counted as a round trip (a fused kernel keeps them in registers or cache).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from .timing import device_sync

__all__ = ["copy_bandwidth", "step_bytes"]


def copy_bandwidth(device: torch.device | str, mib: int, rounds: int) -> float:
    """Bytes a second of ``dst.copy_(src)`` of ``mib`` MiB: (read + written) / median time (on the
    CPU, on torch's threads)."""
    n = mib * 2**20 // 4
    src, dst = torch.rand(n, device=device), torch.empty(n, device=device)
    dst.copy_(src)  # warm-up (first touch of the pages)
    sync = device_sync(device)
    times = []
    for _ in range(max(rounds, 3)):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return 2 * n * 4 / times[len(times) // 2]


def step_bytes(batch: Mapping, bags: int, dim: int, state_bytes_per_row: int, dynamic: bool = False) -> dict[str, int]:
    """The floor's bytes (module docstring) of one step on ``batch`` (feature -> Jagged of ``bags``
    bags, one table each): ids, distinct rows, forward, update, step."""
    t = len(batch)
    n = sum(int(j.values.numel()) for j in batch.values())
    u = sum(int(torch.unique(j.values).numel()) for j in batch.values())
    row = 4 * dim
    index = 16 * u if dynamic else 0
    forward = 8 * n + 8 * t * (bags + 1) + row * u + row * t * bags + index
    update = 8 * n + row * t * bags + 2 * row * u + 2 * state_bytes_per_row * u + index
    return {"ids": n, "distinct_rows": u, "forward": forward, "update": update, "step": forward + update}
