"""A group's input assembly on the CPU in one Numba call (:func:`assemble`), for
:meth:`hybridembed.modules.collection.EmbeddingCollection._assemble`.

The eager assembly makes three to five ops a feature (each feature's ids shifted into the
group's rows, its offsets into the group's bags, the bounds of its ids, the checks of its
offsets). This is one pass over each feature's tensors on the step's threads, with the same
checks, and it sees whether every bag holds one id: the offsets are then not written (the
caller's ``arange``), and the lookup and the fused step skip checking that again. Most of the
assembly's time is moving the ids (26 one-hot features of 8,192 ids: ~1.1 ms either way inside a
step, the caches cold); the step around it measured 1.04x faster one-hot, 1.07x for multi-hot
batches of 128 (``benchmarks/bench_assemble.py``). Where it does not apply (no Numba, inputs not
on the CPU), None: the eager assembly runs.
"""

from __future__ import annotations

import numpy as np
import torch

from . import cpu_fused

__all__ = ["assemble"]

_MIN_IDS_PER_THREAD = 1 << 18  # ids below which the features are assembled on one thread


def assemble(
    jagged: list, shifts: list[int], rows: list[int], seq: list[bool], n: int, s: int
) -> tuple[torch.Tensor, torch.Tensor | None, bool, bool] | None:
    """Features' inputs ``jagged`` (:class:`~hybridembed.input.Jagged` each; ``n`` ids and ``s``
    bags in all, sequence features' ids each a bag) -> (the group's ids (N,) int64, each shifted by
    its feature's ``shifts`` entry; the group's offsets (S+1,) int64; whether every check held: ids
    in ``0 .. rows[f] - 1`` (rows -1: any id) and offsets well formed; whether every bag holds one
    id: the offsets are then None, for the caller's ``arange(N + 1)``), or None where this cannot run."""
    if not cpu_fused.available() or any(j.values.device.type != "cpu" or j.offsets.dim() != 1 for j in jagged):
        return None
    # (narrower integers widened, strided tensors copied: the kernel reads int64 arrays by address;
    # these lists keep them alive through the call)
    vals = [j.values.to(torch.int64).contiguous() for j in jagged]
    offs_in = [j.offsets.to(torch.int64).contiguous() for j in jagged]
    if any(o.numel() == 0 for o in offs_in):
        return None
    from . import _numba_assemble as K

    f = len(jagged)
    counts = np.fromiter((v.numel() for v in vals), np.int64, f)
    lengths = np.fromiter((o.numel() for o in offs_in), np.int64, f)
    values = np.fromiter((v.data_ptr() for v in vals), np.int64, f)
    offsets = np.fromiter((o.data_ptr() for o in offs_in), np.int64, f)
    is_seq = np.asarray(seq, np.bool_)
    head = (values, offsets, counts, lengths, np.asarray(shifts, np.int64), np.asarray(rows, np.int64), is_seq)
    ids = torch.empty(n, dtype=torch.int64)
    offs = torch.empty(s + 1, dtype=torch.int64)  # (not written where every bag holds one id)
    tail = (ids.numpy(), offs.numpy())
    first_ids = np.concatenate([[0], np.cumsum(counts)])  # (F+1,): each feature's first id, and bag
    first_bags = np.concatenate([[0], np.cumsum(np.where(is_seq, counts, lengths - 1))])
    # features split between the threads by their ids
    t = max(1, min(torch.get_num_threads(), n // _MIN_IDS_PER_THREAD, f))
    ends = np.searchsorted(first_ids[1:], [n * k // t for k in range(1, t)], side="right").tolist()
    cuts = [0] + [e for e in ends if 0 < e < f] + [f]
    slices = [(lo, hi) for lo, hi in zip(cuts, cuts[1:]) if hi > lo]

    def call(lo, hi, force):
        return (K.assemble_features, *head, lo, hi, int(first_ids[lo]), int(first_bags[lo]), force, *tail)

    results = cpu_fused._each([call(lo, hi, False) for lo, hi in slices]) if slices else []
    ok, one = all(r[0] for r in results), all(r[1] for r in results)
    if one:  # (every bag one id: the offsets are arange, not written)
        return ids, None, ok, True
    mixed = [call(lo, hi, True) for (lo, hi), r in zip(slices, results) if r[1]]  # (slices that wrote none)
    if mixed:
        cpu_fused._each(mixed)
    offs[s] = n
    return ids, offs, ok, False
