"""AUC (rank-based, ties averaged) against the brute-force pairwise definition; log loss.

python -m pytest -q tests/train/test_metrics.py
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hybridembed.train.metrics import auc, auc_bruteforce, log_loss


@pytest.mark.parametrize("seed", range(6))
def test_auc_matches_bruteforce_with_ties(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 400, (1,), generator=g))
    levels = [2, 5, 50, 10_000][seed % 4]  # few distinct scores: many ties
    scores = torch.randint(0, levels, (n,), generator=g).float() / levels
    labels = (torch.rand(n, generator=g) < 0.3).long()
    labels[0], labels[1] = 0, 1  # both classes present
    assert auc(scores, labels) == pytest.approx(auc_bruteforce(scores, labels), abs=1e-12)


def test_auc_edge_cases():
    assert auc(torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0, 1, 1])) == 1.0
    assert auc(torch.tensor([0.3, 0.2, 0.1]), torch.tensor([0, 1, 1])) == 0.0
    assert auc(torch.full((10,), 0.5), torch.tensor([0, 1] * 5)) == 0.5  # all tied
    assert math.isnan(auc(torch.tensor([0.1, 0.2]), torch.tensor([1, 1])))  # one class only
    assert auc(torch.tensor([-3.0, 7.0]), torch.tensor([0.0, 1.0])) == 1.0  # logits and float labels
    with pytest.raises(ValueError):
        auc(torch.zeros(3), torch.zeros(4))


def test_auc_is_invariant_to_monotone_maps():
    g = torch.Generator().manual_seed(0)
    s, y = torch.randn(1000, generator=g), (torch.rand(1000, generator=g) < 0.2).long()
    assert auc(s, y) == pytest.approx(auc(torch.sigmoid(3 * s + 1), y), abs=1e-12)


def test_log_loss_is_bce_with_logits():
    x, y = torch.tensor([-2.0, 0.5, 3.0]), torch.tensor([0.0, 1.0, 1.0])
    assert log_loss(x, y) == pytest.approx(F.binary_cross_entropy_with_logits(x, y).item(), rel=1e-6)
