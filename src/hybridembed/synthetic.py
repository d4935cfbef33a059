"""Synthetic ids: the power law of NVIDIA's synthetic recommendation models.

Shared by the benchmarks (:mod:`hybridembed.bench`) and the generated Criteo-format data of
``hybridembed train`` (:func:`hybridembed.train.data.generate_criteo`), so neither package
imports the other for it.

    >>> import torch
    >>> ids = powerlaw_ids(1000, 50, generator=torch.Generator().manual_seed(0))
    >>> bool(ids.min() >= 0 and ids.max() < 50), int((ids == 0).sum()) > int((ids == 49).sum())
    (True, True)
"""

from __future__ import annotations

import torch

__all__ = ["powerlaw_ids"]


def powerlaw_ids(n: int, rows: int, alpha: float = 1.05, generator: torch.Generator | None = None) -> torch.Tensor:
    """(n,) int64 ids in [0, rows) from the power law of NVIDIA's synthetic models.

    ``y = (r * (kmax^g - kmin^g) + kmin^g)^(1/g) - 1`` with ``g = 1 - alpha``, ``kmin = 1``,
    ``kmax = rows + 1`` and ``r`` uniform in [0, 1): id 0 is the most frequent.
    """
    g = 1.0 - alpha
    r = torch.rand(n, dtype=torch.float64, generator=generator)
    y = (r * ((rows + 1) ** g - 1.0) + 1.0) ** (1.0 / g) - 1.0
    return y.long().clamp_(0, rows - 1)
