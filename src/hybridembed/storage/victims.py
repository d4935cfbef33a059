"""A tiered cache's least recently used victims (:class:`~hybridembed.storage.tiered.TieredStorage`):
one Numba pass where Numba imports (:mod:`hybridembed.kernels._numba_victims`), else torch ops
choosing the same slots in the same order."""

from __future__ import annotations

import functools

import torch

__all__ = ["least_recent"]


@functools.cache
def _kernel():
    try:
        from ..kernels import _numba_victims as K
    except Exception:  # (ImportError, or a Numba that does not match this NumPy)
        return None
    return K


def least_recent(
    last_used: torch.Tensor, taken: torch.Tensor, protect: torch.Tensor, k: int, now: int
) -> tuple[torch.Tensor | None, int]:
    """The ``k`` slots of smallest ``last_used`` (C,) int64 among those ``taken`` (C,) int64 (>= 0:
    a row is there) and not ``protect`` (C,) bool: those below the k-th value in slot order, then
    the k-th value's in slot order. Returns (them (k,), the eligible slots' count); (None, count)
    where fewer than ``k`` (>= 1) are eligible. ``now``: the largest ``last_used`` may be."""
    K = _kernel()
    if K is not None:
        out = torch.empty(k, dtype=torch.int64)
        n = K.least_recent(last_used.numpy(), taken.numpy(), protect.numpy(), k, now, out.numpy())
        if n >= 0:
            return (out if n >= k else None), n
    cand = ((taken >= 0) & ~protect).nonzero().squeeze(1)
    if cand.numel() < k:
        return None, cand.numel()
    used = last_used.index_select(0, cand)
    kth = torch.kthvalue(used, k).values
    below, tied = (used < kth).nonzero().squeeze(1), (used == kth).nonzero().squeeze(1)
    return cand.index_select(0, torch.cat([below, tied[: k - below.numel()]])), cand.numel()
