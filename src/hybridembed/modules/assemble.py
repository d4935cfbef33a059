"""A group's features joined into one batch for its kernel call (``EmbeddingCollection``'s
assembly): pooled features' bags and sequence features' ids (each a bag of one) as one (N,) id
tensor of the group's rows and one (S+1,) offsets tensor, with the checks of the inputs queued as
one 0-d tensor (no host sync). On the CPU one Numba pass (:mod:`hybridembed.kernels.cpu_assemble`)
where it runs; else a few ops a feature, or a few a group for small batches and on GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..input import Jagged, run_index
from ..kernels import cpu_assemble
from ..storage import LookupPlan, RowStorage
from ..utils import device_tensor

if TYPE_CHECKING:
    from .collection import _Feature

__all__ = ["GroupBatch", "assemble", "assemble_small", "group_consts", "SMALL_PER_FEATURE"]

# below this many ids per feature on average, a group is assembled with per-group ops (:func:`assemble_small`);
# on a GPU always (its passes over the ids cost microseconds, each op's launch more)
SMALL_PER_FEATURE = 2048
_FEW_OPS_DEVICES = ("cuda",)


@dataclass
class GroupBatch:
    """One group's inputs joined for its kernel call (see :func:`assemble`)."""

    storage: RowStorage
    feats: list[_Feature]  # pooled, then sequence
    seq: list[_Feature]
    ids: torch.Tensor  # (N,) int64: dense rows of the group's matrix, or raw ids of dynamic tables
    offsets: torch.Tensor  # (S+1,) bags; a sequence feature's ids are bags of one
    sizes: list[int]  # bags per feature
    counts: list[int]  # ids per feature
    ok: torch.Tensor  # 0-d bool: every check of these inputs passed (not yet synced)
    plan: LookupPlan | None = None  # the storage's planned lookup (resolve), until _lookup_group commits it
    one_per_bag: bool = False  # offsets are arange(N + 1), made here


def _shifted(x: torch.Tensor, by: int, out: torch.Tensor) -> torch.Tensor:
    """``out`` (int64) = ``x + by``, in one op when ``x`` is int64; narrower integers are widened
    first (added in their own dtype they would wrap)."""
    if x.dtype == torch.int64:
        return torch.add(x, by, out=out) if by else out.copy_(x)
    out.copy_(x)
    return out.add_(by) if by else out


def _all(checks: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """0-d bool: every check holds (True for none)."""
    return torch.stack(checks).all() if checks else torch.ones((), dtype=torch.bool, device=device)


def assemble(ec, storage: RowStorage, pooled: list[_Feature], seq: list[_Feature], jagged: dict) -> GroupBatch:
    """A group's features as one batch for one kernel call: pooled features are bags, and
    each id of a sequence feature is a bag of one. Reads no row; nothing is checked yet
    beyond structure, but the checks ``EmbeddingCollection._validate`` needs are queued (no host sync)."""
    device = storage.weight.device
    feats = pooled + seq
    js = [jagged[f.jkey] for f in feats]
    counts = [j.values.numel() for j in js]
    sizes = [j.offsets.numel() - 1 for j in js[: len(pooled)]] + counts[len(pooled) :]  # bags per feature
    n, s = sum(counts), sum(sizes)
    if device.type == "cpu" and storage.kernels in ("auto", "numba"):  # (one Numba pass, where it runs)
        rows = [-1 if f.dynamic else f.table.num_embeddings for f in feats]  # (-1: any id)
        got = cpu_assemble.assemble(
            js, [f.row_offset for f in feats], rows, [False] * len(pooled) + [True] * len(seq), n, s
        )
        if got is not None:
            ids, offsets, ok, one = got
            checks = [torch.tensor(ok)] + [torch.isfinite(j.weights).all() for j in js if j.weights is not None]
            offsets = ec._one_per_bag(n, device) if offsets is None else offsets  # (every bag one id)
            return GroupBatch(storage, feats, seq, ids, offsets, sizes, counts, _all(checks, device), one_per_bag=one)
    if not seq and (n < SMALL_PER_FEATURE * len(feats) or device.type in _FEW_OPS_DEVICES):
        return assemble_small(ec, storage, feats, js, counts, sizes)
    ids = torch.empty(n, dtype=torch.int64, device=device)  # (N,) rows of the group's storage
    offsets = torch.empty(s + 1, dtype=torch.int64, device=device)
    checks, lo_hi, bounds = [], [], []
    base = bag = 0
    for feat, j, c, b in zip(feats, js, counts, sizes):
        v, o = j.values, j.offsets
        dst = _shifted(v, feat.row_offset, ids[base : base + c])
        if feat.table.combiner == "none":
            torch.arange(base, base + c, out=offsets[bag : bag + b])
            if o.numel() > 1:  # (pooled features' offsets are checked together below)
                checks.append((o[1:] >= o[:-1]).all())
        else:
            _shifted(o[:-1], base, offsets[bag : bag + b])
        if c and j.weights is not None:  # NaN or inf would poison the rows they pool
            checks.append(torch.isfinite(j.weights).all())
        if c and not feat.dynamic:  # dense: ids in [0, num_embeddings)
            lo_hi.append(torch.aminmax(dst))  # (the int64 copy: then the bounds compare exactly)
            bounds.append((feat.row_offset, feat.row_offset + feat.table.num_embeddings))
        base += c
        bag += b
    offsets[s] = n
    # offsets: each feature's first is 0 and last is its id count, and the joined offsets
    # never decrease; together that is every feature's offsets being well formed
    firsts = torch.cat([j.offsets[:1] for j in js])
    lasts = torch.cat([j.offsets[-1:] for j in js])
    checks.append((firsts == 0).all())
    checks.append((lasts == device_tensor(counts, device)).all())
    if s:
        checks.append((offsets[1:] >= offsets[:-1]).all())
    if lo_hi:
        los, his = torch.stack([m for m, _ in lo_hi]), torch.stack([m for _, m in lo_hi])
        lim = device_tensor(bounds, device, torch.int64)  # (F, 2): each table's rows
        checks.append((los >= lim[:, 0]).all() & (his < lim[:, 1]).all())
    return GroupBatch(storage, feats, seq, ids, offsets, sizes, counts, torch.stack(checks).all())


def assemble_small(
    ec, storage: RowStorage, feats: list[_Feature], js: list[Jagged], counts: list[int], sizes: list[int]
) -> GroupBatch:
    """:meth:`_assemble` for pooled features of few ids each (small batches, many features):
    a constant number of ops per group instead of a few per feature, at the price of two
    more passes over the ids (which only pays while per-op overhead dominates)."""
    device = storage.weight.device
    n = sum(counts)
    ids = torch.cat([j.values for j in js])  # (N,) (type promotion widens narrow ids to int64 or int32)
    if ids.dtype != torch.int64:
        ids = ids.to(torch.int64)
    f = len(feats)
    consts = group_consts(ec, feats, device)  # (F,) row offsets, (F,) rows per table, any offset
    checks = [torch.isfinite(j.weights).all() for j in js if j.weights is not None and j.weights.numel()]
    # every feature with the same number of ids and of bags (one-hot layers of one batch): (F, c) views
    uniform = n and counts.count(counts[0]) == f and sizes.count(sizes[0]) == f
    if not feats[0].dynamic:  # dense: ids in [0, num_embeddings), then shifted to the group's rows
        if uniform:
            lo, hi = torch.aminmax(ids.view(f, -1), dim=1)  # (F,)
            checks.append((lo >= 0).all() & (hi < consts[1]).all())
            if consts[2]:
                ids = ids.view(f, -1).add(consts[0].unsqueeze(1)).view(-1)
        elif n:
            which = run_index(device_tensor(counts, device), n)  # (N,) feature of each id
            checks.append(((ids >= 0) & (ids < consts[1][which])).all())
            if consts[2]:  # some table starts past row 0
                ids = ids + consts[0][which]
    if all(ec._trusted(j) for j in js):  # one id per bag, offsets made here: nothing to check
        offsets = ec._one_per_bag(n, device)
        return GroupBatch(storage, feats, [], ids, offsets, sizes, counts, _all(checks, device), one_per_bag=True)
    cnt = counts[0] if uniform else device_tensor(counts, device)
    starts = torch.arange(0, n, counts[0], device=device) if uniform else torch.cumsum(cnt, 0).sub_(cnt)  # (F,)
    if sizes.count(sizes[0]) == f:  # as many bags each: one (F, B+1) stack, no per-feature slices
        full = torch.stack([j.offsets for j in js])
        firsts, lasts = full[:, 0], full[:, -1]
        offsets = torch.empty(sum(sizes) + 1, dtype=torch.int64, device=device)
        torch.add(full[:, :-1], starts.unsqueeze(1), out=offsets[:-1].view(f, -1))
        offsets[-1] = n
    else:
        offsets = torch.cat([*(j.offsets[:-1] for j in js), device_tensor([n], device)]).to(torch.int64)
        offsets[:-1] += starts[run_index(device_tensor(sizes, device), offsets.numel() - 1)]
        firsts, lasts = torch.cat([j.offsets[:1] for j in js]), torch.cat([j.offsets[-1:] for j in js])
    # offsets well formed: each feature's first is 0 and last its id count, the joined ones never decrease
    checks.append((firsts == 0).all() & (lasts == cnt).all())
    checks.append((offsets[1:] >= offsets[:-1]).all())
    return GroupBatch(storage, feats, [], ids, offsets, sizes, counts, torch.stack(checks).all())


def group_consts(ec, feats: list[_Feature], device) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Per-feature (row offsets (F,), rows of its table (F,), any offset nonzero), cached by feature list."""
    key = tuple(f.name for f in feats)
    cache = ec.__dict__.setdefault("_consts_cache", {})
    hit = cache.get(key)
    if hit is None or hit[0].device != device:
        if len(cache) > 64:
            cache.clear()
        offs = [f.row_offset for f in feats]
        rows = [f.table.num_embeddings or 0 for f in feats]
        hit = cache[key] = (device_tensor(offs, device), device_tensor(rows, device), any(offs))
    return hit
