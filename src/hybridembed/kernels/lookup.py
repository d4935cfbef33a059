"""Fused lookup-and-pool for one group of tables.

Shape legend: ``N`` ids in the group's batch (all its features), ``U`` distinct ids,
``R`` rows of the group's storage, ``D`` dim, ``S`` bags (sum of the features' batches).

Forward is one ``embedding_bag(mode="sum")`` over the group's matrix; per-id weights
carry the combiner (mean, sqrtn) and the user's weights, and a sequence feature is a run
of one-id bags. Backward is the same op transposed: sort the ids once, then one
``embedding_bag`` over the output gradient with one "bag" per distinct row. It yields
the gradient as a *coalesced* sparse tensor — each touched row once, duplicates summed
(one update per row, as the dense optimizer) — with no zero-filled (R, D) or (U, D) buffer and no scatter.
When every bag holds one id (one-hot or sequence features) the output gradient already
is the per-id gradient and is handed on uncoalesced, as ``nn.EmbeddingBag(sparse=True)``
does; the optimizer reduces it (same kernel) before the update. A storage that has
grouped the ids itself (dynamic tables: one sort per batch, in the lookup) passes that
grouping in, and the backward reduces over it without sorting; the result has distinct
but unsorted rows, so it is left uncoalesced and the storage is told it is reduced.
With bags of one common length, an id's bag is its position // that length.
PyTorch's own dense embedding_bag backward (zero fill, sort, scatter) measured ~3x
slower on 26 tables x 8,192 ids (see docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..input import bag_index, offsets_from_lengths

__all__ = ["pooled_lookup", "bag_scale", "sorted_segments", "reduce_rows", "weight_grad", "Bags"]


def sorted_segments(ids: torch.Tensor, num_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N,) ids -> (unique ids (U,) ascending, permutation (N,) sorting ids, segment offsets (U+1,)).

    Ids known to be below 2**31 (``num_rows``) are sorted as int32 with a stable sort, which
    takes PyTorch's radix-sort path: measured 2x faster than the int64 sort here.
    """
    if num_rows is not None and num_rows < 2**31:
        sorted_ids, perm = torch.sort(ids.to(torch.int32), stable=True)
    else:
        sorted_ids, perm = torch.sort(ids)
    uniq, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    return uniq.to(torch.int64), perm, offsets_from_lengths(counts)


class _PooledLookup(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, weight, ids, offsets, psw, compute_dtype, grad_sink, segments, one_per_bag
    ):  # (R, D), (N,), (S+1,), (N,)|None
        if weight.dtype == compute_dtype:  # (detached: PyTorch's forward-only kernel; the backward is ours)
            pooled = F.embedding_bag(
                ids, weight.detach(), offsets, mode="sum", per_sample_weights=psw, include_last_offset=True
            )
        else:  # half-precision storage: accumulate in compute_dtype
            rows = weight.index_select(0, ids).to(compute_dtype)  # (N, D)
            pos = torch.arange(ids.numel(), device=ids.device)
            pooled = F.embedding_bag(pos, rows, offsets, mode="sum", per_sample_weights=psw, include_last_offset=True)
        # the weight by reference, not saved: a dynamic table inserts rows (in place, into
        # other slots) between this forward and its backward; only its shape and, for the
        # per-id-weight gradient, these ids' rows are read back
        ctx.weight = weight
        ctx.save_for_backward(ids, offsets, psw)
        ctx.compute_dtype = compute_dtype
        ctx.grad_sink = grad_sink
        ctx.segments = segments
        ctx.one_per_bag = one_per_bag  # the caller knows offsets == arange(N + 1)
        return pooled  # (S, D)

    @staticmethod
    def backward(ctx, grad):  # (S, D)
        ids, offsets, psw = ctx.saved_tensors
        weight = ctx.weight
        grad = grad.contiguous()
        grad_weight = grad_psw = None
        bags = Bags(offsets, ids.numel(), 1 if ctx.one_per_bag else None)
        if ctx.needs_input_grad[0]:
            grad_weight = weight_grad(grad, ids, bags, psw, weight, ctx.compute_dtype, ctx.segments)
        if psw is not None and ctx.needs_input_grad[3]:
            one_per_bag = bags.hotness == 1 or ids.numel() == offsets.numel() - 1 == 0
            rows = weight.index_select(0, ids).to(ctx.compute_dtype)  # (N, D)
            grad_psw = (rows * (grad if one_per_bag else grad.index_select(0, bags.of()))).sum(1)  # (N,)
        if grad_weight is not None and ctx.grad_sink is not None:
            # the storage accumulates it (its matrix may have grown)
            ctx.grad_sink(grad_weight, distinct=ctx.segments is not None)
            grad_weight = None
        ctx.segments = None  # (N,) and (U,) tensors: not kept alive by outputs that outlive the step
        return grad_weight, None, None, grad_psw, None, None, None, None


def weight_grad(
    grad: torch.Tensor,
    ids: torch.Tensor,
    bags: Bags,
    psw: torch.Tensor | None,
    weight: torch.Tensor,
    compute_dtype: torch.dtype,
    segments: tuple | None = None,
) -> torch.Tensor:
    """The sparse gradient (R, D) of ``weight`` from the pooled output's gradient ``grad`` (S, D)
    (see the module docstring): coalesced, or uncoalesced when every bag holds one id or when
    ``segments`` are given. ``weight`` is read for its current shape and dtype only."""
    n, s = ids.numel(), bags.offsets.numel() - 1
    # one id per bag: the output gradient is the per-id gradient (kept uncoalesced, no copy)
    # unless the storage is half precision, where duplicates must be summed in float32
    one_per_bag = bags.hotness == 1 or n == s == 0
    if segments is not None:  # the storage grouped the ids already: no sort
        return _reduce_segments(grad, bags, psw, segments, weight)
    if one_per_bag and weight.dtype == compute_dtype:
        rows = grad if psw is None else grad * psw.unsqueeze(1)  # (N, D)
        return torch.sparse_coo_tensor(
            ids.to(torch.int64).unsqueeze(0), rows.to(weight.dtype), weight.shape, check_invariants=False
        )  # weight.shape is the current one: a grown dynamic matrix keeps its rows
    # pooled bags: reduce per distinct row with the transposed bag
    uniq, perm, seg = sorted_segments(ids, weight.shape[0])
    w = None if psw is None else psw.index_select(0, perm)
    rows = F.embedding_bag(
        bags.of(perm), grad, seg, mode="sum", per_sample_weights=w, include_last_offset=True
    )  # (U, D): the summed gradient of each distinct row
    return torch.sparse_coo_tensor(
        uniq.unsqueeze(0), rows.to(weight.dtype), weight.shape, is_coalesced=True, check_invariants=False
    )


class Bags:
    """Which bag each id is in, from the offsets (S+1,) of N ids; computed only when asked.

    ``hotness`` is the common bag length when every bag has the same (fixed-hotness input,
    one-hot included; one check over the offsets), else None; then the bag of the id at
    position p is p // hotness, with no (N,) bag index built and gathered.
    """

    def __init__(self, offsets: torch.Tensor, n: int, hotness: int | None = None):
        self.offsets, self.n = offsets, n
        s = offsets.numel() - 1
        h = n // s if s else 0
        if hotness is not None:  # known by the caller: no check, no sync
            self.hotness = hotness
        else:
            self.hotness = h if h and h * s == n and bool(((offsets[1:] - offsets[:-1]) == h).all()) else None
        self._bag_of_id = None

    def of(self, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Bag of the ids at ``positions`` (N,), or of every id in order."""
        if self.hotness is not None:
            if positions is None:
                positions = torch.arange(self.n, device=self.offsets.device)
            return positions if self.hotness == 1 else torch.div(positions, self.hotness, rounding_mode="floor")
        if self._bag_of_id is None:
            self._bag_of_id = bag_index(self.offsets, self.n)  # (N,)
        return self._bag_of_id if positions is None else self._bag_of_id.index_select(0, positions)


def _reduce_segments(grad, bags: Bags, psw, segments, weight) -> torch.Tensor:
    """The rows' gradient from ids grouped by the storage: ``segments`` = (perm (N,) putting
    equal rows side by side, segment lengths (K,), row of each segment (K,), kept segments
    (M,) or None). One transposed ``embedding_bag``; the result's row ids are distinct but
    not sorted, so the sparse tensor is left uncoalesced (its consumer is told they are distinct)."""
    perm, lengths, seg_rows, kept = segments
    seg = offsets_from_lengths(lengths)  # (K+1,)
    w = None if psw is None else psw.index_select(0, perm)
    rows = F.embedding_bag(bags.of(perm), grad, seg, mode="sum", per_sample_weights=w, include_last_offset=True)
    if kept is not None:
        rows, seg_rows = rows.index_select(0, kept), seg_rows.index_select(0, kept)
    return torch.sparse_coo_tensor(seg_rows.unsqueeze(0), rows.to(weight.dtype), weight.shape, check_invariants=False)


def pooled_lookup(
    weight: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    per_id_weights: torch.Tensor | None,
    compute_dtype: torch.dtype,
    grad_sink=None,
    segments: tuple | None = None,
    one_per_bag: bool = False,
) -> torch.Tensor:
    """Pool rows ``ids`` (N,) of ``weight`` (R, D) into bags ``offsets`` (S+1,) -> (S, D).

    The gradient reaching ``weight`` is sparse: coalesced, or uncoalesced when every bag
    holds one id (one row per id) or when ``segments`` are given (one row per segment).
    One kernel call each way. With ``grad_sink``, the gradient is passed to it instead of
    autograd's accumulation: a storage whose matrix grows between forward and backward
    (dynamic tables) sizes it to the current matrix, and is told whether its row ids are
    distinct. ``segments`` (from a storage that grouped the ids, see
    :meth:`HashStorage.lookup`) replaces the backward's sort. ``one_per_bag``: the caller
    knows ``offsets`` is ``arange(N + 1)`` (the backward then skips checking it).
    """
    needs_grad = torch.is_grad_enabled() and (
        weight.requires_grad or (per_id_weights is not None and per_id_weights.requires_grad)
    )
    if not needs_grad and weight.dtype == compute_dtype:
        return F.embedding_bag(
            ids, weight, offsets, mode="sum", per_sample_weights=per_id_weights, include_last_offset=True
        )
    return _PooledLookup.apply(weight, ids, offsets, per_id_weights, compute_dtype, grad_sink, segments, one_per_bag)


def bag_scale(
    combiner: str, offsets: torch.Tensor, weights: torch.Tensor | None, n: int, dtype: torch.dtype
) -> torch.Tensor | None:
    """Per-id multipliers (N,) that turn a ``sum`` pooling into ``combiner``; None for plain sum.

    ``mean`` divides by the bag's total weight (its length when unweighted) and ``sqrtn``
    by the root of its summed squared weights, as TensorFlow's ``embedding_lookup_sparse``;
    an empty bag (or one whose weights sum to exactly 0) pools to 0.
    """
    if combiner in ("sum", "none"):
        return None if weights is None else weights.to(dtype)
    lengths = (offsets[1:] - offsets[:-1]).to(torch.int64)  # (B,) (validated: never negative)
    if weights is None:
        per_bag = lengths.to(dtype)
    else:
        bag_of_id = bag_index(offsets, n)
        w = weights.to(dtype)
        per_bag = torch.zeros(lengths.numel(), dtype=dtype, device=offsets.device)
        per_bag = per_bag.index_add(0, bag_of_id, w if combiner == "mean" else w * w)
    nonzero = per_bag != 0
    safe = torch.where(nonzero, per_bag, torch.ones_like(per_bag))  # no inf/nan in either branch's grad
    inv = torch.where(nonzero, safe.rsqrt() if combiner == "sqrtn" else safe.reciprocal(), torch.zeros_like(per_bag))
    scale = torch.repeat_interleave(inv, lengths, output_size=n)  # (N,)
    return scale if weights is None else scale * weights.to(dtype)


def reduce_rows(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse COO gradient (R, D) -> (distinct row ids (U,) ascending, summed rows (U, D)).

    Coalesced input is returned as is; otherwise the duplicates are summed with the same
    sort + ``embedding_bag`` reduction the lookup's backward uses. Autograd's gradient
    accumulation drops the ``is_coalesced`` flag of the lookup's already-reduced gradient,
    so strictly increasing indices are detected with one cheap pass instead of a sort.
    """
    idx, vals = grad._indices()[0], grad._values()
    if grad.is_coalesced() or idx.numel() < 2 or bool((idx[1:] > idx[:-1]).all()):
        return idx, vals
    if idx.numel() < _UNIQUE_BELOW:  # small: unique + index_add_ (measured ~2x faster than the stable sort)
        uniq, inverse = torch.unique(idx, return_inverse=True)  # (U,) ascending, (N,)
        rows = vals.new_zeros(uniq.numel(), vals.shape[1]).index_add_(0, inverse, vals)  # (U, D), in id order
        return uniq, rows
    uniq, perm, seg = sorted_segments(idx, grad.shape[0])
    rows = F.embedding_bag(perm, vals, seg, mode="sum", include_last_offset=True)  # (U, D)
    return uniq, rows


_UNIQUE_BELOW = 32768  # gradients of fewer rows are reduced with unique + index_add_
