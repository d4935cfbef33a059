"""A tiered cache's least recently used victims (``storage/victims.py``): the Numba pass and the
torch ops choose the same slots in the same order, the k smallest ``last_used`` of the eligible."""

from __future__ import annotations

import pytest
import torch

from hybridembed.storage import victims as V


def _reference(last_used, taken, protect, k):
    """By sorting: eligible slots ordered by (last_used, slot), the first k; then below the k-th
    value in slot order, the k-th value's in slot order."""
    elig = [s for s in range(last_used.numel()) if taken[s] >= 0 and not protect[s]]
    if len(elig) < k:
        return None, len(elig)
    chosen = sorted(elig, key=lambda s: (int(last_used[s]), s))[:k]
    kth = int(last_used[chosen[-1]])
    below = sorted(s for s in chosen if last_used[s] < kth)
    return below + sorted(s for s in chosen if last_used[s] == kth), len(elig)


@pytest.mark.parametrize("numba", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_the_k_least_recent_eligible_slots_in_slot_order_both_ways(seed, numba, monkeypatch):
    if numba and V._kernel() is None:
        pytest.skip("Numba does not import here")
    if not numba:
        monkeypatch.setattr(V, "_kernel", lambda: None)
    g = torch.Generator().manual_seed(seed)
    c = int(torch.randint(1, 400, (1,), generator=g))
    now = int(torch.randint(0, 50, (1,), generator=g)) if seed % 2 else 10**9  # (few values: ties; or far apart)
    last_used = torch.randint(0, now + 1, (c,), generator=g, dtype=torch.int64)
    taken = torch.where(torch.rand(c, generator=g) < 0.2, -1, torch.arange(c)).to(torch.int64)
    protect = torch.rand(c, generator=g) < 0.3
    for k in (1, max(1, c // 7), c // 2 + 1, c):
        got, n = V.least_recent(last_used, taken, protect, k, now)
        want, n_want = _reference(last_used, taken, protect, k)
        assert n == n_want
        assert (got is None and want is None) or got.tolist() == want, (k, got, want)
