"""Where bench_gpu.py's time goes on a GPU: torch.profiler over a few forwards and steps of one
workload per contender, the kernels (device time) and the host's share.

    PYTHONPATH=src:. python benchmarks/profile_gpu.py --workload one-hot/sgd --contender triton
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import bench_gpu as B


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", default="one-hot/sgd", choices=[w[0] for w in B.WORKLOADS])
    p.add_argument("--contender", nargs="+", default=["triton", "baseline"])
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--rows", type=int, default=15, help="profiler table rows")
    args = p.parse_args()
    device = torch.device("cuda")
    spec = next(w for w in B.WORKLOADS if w[0] == args.workload)
    name, hotness, optimizer, dynamic = spec
    rows, b = round(B.ROWS * args.scale), round(B.BATCH * args.scale)
    names = [f"t{i}" for i in range(B.TABLES)]
    gen = torch.Generator().manual_seed(0)
    batch = B.make_batch(names, rows, b, hotness, gen, device)
    grads = [torch.randn(b, B.DIM, generator=gen).to(device) for _ in names]
    steps, forwards = B.contenders(names, rows, B.DIM, optimizer, dynamic, batch, grads, device, True)
    for who in args.contender:
        for what, fn in (("forward", forwards[who]), ("step", steps[who])):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(5):
                fn()
            host = (time.perf_counter() - t0) / 5
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / 5
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
            print(f"\n=== {name} {who} {what}: {wall * 1e3:.2f} ms per call (host returns after {host * 1e3:.2f} ms)")
            for key in ("self_cuda_time_total", "self_cpu_time_total"):  # the device's share, then the host's
                print(prof.key_averages().table(sort_by=key, row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
