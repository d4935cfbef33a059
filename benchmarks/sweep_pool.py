"""The pooled forward's launch parameters swept on a GPU (bench_gpu.py's sizes: 26 x 1M x 128
float32 rows, batch 16,384, power-law ids), to choose the defaults of kernels/triton_lookup.py.

    PYTHONPATH=src:. python benchmarks/sweep_pool.py
"""

from __future__ import annotations

import itertools
from functools import partial

import torch
from triton.testing import do_bench

from hybridembed.kernels import triton_lookup as tk
from hybridembed.synthetic import powerlaw_ids

T, R, D, B = 26, 1_000_000, 128, 16_384


def batch(max_len: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = (
        torch.ones(T * B, dtype=torch.int64) if max_len == 1 else torch.randint(0, max_len + 1, (T * B,), generator=g)
    )
    per_table = lengths.view(T, B).sum(1)
    ids = torch.cat([powerlaw_ids(int(n), R, generator=g) + t * R for t, n in enumerate(per_table.tolist())])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return ids.cuda(), offsets.cuda()


def main() -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.empty(T * R, D, device="cuda").normal_()
    src, dst = weight.view(-1)[: 2**28], torch.empty(2**28, device="cuda")  # 1 GiB
    bw = 2 * dst.numel() * 4 / do_bench(partial(dst.copy_, src)) / 1e6  # GB/s
    print(f"copy {bw:,.0f} GB/s (read + written)")
    dst = None
    for label, max_len, grid in (
        ("one-hot as bags", 1, {"_BAGS": [4, 8, 16, 64], "_SHORT_WARPS": [1, 2, 4], "_SHORT": [2]}),
        ("one-hot as bags, per-bag kernel", 1, {"_BLOCK_N": [1, 2, 16], "_POOL_WARPS": [1, 4], "_SHORT": [0]}),
        ("multi-hot 0..40", 40, {"_BLOCK_N": [4, 8, 16, 32], "_POOL_WARPS": [1, 2]}),
    ):
        ids, offsets = batch(max_len, g)
        distinct = torch.unique(ids).numel()
        floor = (8 * ids.numel() + 8 * offsets.numel() + 4 * D * distinct + 4 * D * T * B) / 1e9  # GB
        print(f"\n{label}: {ids.numel():,} ids, {distinct:,} distinct; byte floor {floor / bw * 1e3:.3f} ms")
        keys = list(grid)
        saved = {k: getattr(tk, k) for k in keys}
        for values in itertools.product(*grid.values()):
            for k, v in zip(keys, values):
                setattr(tk, k, v)
            cfg = " ".join(f"{k.strip('_').lower()}={v}" for k, v in zip(keys, values))
            try:
                ms = do_bench(partial(tk.pool, weight, ids, offsets, None, torch.float32, False))
            except Exception as e:  # (a launch parameter the compiler refuses)
                print(f"  {cfg:<40} failed: {type(e).__name__}: {str(e)[:100]}")
                continue
            print(f"  {cfg:<40} {ms:7.3f} ms  {floor / bw * 1e3 / ms:5.2f} of floor", flush=True)
        for k, v in saved.items():
            setattr(tk, k, v)


if __name__ == "__main__":
    main()
