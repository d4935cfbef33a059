"""Trainers hold no table: 2 trainers whose memory is capped (``RLIMIT_DATA``) at a quarter of a
table's size train it on a parameter server (spawned gloo job). A model built on the meta
device allocates no rows anywhere but in the servers' shards, and trains as the real model.

The full-size figures: ``benchmarks/bench_ps_memory.py`` (docs/parameter_servers.md).
"""

from __future__ import annotations

import math
import resource
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import hybridembed as he
from hybridembed import init as _init
from hybridembed.distributed import unwrap
from hybridembed.launch import spawn
from hybridembed.ps import PSCollection

T = 2  # trainers
MIB = 1 << 20
LIMIT = 512 * MIB  # each trainer's data segment (a spawned torch + gloo trainer holds ~250 MiB at start)
DIM = 64
ROWS = 4 * LIMIT // (DIM * 4)  # a float32 table of 4x the limit

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA and /proc are Linux's")


def _kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _refusal(nbytes: int) -> str | None:
    try:
        x = torch.empty(nbytes, dtype=torch.uint8)
    except RuntimeError as e:  # (torch's allocator: "can't allocate memory")
        return str(e)
    del x
    return None


class Big(nn.Module):
    def __init__(self, rows: int, dim: int, device: str | None = "meta", init=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        t = he.TableConfig("big", rows, dim, combiner="mean", init=init or _init.uniform())
        self.ec = he.EmbeddingCollection([t], {"user": "big", "item": "big"}, seed=1, device=device)
        self.head = nn.Linear(2 * dim, 1)

    def forward(self, x):
        out = self.ec(x)
        return self.head(torch.cat([out["user"], out["item"]], 1)).squeeze(1)


def _batch(step: int, rows: int, lo: int = 0, hi: int = 8):
    g = torch.Generator().manual_seed(50 + step)
    x = {f: torch.randint(0, rows, (8, 3), generator=g)[lo:hi] for f in ("user", "item")}
    return x, torch.rand(8, generator=g)[lo:hi]


def _steps(model, opt, rows: int, lo: int, hi: int, k: int = 3) -> list[float]:
    losses = []
    for s in range(k):
        x, y = _batch(s, rows, lo, hi)
        loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _read(pc: PSCollection, ids: torch.Tensor) -> torch.Tensor:
    pc.eval()
    with torch.no_grad():
        rows = pc.lookup("user", ids.unsqueeze(1)).clone()  # (n, D): the servers' rows now
    pc.train()
    return rows


def _capped(rank: int, world: int) -> dict:
    out = {}
    if rank < T:
        out["free"] = _refusal(ROWS * DIM * 4)  # (None: nothing stops it before the cap)
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        out["before"] = _kib("VmData") * 1024
        resource.setrlimit(resource.RLIMIT_DATA, (LIMIT, hard))
        out["refusal"] = _refusal(ROWS * DIM * 4)
    model = he.distribute(Big(ROWS, DIM, init=_init.zeros()), servers=world - T, server_exit=False)
    if model is None:
        return {"server": True}
    pc = unwrap(model).ec
    opt = he.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.5), model)
    lo, hi = rank * 4, (rank + 1) * 4
    probe = _batch(0, ROWS, lo, hi)[0]["user"].reshape(-1)  # (12,) ids step 0 trains
    before = _read(pc, probe)
    out["losses"] = _steps(model, opt, ROWS, lo, hi)
    out["changed"] = bool((_read(pc, probe) != before).any(1).all())  # (a sync pull waits for every push)
    out["unchanged_zero"] = bool((before == 0).all())
    out["servers"] = pc.server_stats()
    out["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out["hwm"] = _kib("VmHWM") * 1024
    pc.close()
    return out


def test_trainers_capped_at_a_quarter_of_the_table_train_it_on_a_server():
    table = ROWS * DIM * 4
    results = spawn(_capped, T + 1, timeout=120)
    assert results[T] == {"server": True}
    for r in results[:T]:
        assert r["free"] is None and r["before"] < LIMIT  # the cap, not the machine, refuses the table:
        assert "can't allocate memory" in r["refusal"]
        assert all(math.isfinite(v) for v in r["losses"])
        assert r["unchanged_zero"] and r["changed"]  # the rows it trained moved on the server
        assert r["hwm"] < LIMIT < table and r["peak"] < table
        (s,) = r["servers"]
        assert s["errors"] == 0 and s["applied_steps"] == 3 and s["memory_bytes"] >= table


def _reference(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    model = Big(rows, 4, device=None)
    opt = he.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.5), model)
    _steps(model, opt, rows, 0, 8)
    return model.ec.weight("big").detach().clone(), model.head.weight.detach().clone()


def _meta_job(rank: int, world: int, rows: int) -> dict:
    model = he.distribute(Big(rows, 4), servers=world - T, server_exit=False)
    if model is None:
        return {}
    pc = unwrap(model).ec
    assert all(p.device.type == "cpu" for p in model.parameters())
    opt = he.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.5), model)
    _steps(model, opt, rows, rank * 4, (rank + 1) * 4)
    return {"table": pc.gather_table("big"), "head": unwrap(model).head.weight.detach().clone()}


def test_a_model_built_on_meta_trains_as_the_real_one():
    table, head = _reference(60)
    for r in spawn(_meta_job, T + 2, 60, timeout=120)[:T]:  # (the planner splits the table over both servers)
        torch.testing.assert_close(r["table"], table, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(r["head"], head, atol=1e-6, rtol=1e-5)


def test_a_meta_table_is_not_filled(monkeypatch):
    def fill(*args, **kwargs):
        raise AssertionError("a meta table has no rows to fill")

    monkeypatch.setattr(_init, "generate", fill)
    ec = he.EmbeddingCollection([he.TableConfig("huge", 1 << 40, 64)], device="meta")
    assert ec.weight("huge").shape == (1 << 40, 64) and ec.weight("huge").device.type == "meta"
