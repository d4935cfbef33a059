"""The fused CPU step's grouping of a batch's ids by row: the two-level counting sort
(``cpu_fused.group_by_row``) against torch's int32 stable sort, the distinct rows and the gathers
after it (the path below its threshold), interleaved, each followed by the step's reduction
(``embedding_bag`` over the grouped ids). The shape of ``bench_step.py``: 26 tables x 200k rows,
batch 8,192, power-law ids, one-hot or 0..20 ids a bag (mean 10).

    python benchmarks/bench_group.py [--hotness multi one] [--steps 15]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from hybridembed.bench import powerlaw_ids, time_interleaved
from hybridembed.kernels import cpu_fused
from hybridembed.kernels.lookup import sorted_segments


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--hotness", nargs="+", choices=["one", "multi"], default=["multi", "one"])
    p.add_argument("--steps", type=int, default=15)
    args = p.parse_args(argv)
    t, r, b = args.tables, args.rows, args.batch
    nrows = t * r
    grad = torch.randn(b * t, args.dim)
    out = []
    for hot in args.hotness:
        lengths = torch.ones(b * t, dtype=torch.int64) if hot == "one" else torch.randint(0, 21, (b * t,))
        per = lengths.view(t, b).sum(1).tolist()
        ids = torch.cat([powerlaw_ids(int(k), r) + j * r for j, k in enumerate(per)])
        bag_of = torch.repeat_interleave(torch.arange(b * t), lengths)

        def counted(ids=ids, bag_of=bag_of):
            got = cpu_fused.group_by_row(ids, nrows, bag_of, None, grad.dtype)
            if got is None:  # (below the threshold: what the step does then)
                return sorted_()
            uniq, at, seg, _ = got
            return F.embedding_bag(at, grad, seg, mode="sum", include_last_offset=True)

        def sorted_(ids=ids, bag_of=bag_of):
            uniq, perm, seg = sorted_segments(ids, nrows)
            return F.embedding_bag(bag_of.index_select(0, perm), grad, seg, mode="sum", include_last_offset=True)

        assert torch.equal(counted(), sorted_())
        times = time_interleaved({"counted": counted, "sorted": sorted_}, steps=args.steps)
        taken = cpu_fused.group_by_row(ids, nrows, bag_of, None, grad.dtype) is not None
        run = {"hotness": hot, "ids": ids.numel(), "counting_taken": taken}
        run.update({f"{k}_ms": v.median for k, v in times.items()})
        print(
            f"{hot}-hot ({ids.numel():,} ids, counting {'taken' if taken else 'not taken: the sort'}): "
            f"grouped + reduced {run['counted_ms']:.1f} ms against the sort's {run['sorted_ms']:.1f} ms",
            flush=True,
        )
        out.append(run)
    return out


if __name__ == "__main__":
    main()
