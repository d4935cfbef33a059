"""``hybridembed train --nproc N``: the rank-aware pieces of the command (one process: no-ops).

    python -m pytest -q tests/train/test_train_nproc.py

Shape legend: ``B`` global batch, ``N`` world size, ``E`` evaluated examples.

Every rank reads the same batches and trains on its slice of each: rank ``r`` takes rows
``[r B / N, (r + 1) B / N)``, so world N sees the same data per step as world 1 with the same
``--batch-size``. Its loss is the slice's summed loss times ``N / B``: DDP's (and the sharded
tables') mean over the ranks then equals world 1's mean over the whole batch, also when the
slices differ in size. Predictions are gathered for AUC; counters are summed. A :class:`Job`
of one rank does none of this, so ``--nproc 1`` is the one-process command unchanged.

With parameter servers (``--servers S``) the job's ranks are the ``N - S`` trainers: ``group``
is their process group (the servers take no part in the trainers' collectives).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..utils import get_logger
from .data import Batch

__all__ = ["ONE", "Job"]


@dataclass(frozen=True)
class Job:
    """This process's place in the job: ``rank`` of ``world`` (1: one process, no collectives),
    whose collectives run over ``group`` (None: the whole job; the trainers' group with servers)."""

    rank: int = 0
    world: int = 1
    group: Any = None

    @property
    def main(self) -> bool:
        """Rank 0: the one that prints."""
        return self.rank == 0

    @property
    def parallel(self) -> bool:
        return self.world > 1

    def part(self, b: Batch) -> Batch:
        """This rank's rows ``[r B / N, (r + 1) B / N)`` of a global batch ``b`` (all of it at world 1)."""
        if self.world == 1:
            return b
        n = len(b)
        lo, hi = self.rank * n // self.world, (self.rank + 1) * n // self.world
        return Batch(b.dense[lo:hi], b.sparse[lo:hi], b.label[lo:hi])

    def sum(self, *values: float) -> list[float]:
        """``values`` summed over the ranks (float64; the values themselves at world 1)."""
        return self._reduce(values, dist.ReduceOp.SUM)

    def max(self, *values: float) -> list[float]:
        return self._reduce(values, dist.ReduceOp.MAX)

    def _reduce(self, values: tuple[float, ...], op) -> list[float]:
        if self.world == 1:
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=op, group=self.group)
        return t.tolist()

    def gather(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Each (E_r,) tensor of this rank -> (sum E_r,) of every rank, in rank order, on every rank.

        One all_gather of the lengths, then one per tensor padded to the longest.
        """
        if self.world == 1:
            return list(tensors)
        n = torch.tensor([tensors[0].shape[0]], dtype=torch.int64)
        sizes = [torch.zeros_like(n) for _ in range(self.world)]
        dist.all_gather(sizes, n, group=self.group)
        lengths = [int(s) for s in sizes]
        longest = max(lengths)
        out = []
        for t in tensors:
            padded = t.new_zeros(longest)  # (max E_r,)
            padded[: t.shape[0]] = t
            parts = [torch.zeros_like(padded) for _ in range(self.world)]
            dist.all_gather(parts, padded, group=self.group)
            out.append(torch.cat([p[:k] for p, k in zip(parts, lengths)]))
        return out

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(self.group)


_log = get_logger("hybridembed.train")
ONE = Job()  # one process: every method a no-op
