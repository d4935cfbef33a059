"""``he.distribute`` of a model built whole on each rank keeps the rank's shards alone: the
whole tables are freed (and handed back to the system) before it returns, and its peak is
about the model plus the shards (never a second copy of the tables).

    python -m pytest -q tests/distributed/test_distribute_memory.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import hybridembed as he
from hybridembed.distributed import unwrap
from hybridembed.launch import spawn

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux)")

T, R, D = 4, 1_000_000, 32  # 512 MiB of tables
SLACK = 200 << 20  # the process's own growth (process groups, DDP, imports), not the tables


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _rank(rank: int, world: int) -> dict:
    base = _status("VmRSS:")
    torch.manual_seed(0)
    model = nn.ModuleDict({f"t{i}": nn.EmbeddingBag(R, D, mode="sum") for i in range(T)})
    model.top = nn.Linear(T * D, 1)
    want = model["t1"].weight.detach()[rank::world].clone()  # (a row-wise plan's rows here, if row-wise)
    model = he.distribute(model)
    after, peak = _status("VmRSS:"), _status("VmHWM:")
    ec = unwrap(model)["t0"].hybridembed
    shards = sum(st.weight.numel() * st.weight.element_size() for st in ec.storages)
    got = ec.gather_table("t1")
    extra = want.numel() * 4  # (the check's own copy, made before)
    return {
        "base": base + extra,
        "after": after,
        "peak": peak,
        "shards": shards,
        "rows_ok": bool(torch.equal(got[rank::world], want)),
    }


def test_a_rank_keeps_its_shards_alone_and_never_holds_the_tables_twice():
    tables = T * R * D * 4
    for r in spawn(_rank, 2, timeout=240):
        assert r["rows_ok"]  # (the shards hold the model's rows)
        assert r["after"] - r["base"] <= r["shards"] + SLACK, (r["after"] - r["base"]) / 2**20
        assert r["peak"] - r["base"] <= tables + r["shards"] + SLACK, (r["peak"] - r["base"]) / 2**20
