"""The records index of dynamic tiered tables (``storage/records.py``) against a Python dict: in
memory and in mapped files, batches written position by position or a span at a time (the next
span read ahead), rebuilds in one pass or a window at a time."""

from __future__ import annotations

import pytest
import torch

from hybridembed.kernels import cpu_hash
from hybridembed.storage import mapped as mapped_files
from hybridembed.storage import records


def _pairs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(-(2**62), 2**62, (n,), generator=g)
    keys[: n // 4] = torch.arange(n // 4)  # (small ids, in three tables: pairs that share an id)
    return keys, torch.randint(0, 3, (n,), generator=g, dtype=torch.int32)


@pytest.mark.parametrize("mapped", [False, True], ids=["memory", "mapped"])
@pytest.mark.parametrize("spans", [False, True], ids=["one-pass", "spans"])
@pytest.mark.parametrize("recent", [0, 1000], ids=["merged-at-once", "recent-kept"])
@pytest.mark.parametrize("kernels", ["auto", "eager"])
def test_the_index_finds_every_record_it_was_given_and_no_other(tmp_path, monkeypatch, mapped, spans, recent, kernels):
    """``kernels``: the Numba loops (no claim array beside the positions) or, as without Numba, the
    torch ops (a claim a position)."""
    monkeypatch.setattr(records.Homes, "kernels", kernels)
    if spans:  # (writes and rebuilds a span of 64 positions at a time)
        monkeypatch.setattr(records.Homes, "_WINDOW_BYTES", 64 * records.Homes._BYTES)
    # (records made since the last rebuild kept in memory until there are 1,000, or written at once)
    monkeypatch.setattr(records.Homes, "_RECENT", recent or 1)
    ahead = []
    monkeypatch.setattr(records, "willneed", lambda t: ahead.append(t.numel()) or mapped_files.willneed(t))
    h = records.Homes()
    h.where = tmp_path if mapped else None
    keys, tabs = _pairs(6000, 0)
    pairs, kept = {}, []
    for lo, hi in ((0, 1), (1, 700), (700, 710), (710, 4000), (4000, 6000)):  # (batches large and small)
        got = h.add(keys[lo:hi], tabs[lo:hi])
        assert torch.equal(got, torch.arange(len(pairs), len(pairs) + hi - lo))
        pairs.update({(int(k), int(t)): r for k, t, r in zip(keys[lo:hi], tabs[lo:hi], got.tolist())})
        seen = h.lookup(keys[:hi], tabs[:hi])
        assert seen.tolist() == [pairs[(int(k), int(t))] for k, t in zip(keys[:hi], tabs[:hi])]
        kept.append(h.n - h._merged)
        assert (h.recent_bytes > 0) == (kept[-1] > 0)  # (counted in the table's memory_bytes)
    other, otabs = _pairs(3000, 1)
    absent = torch.tensor([(int(k), int(t)) not in pairs for k, t in zip(other, otabs)])
    assert absent.sum() > 2000 and (h.lookup(other[absent], otabs[absent]) == -1).all()
    assert (h.lookup(keys[:100], (tabs[:100] + 1) % 3) == -1).sum() >= 75  # (an id of another table)
    assert bool(ahead) == (mapped and spans)  # (the spans read ahead only in mapped files)
    assert (max(kept) > 0) == (mapped and recent > 0), kept  # (in memory: every record in the index at once)
    numba = kernels == "auto" and cpu_hash.runs_on("auto", h.weight)
    assert h._claim.numel() == (0 if numba else h._mask + 1)


def test_willneed_takes_any_part_of_a_mapping_and_a_tensor_in_memory(tmp_path):
    t = mapped_files.mapped(tmp_path, (10_000, 2), torch.int64, -1, random=True)
    for part in (t, t[1:2], t[5000:], t[:0], torch.zeros(3)):  # (unaligned starts; not a mapping: a lost hint)
        mapped_files.willneed(part)
    assert (t == -1).all()
