"""The fused update's launch parameters swept on a GPU (bench_gpu.py's sizes: 26 x 1M x 128
float32 rows, batch 16,384, power-law ids), to choose those of kernels/triton_lookup.py: ``_CHUNK``
and ``_UPDATE_WARPS`` (the walk, multi-hot bags), ``_TILE_CHUNK`` and ``_TILE_WARPS`` (the tile,
one-hot). ``--against FILE`` also times another version of that module (say, the last commit's,
``git show HEAD~1:src/hybridembed/kernels/triton_lookup.py > old.py``) at its defaults, in the
same run; ``--only one-hot|multi-hot`` times one kind of bags.

    PYTHONPATH=src:. python benchmarks/sweep_update.py [--against old.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
from functools import partial

import torch
from triton.testing import do_bench

import hybridembed as he
from benchmarks.sweep_pool import B, D, R, T, batch
from hybridembed.kernels import triton_lookup as tk
from hybridembed.optim import sparse as so

DEVICE = "cuda"


def load(path: str):
    """Another version of triton_lookup.py, as a module of hybridembed.kernels (its relative imports hold)."""
    spec = importlib.util.spec_from_file_location("hybridembed.kernels._swept", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--against", help="another triton_lookup.py, timed at its defaults")
    p.add_argument("--chunks", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--only", choices=["one-hot", "multi-hot"], help="one kind of bags")
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    modules = [("this", tk)] + ([("against", load(args.against))] if args.against else [])
    for max_len, opts in ((40, ("adagrad", "sgd")), (1, ("adagrad",))):
        if args.only and args.only != ("one-hot" if max_len == 1 else "multi-hot"):
            continue
        ids, offsets = batch(max_len, g)
        bag_of = torch.repeat_interleave(torch.arange(T * B, device=DEVICE), offsets.diff())
        grad = torch.randn(T * B, D, device=DEVICE)
        for opt_name in opts:
            opt = so.Adagrad(lr=0.01) if opt_name == "adagrad" else so.SGD(lr=0.01)
            st = he.EmbeddingCollection([he.TableConfig("t", T * R, D)], device=DEVICE, kernels="triton").storages[0]
            st.attach_optimizer(opt, dict(opt.hparams))
            kind = "one-hot" if max_len == 1 else f"multi-hot 0..{max_len}"
            print(f"\n{kind}, {opt_name}: {ids.numel():,} ids, {torch.unique(ids).numel():,} distinct", flush=True)
            for name, mod in modules:
                # the launch parameters of the kernel this kind of bags takes (an older module: _CHUNK alone)
                knobs = (
                    ("_TILE_CHUNK", "_TILE_WARPS")
                    if max_len == 1 and hasattr(mod, "_TILE_CHUNK")
                    else ("_CHUNK", "_UPDATE_WARPS")
                )
                saved = tuple(getattr(mod, k, None) for k in knobs)
                grid = itertools.product(args.chunks, args.warps) if name == "this" else [saved]
                for chunk, warps in grid:
                    for k, v in zip(knobs, (chunk, warps)):
                        setattr(mod, k, v)
                    cfg = f"{name} chunk={chunk} warps={warps or 'default'}"
                    try:
                        ms = do_bench(partial(mod.apply_fused, st, ids, grad, bag_of, None, st.hparams))
                    except Exception as e:  # (a launch parameter the compiler refuses)
                        print(f"  {cfg:<36} failed: {type(e).__name__}: {str(e)[:100]}")
                    else:
                        print(f"  {cfg:<36} {ms:7.3f} ms", flush=True)
                    for k, v in zip(knobs, saved):
                        setattr(mod, k, v)
            del st


if __name__ == "__main__":
    main()
