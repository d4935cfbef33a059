"""Metrics of ``hybridembed train``: ROC AUC (rank-based, ties averaged) and log loss.

    python -m pytest -q tests/train/test_metrics.py

Shape legend: ``N`` examples.

    >>> import torch
    >>> auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]))
    0.75
    >>> auc(torch.tensor([0.5, 0.5]), torch.tensor([0, 1]))  # a tie counts one half
    0.5
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["auc", "auc_bruteforce", "log_loss"]


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve: P(score of a random positive > score of a random negative),
    ties counting one half. NaN when either class is absent.

    Mann-Whitney U from average ranks: sort once (N log N), give tied scores the mean of
    their ranks, then ``(sum of positive ranks - P (P + 1) / 2) / (P N)``. Computed in
    float64, so it is exact for any N that fits in memory.
    """
    s = scores.detach().reshape(-1).double()  # (N,)
    y = labels.detach().reshape(-1).bool()  # (N,)
    if s.shape != y.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and labels {tuple(labels.shape)} differ in size")
    pos = int(y.sum())
    neg = y.numel() - pos
    if pos == 0 or neg == 0:
        return math.nan
    sorted_s, order = torch.sort(s)
    _, inverse, counts = torch.unique_consecutive(sorted_s, return_inverse=True, return_counts=True)
    last = torch.cumsum(counts, 0).double()  # (G,) 1-based rank of each tie group's last member
    avg_rank = last - (counts.double() - 1) / 2  # (G,) mean rank within the group
    ranks = avg_rank[inverse]  # (N,) in sorted order
    rank_sum = ranks[y[order]].sum().item()
    return (rank_sum - pos * (pos + 1) / 2) / (pos * neg)


def auc_bruteforce(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """The O(P N) definition, for tests: mean over (positive, negative) pairs of
    ``1[s+ > s-] + 0.5 * 1[s+ == s-]``."""
    s = scores.reshape(-1).double()
    y = labels.reshape(-1).bool()
    p, n = s[y], s[~y]
    if p.numel() == 0 or n.numel() == 0:
        return math.nan
    diff = p[:, None] - n[None, :]  # (P, N)
    return ((diff > 0).double() + 0.5 * (diff == 0).double()).mean().item()


def log_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean binary cross-entropy of logits (the training loss), in float64."""
    return F.binary_cross_entropy_with_logits(logits.double().reshape(-1), labels.double().reshape(-1)).item()
