"""What a resharded load costs each rank in memory: one table saved by one process, loaded at
world W (row blocks); each rank's resident memory before and after ``he.load`` and its peak.

    PYTHONPATH=src python benchmarks/bench_reshard_memory.py --rows 2000000 --dim 32 --world 4

A rank should grow by about its own shard (plus the file pages it read), never by the table.
Linux only (``/proc/self/status``).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

import hybridembed as he
from hybridembed.distributed import Plan, ShardedCollection, shard_table
from hybridembed.launch import spawn


def _status(key: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process, MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) // 1024
    raise KeyError(key)


def _load(rank: int, world: int, path: str, rows: int, dim: int) -> dict:
    t = he.TableConfig("big", rows, dim)
    plan = Plan(world, (shard_table(t, "row_wise", tuple(range(world))),))
    model = torch.nn.ModuleDict({"ec": ShardedCollection([t], {"big": "big"}, plan)})
    before = _status("VmRSS")
    t0 = time.perf_counter()
    he.load(path, model, verify=False)
    return {
        "rank": rank,
        "load_s": time.perf_counter() - t0,
        "rss_before_mib": before,
        "rss_after_mib": _status("VmRSS"),
        "peak_mib": _status("VmHWM"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--world", type=int, default=4)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "ckpt")
        he.save(path, torch.nn.ModuleDict({"ec": he.EmbeddingCollection([he.TableConfig("big", args.rows, args.dim)])}))
        table = args.rows * args.dim * 4 / 2**20
        print(f"table: {args.rows} x {args.dim} float32 = {table:.0f} MiB; shard per rank {table / args.world:.0f} MiB")
        for r in spawn(_load, args.world, path, args.rows, args.dim, timeout=600, start_method="spawn"):
            grew, peak = r["rss_after_mib"] - r["rss_before_mib"], r["peak_mib"] - r["rss_before_mib"]
            print(f"rank {r['rank']}: load {r['load_s']:.2f} s, resident +{grew} MiB, peak +{peak} MiB above its start")


if __name__ == "__main__":
    main()
