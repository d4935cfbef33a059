"""``he.distribute``'s memory per rank: a DLRM-sized model built whole on every rank (as a user's
script builds it), distributed at world N over gloo; each rank's resident memory before, at its
peak and after, against the model's tables and the rank's shards (issue 24's targets: peak <=
(model + shards) x 1.2, after <= shards x 1.2, on top of the process without tables).

    PYTHONPATH=src python benchmarks/bench_distribute_memory.py                  # 26 Kaggle tables <= 2M x 64, world 2
    PYTHONPATH=src python benchmarks/bench_distribute_memory.py --max-rows 100000 --dim 16   # smoke

Linux only (``/proc/self/status``: VmRSS, VmHWM).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from torch import nn

import hybridembed as he
from hybridembed.distributed import unwrap
from hybridembed.launch import spawn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_convert_memory import KAGGLE  # noqa: E402


def _status(key: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process, bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


class Model(nn.Module):
    def __init__(self, rows: list[int], dim: int, device: str = "cpu") -> None:
        super().__init__()
        self.emb_l = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum", device=device) for n in rows)
        self.top = nn.Sequential(nn.Linear(dim * len(rows), 512), nn.ReLU(), nn.Linear(512, 1))


def _rank(rank: int, world: int, rows: list[int], dim: int, meta: bool) -> dict:
    import torch.distributed as dist

    base = _status("VmRSS:")  # the process, no model yet
    model = Model(
        rows, dim, "meta" if meta else "cpu"
    )  # (meta: the tables allocate nothing; each rank makes its shards)
    before = _status("VmRSS:")
    dist.barrier()
    model = he.distribute(model)
    dist.barrier()
    after = _status("VmRSS:")
    peak = _status("VmHWM:")
    ec = unwrap(model).hybridembed
    shards = sum(t.numel() * t.element_size() for st in ec.local.storages for t in (st.weight,)) if ec.local else 0
    return {"base": base, "before": before, "after": after, "peak": peak, "shards": shards}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-rows", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--meta", action="store_true", help="build the tables on the meta device (no rows until sharded)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    rows = [min(n, args.max_rows) for n in KAGGLE]
    tables = sum(rows) * args.dim * 4
    results = spawn(_rank, args.world, rows, args.dim, args.meta, timeout=1800, pg_timeout=1800, threads=1)
    gib = 2**30
    built = "on meta" if args.meta else "on the CPU"
    print(
        f"26 tables, {sum(rows):,} rows x {args.dim}: {tables / gib:.2f} GiB, built {built}; world {args.world} (gloo)"
    )
    if args.meta:
        tables = 0  # (the model holds no rows)
    for r, res in enumerate(results):
        b = res["base"]
        res["peak_vs_model_plus_shards"] = (res["peak"] - b) / (tables + res["shards"])
        res["after_vs_shards"] = (res["after"] - b) / max(res["shards"], 1)
        print(
            f"  rank {r}: shards {res['shards'] / gib:.2f} GiB; model built {(res['before'] - b) / gib:.2f} GiB, "
            f"peak {(res['peak'] - b) / gib:.2f} GiB ({res['peak_vs_model_plus_shards']:.2f}x model + shards, "
            f"target <= 1.2x), after {(res['after'] - b) / gib:.2f} GiB ({res['after_vs_shards']:.2f}x shards, "
            "target <= 1.2x) [above the process without a model]"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "ranks": results}, indent=2))
    return results


if __name__ == "__main__":
    main()
