"""Grouped forward+backward against one nn.EmbeddingBag per table, in the same run.

    python benchmarks/bench_lookup.py                       # 26 x 200k x 64, batch 8192, library defaults
    HYBRIDEMBED_TUNE_ALLOCATOR=0 python benchmarks/bench_lookup.py   # glibc defaults
    python benchmarks/bench_lookup.py --tables 4 --rows 1000 --batch 256 --steps 3   # smoke

Both sides get the same power-law ids (alpha 1.05) and the same initial weights, and
produce sparse gradients (nn.EmbeddingBag(sparse=True)); their calls are interleaved so
noise hits both alike. Reports median ms per step and the ratio per_table / grouped.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

import hybridembed as he
from hybridembed.bench import add_allocator_option, apply_allocator_option, powerlaw_ids, time_interleaved


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--hotness", type=int, nargs="+", default=[1, 10], help="ids per bag (fixed)")
    p.add_argument("--steps", type=int, default=10)
    add_allocator_option(p)
    p.add_argument("--json", help="write results here")
    args = p.parse_args(argv)
    apply_allocator_option(args)
    torch.manual_seed(0)
    names = [f"t{i}" for i in range(args.tables)]
    ec = he.EmbeddingCollection([he.TableConfig(n, args.rows, args.dim) for n in names])
    bags = nn.ModuleList(nn.EmbeddingBag(args.rows, args.dim, mode="sum", sparse=True) for _ in names)
    with torch.no_grad():
        for n, bag in zip(names, bags):
            bag.weight.copy_(ec.weight(n))
    results = {"config": vars(args), "torch": torch.__version__, "threads": torch.get_num_threads(), "runs": []}
    for hot in args.hotness:
        # both sides get inputs prepared outside the timed region: Jagged for the collection,
        # flat ids + offsets for the bags (the same tensors)
        ids = {n: he.Jagged.from_dense(powerlaw_ids(args.batch * hot, args.rows).view(args.batch, hot)) for n in names}
        offsets = torch.arange(0, args.batch * hot, hot)
        flat = {n: j.values for n, j in ids.items()}

        grads = [torch.randn(args.batch, args.dim) for _ in names]  # fixed upstream gradient

        def grouped(ids=ids, grads=grads):
            out = ec(ids)
            torch.autograd.backward([out[n] for n in names], grads)
            for s in ec.storages:
                s.weight.grad = None

        def per_table(flat=flat, offsets=offsets, grads=grads):
            out = [bag(flat[n], offsets) for n, bag in zip(names, bags)]
            torch.autograd.backward(out, grads)
            for bag in bags:
                bag.weight.grad = None

        t = time_interleaved({"grouped": grouped, "per_table": per_table}, steps=args.steps)
        run = {
            "hotness": hot,
            "grouped_ms": t["grouped"].median,
            "grouped_spread_ms": t["grouped"].spread,
            "per_table_ms": t["per_table"].median,
            "per_table_spread_ms": t["per_table"].spread,
            "speedup": t["per_table"].median / t["grouped"].median,
        }
        results["runs"].append(run)
        print(
            f"hotness {hot:3d}: grouped {run['grouped_ms']:8.1f} ms (±{run['grouped_spread_ms']:.1f})  "
            f"per-table {run['per_table_ms']:8.1f} ms (±{run['per_table_spread_ms']:.1f})  "
            f"per-table/grouped = {run['speedup']:.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
