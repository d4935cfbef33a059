"""Trainers under a memory limit train a table 4x larger than the limit, held by parameter servers.

    PYTHONPATH=src python benchmarks/bench_ps_memory.py --limit-mib 512 --servers 2 --json ps_memory.json

A spawned gloo job of ``--trainers`` trainers and ``--servers`` servers. Every rank builds the
model with its :class:`~hybridembed.EmbeddingCollection` on the meta device (no rows), so
``he.distribute(model, servers=S)`` makes each server only its shards and each trainer none.
Each trainer first caps its own data segment (``resource.setrlimit(RLIMIT_DATA)``: every
private writable mapping, i.e. all it mallocs, counts, touched or not) at ``--limit-mib``, and
shows the cap holds: allocating a tensor of the table's size in that process raises. Then it
trains ``--steps`` synchronous steps (SGD: no optimizer state beside the rows) on random ids
drawn from the whole table, and reports its peak resident memory (``ru_maxrss`` and the
process's own ``VmHWM``), the servers' ``memory_bytes`` and whether the rows it trained changed
on the servers (read back through lookups: the whole table would not fit in a trainer).
``RLIMIT_AS`` is not used: torch and gloo reserve gigabytes of address space they never touch.
Linux only (``/proc/self/status``, ``RLIMIT_DATA`` counting mmaps: Linux >= 4.7).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import time
from pathlib import Path

import torch
from torch import nn

import hybridembed as he
from hybridembed.distributed import unwrap
from hybridembed.launch import spawn

MIB = 1 << 20


def _status_kib(key: str) -> int:
    """A ``/proc/self/status`` figure of this process (``VmData``, ``VmHWM``, ...), KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def cap_data(limit_bytes: int) -> int:
    """Cap this process's data segment at ``limit_bytes`` (soft limit; the hard one unchanged
    unless lower). Returns the bytes it held before (``VmData``)."""
    held = _status_kib("VmData") * 1024
    if held >= limit_bytes:
        raise SystemExit(f"this process already holds {held / MIB:.0f} MiB of data; raise the limit above it")
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (limit_bytes, hard))
    return held


def refuses(nbytes: int) -> str | None:
    """The error allocating ``nbytes`` in this process raises (None: it did not refuse)."""
    try:
        x = torch.empty(nbytes, dtype=torch.uint8)
    except (RuntimeError, MemoryError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    del x
    return None


def peak_rss() -> dict:
    """This process's peak resident memory: ``ru_maxrss`` (which, after a fork and exec, also
    remembers the parent's resident set at the fork) and ``VmHWM`` (this image's own), bytes."""
    return {
        "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "vm_hwm_bytes": _status_kib("VmHWM") * 1024,
    }


class Model(nn.Module):
    """One big table (two features read it) and a linear head; the table built on ``device``."""

    def __init__(self, rows: int, dim: int, device: str | None = "meta") -> None:
        super().__init__()
        torch.manual_seed(0)
        table = he.TableConfig("big", rows, dim, combiner="mean")
        self.ec = he.EmbeddingCollection([table], {"user": "big", "item": "big"}, seed=1, device=device)
        self.head = nn.Linear(2 * dim, 1)

    def forward(self, x: dict) -> torch.Tensor:
        out = self.ec(x)
        return self.head(torch.cat([out["user"], out["item"]], 1)).squeeze(1)  # (B,)


def batch(step: int, rows: int, size: int, lo: int, hi: int) -> tuple[dict, torch.Tensor]:
    """Global batch ``step`` (ids uniform over the table, 4 per bag), rows ``lo:hi`` of it."""
    g = torch.Generator().manual_seed(1000 + step)
    x = {f: torch.randint(0, rows, (size, 4), generator=g)[lo:hi] for f in ("user", "item")}
    return x, torch.rand(size, generator=g)[lo:hi]


def read_rows(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the table as the servers hold them now (an evaluation lookup)."""
    pc = unwrap(model).ec
    was = pc.training
    pc.eval()
    with torch.no_grad():
        rows = pc.lookup("user", ids.unsqueeze(1)).clone()  # (n, D): one id per bag
    pc.train(was)
    return rows


def job(rank: int, world: int, trainers: int, limit: int, rows: int, dim: int, steps: int, size: int) -> dict:
    """One rank: a trainer caps its memory, shows the table cannot be allocated, trains; a
    server serves (unlimited) and reports its own peak."""
    table_bytes = rows * dim * 4
    out: dict = {"rank": rank}
    if rank < trainers:
        out["table_allocation_error_without_limit"] = refuses(table_bytes)  # (None: untouched pages, overcommit)
        out["data_before_limit_bytes"] = cap_data(limit)
        out["table_allocation_error"] = refuses(table_bytes)
    t0 = time.perf_counter()
    model = he.distribute(Model(rows, dim), servers=world - trainers, server_exit=False)
    if model is None:  # (a server: returns once every trainer has left)
        return out | {"role": "server", "serve_s": time.perf_counter() - t0} | peak_rss()
    out["distribute_s"] = time.perf_counter() - t0
    opt = he.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.5), model)
    per = size // trainers
    lo, hi = rank * per, (rank + 1) * per
    probe = batch(0, rows, size, lo, hi)[0]["user"][:, 0]  # ids step 0 trains
    before = read_rows(model, probe)
    losses = []
    t0 = time.perf_counter()
    for s in range(steps):
        x, y = batch(s, rows, size, lo, hi)
        loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    train_s = time.perf_counter() - t0
    after = read_rows(model, probe)  # (a synchronous pull waits for every trainer's pushes of the steps before)
    pc = unwrap(model).ec
    servers = pc.server_stats()
    pc.close()
    kept = ("memory_bytes", "pulled_rows", "pushed_rows", "applied_steps", "errors")
    out.update(peak_rss())
    out.update(
        role="trainer",
        losses=losses,
        train_s=train_s,
        probe_rows=probe.numel(),
        probe_rows_changed=int((before != after).any(1).sum()),
        data_at_end_bytes=_status_kib("VmData") * 1024,
        servers=[{k: s[k] for k in kept if k in s} for s in servers],
    )
    return out


def run(trainers: int, servers: int, limit: int, factor: int, dim: int, steps: int, size: int) -> dict:
    rows = math.ceil(factor * limit / (dim * 4))
    t0 = time.perf_counter()
    results = spawn(
        job,
        trainers + servers,
        trainers,
        limit,
        rows,
        dim,
        steps,
        size,
        timeout=1800,
        pg_timeout=900,
        start_method="spawn",  # (each rank's memory its own: no pages shared with a forkserver)
    )
    return {
        "trainers": trainers,
        "servers": servers,
        "limit_bytes": limit,
        "table_rows": rows,
        "table_dim": dim,
        "table_bytes": rows * dim * 4,
        "table_over_limit": rows * dim * 4 / limit,
        "steps": steps,
        "global_batch": size,
        "wall_s": time.perf_counter() - t0,
        "ranks": results,
    }


def check(res: dict) -> list[str]:
    """What failed (empty: the trainers could not hold the table, trained, and stayed under the limit)."""
    bad = []
    for r in res["ranks"]:
        if r["role"] != "trainer":
            continue
        who = f"trainer {r['rank']}"
        if r["table_allocation_error_without_limit"] is not None:
            bad.append(f"{who}: allocating the table failed before the limit (the machine refuses it, not the cap)")
        if r["table_allocation_error"] is None:
            bad.append(f"{who}: allocating the table did not fail under the limit")
        if not all(math.isfinite(v) for v in r["losses"]):
            bad.append(f"{who}: a loss is not finite")
        if r["probe_rows_changed"] != r["probe_rows"]:
            bad.append(f"{who}: {r['probe_rows'] - r['probe_rows_changed']} trained rows unchanged on the servers")
        if not r["vm_hwm_bytes"] < res["limit_bytes"] < res["table_bytes"]:
            bad.append(f"{who}: peak {r['vm_hwm_bytes']} B not under the limit, or the limit not under the table")
    return bad


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit-mib", type=int, default=512, help="each trainer's RLIMIT_DATA, MiB")
    p.add_argument("--factor", type=int, default=4, help="table bytes = factor x the limit")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=1024, help="global batch (split over the trainers)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    a = p.parse_args()
    res = run(a.trainers, a.servers, a.limit_mib * MIB, a.factor, a.dim, a.steps, a.batch)
    res["failures"] = check(res)
    print(
        f"table {res['table_rows']} x {a.dim} float32 = {res['table_bytes'] / MIB:.0f} MiB "
        f"({res['table_over_limit']:.2f}x the trainers' limit of {a.limit_mib} MiB); {a.trainers} trainers, "
        f"{a.servers} servers, {a.steps} sync steps, job {res['wall_s']:.1f} s"
    )
    for r in res["ranks"]:
        peak = f"peak RSS {r['ru_maxrss_bytes'] / MIB:.0f} MiB (VmHWM {r['vm_hwm_bytes'] / MIB:.0f} MiB)"
        if r["role"] == "server":
            print(f"  server  rank {r['rank']}: {peak}")
            continue
        mem = ", ".join(f"{s['memory_bytes'] / MIB:.0f}" for s in r["servers"])
        print(
            f"  trainer rank {r['rank']}: {peak}; data before the cap {r['data_before_limit_bytes'] / MIB:.0f} MiB, "
            f"at the end {r['data_at_end_bytes'] / MIB:.0f} MiB; loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}; "
            f"{r['probe_rows_changed']}/{r['probe_rows']} trained rows changed; servers' memory_bytes [{mem}] MiB"
        )
        free = r["table_allocation_error_without_limit"] or "allocated (pages untouched)"
        print(
            f"    allocating the table in this trainer before the cap: {free}; under it: {r['table_allocation_error']}"
        )
    print("failures:", res["failures"] or "none")
    if a.json is not None:
        a.json.write_text(json.dumps(res, indent=1))
    if res["failures"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
