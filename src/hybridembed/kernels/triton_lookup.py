"""Triton kernels of a group's lookup and of its update (``kernels="triton"``).

Shape legend: ``N`` ids of a group's batch, ``S`` bags, ``R`` rows of the storage, ``D`` dim,
``U`` distinct rows, ``C`` ids per chunk of the update.

**Forward** (:func:`pooled_lookup`): one launch per group. Bags of one id (one-hot and
sequence features) are a gather of many rows per program; other bags are pooled one bag per
program, ``BLOCK_N`` rows at a time, with the per-id multipliers (combiners and the user's
weights, see :func:`~hybridembed.kernels.bag_scale`) applied on the way. Rows of any storage
dtype (float16, bfloat16, float32, float64) are summed in the compute dtype.

**Backward and update, fused.** The lookup's backward computes nothing: it keeps the output
gradient (S, D) and the ids beside the storage (:meth:`RowStorage.defer_grad`). At the
optimizer step, one pass reduces every distinct row's gradient and applies the optimizer to
that row (SGD, Adagrad, row-wise Adagrad, Adam: FBGEMM's fused backward, moved to the step so
that ``torch.optim``'s semantics hold: several backwards accumulate, ``zero_grad`` drops them):

1. the ids are sorted (``torch.sort``; equal rows side by side), with no host sync;
2. ``_reduce_update``: the sorted ids are cut in chunks of ``C`` (64 ids, 2 warps a program:
   multi-hot Adagrad 3.90 -> 2.67 ms against 32 ids and 4 warps on an H200); a program walks its chunk,
   summing the gradient rows (``grad[bag of id] * weight of id``) of each run of equal ids.
   A run inside the chunk is complete: the optimizer is applied to its row at once, the row
   and its state read and written once. A run cut by the chunk's edge leaves its partial sum
   in a small buffer (two rows per chunk). Where bags hold a few ids (one-hot features), runs
   are short and ``_reduce_update_short`` does the same on the chunk as a tile: every gradient
   row read at once, summed per run by a segmented scan (0.79 -> 0.55 ms for 26 one-hot
   features on an H200, ``benchmarks/sweep_update.py``; the walk is faster for multi-hot bags);
3. ``_carry_partials``: every chunk whose first run began earlier adds its partial sum, with
   one atomic add, to the partial row of the chunk where that run began;
4. ``_finish_runs``: each run that starts in a chunk and goes on past it is updated from that row.

No program walks more than ``C`` ids, and a run over many chunks is gathered by one atomic add
per chunk, so a hot id of a power-law batch (thousands of copies) is spread over many programs
instead of being one serial bag, which is where PyTorch's ``embedding_bag`` backward loses its
time. (The order of those adds varies, so a hot row's last bits may differ between runs.) Every other case (another optimizer, momentum,
per-id weights that need their own gradient, gradient clipping, a sharded collection's hooks)
turns the kept gradient into the eager sparse gradient first (:func:`weight_grad`), so the
result is the eager path's.

Every kernel is tested against the eager ops on the CPU through Triton's interpreter
(``TRITON_INTERPRET=1``, tests/kernels/test_triton_lookup.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused import FUSED, fusable, step_hparams

__all__ = ["pooled_lookup", "FUSED", "fusable", "apply_fused"]

_CHUNK = 64  # sorted ids per program of the update's walk
_UPDATE_WARPS = 2  # warps per program of the update's walk (benchmarks/sweep_update.py)
_TILE_CHUNK = 32  # sorted ids per program of the update's tile (one-hot features)
_TILE_WARPS = 4  # warps per program of the update's tile
_ROWS = 32  # rows per program of the one-id-per-bag gather
_BLOCK_N = 8  # ids read at once per bag of the pooled forward
# launch parameters of the pooled forward, swept on an H200 (benchmarks/sweep_pool.py, bench_gpu.py's
# sizes): one-hot bags 0.097 ms with 8 bags a program and 1 warp (1.18 ms one bag a program, 4
# warps); multi-hot bags of 0..40 ids 0.48 ms with 8 ids at once and 1 warp (0.83 ms with 16 and 2
# warps, 2.1 ms with 4)
_BAGS = 8  # bags per program of the pooled forward of short bags (32 with 2+ warps: Triton 3.6 fails to compile)
_SHORT = 2  # mean ids per bag up to which the forward reads many bags a program
_TILE = 2  # mean ids per bag up to which the update sums its chunk as a tile (the walk above)
_SHORT_WARPS = 1  # warps per program of the short bags' kernel
_POOL_WARPS = 1  # warps per program of the one-bag-a-program kernel


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


# --- forward ---------------------------------------------------------------------------------
@triton.jit
def _gather_rows(
    weight,
    ids,
    psw,
    out,
    n,
    D,
    stride_w,
    HAS_PSW: tl.constexpr,
    ACC: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[i] = weight[ids[i]] * psw[i] for ROWS ids a program (bags of one id)."""
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    im, dm = i < n, d < D
    row = tl.load(ids + i, mask=im, other=0).to(tl.int64)
    m = im[:, None] & dm[None, :]
    x = tl.load(weight + row[:, None] * stride_w + d[None, :], mask=m, other=0.0).to(ACC)  # (ROWS, BLOCK_D)
    if HAS_PSW:
        x = x * tl.load(psw + i, mask=im, other=0.0).to(ACC)[:, None]
    tl.store(out + i.to(tl.int64)[:, None] * D + d[None, :], x, mask=m)


@triton.jit
def _pool_bags(
    weight,
    ids,
    offsets,
    psw,
    out,
    D,
    stride_w,
    HAS_PSW: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[b] = sum over the ids of bag b of weight[id] * psw[id], one bag a program."""
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    start = tl.load(offsets + b)
    end = tl.load(offsets + b + 1)
    acc = tl.zeros([BLOCK_D], dtype=ACC)
    for j in range(start, end, BLOCK_N):
        pos = j + tl.arange(0, BLOCK_N)
        pm = pos < end
        row = tl.load(ids + pos, mask=pm, other=0).to(tl.int64)
        x = tl.load(weight + row[:, None] * stride_w + d[None, :], mask=pm[:, None] & dm[None, :], other=0.0)
        x = x.to(ACC)  # (BLOCK_N, BLOCK_D)
        if HAS_PSW:
            x = x * tl.load(psw + pos, mask=pm, other=0.0).to(ACC)[:, None]
        acc += tl.sum(x, 0)
    tl.store(out + b.to(tl.int64) * D + d, acc, mask=dm)


@triton.jit
def _pool_short_bags(
    weight,
    ids,
    offsets,
    psw,
    out,
    s,
    D,
    stride_w,
    HAS_PSW: tl.constexpr,
    ACC: tl.constexpr,
    BAGS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[b] = sum over the ids of bag b of weight[id] * psw[id], BAGS bags a program: their
    k-th ids are read together, for k up to the longest of them (bags of one or two ids)."""
    b = tl.program_id(0) * BAGS + tl.arange(0, BAGS)  # (BAGS,)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    bm, dm = b < s, d < D
    start = tl.load(offsets + b, mask=bm, other=0)
    end = tl.load(offsets + b + 1, mask=bm, other=0)
    acc = tl.zeros([BAGS, BLOCK_D], dtype=ACC)
    for k in range(0, tl.max(end - start, 0)):
        pos = start + k
        pm = pos < end
        row = tl.load(ids + pos, mask=pm, other=0).to(tl.int64)
        x = tl.load(weight + row[:, None] * stride_w + d[None, :], mask=pm[:, None] & dm[None, :], other=0.0)
        x = x.to(ACC)  # (BAGS, BLOCK_D)
        if HAS_PSW:
            x = x * tl.load(psw + pos, mask=pm, other=0.0).to(ACC)[:, None]
        acc += x
    tl.store(out + b.to(tl.int64)[:, None] * D + d[None, :], acc, mask=bm[:, None] & dm[None, :])


def pool(
    weight: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    psw: torch.Tensor | None,
    compute_dtype: torch.dtype,
    one_per_bag: bool,
) -> torch.Tensor:
    """Rows ``ids`` (N,) of ``weight`` (R, D) pooled into bags ``offsets`` (S+1,) -> (S, D) in
    ``compute_dtype``; ``one_per_bag``: ``offsets`` is ``arange(N + 1)``."""
    n, s, dim = ids.numel(), offsets.numel() - 1, weight.shape[1]
    out = torch.empty(s, dim, dtype=compute_dtype, device=weight.device)
    if s == 0 or dim == 0:
        return out
    if psw is not None:
        psw = psw.contiguous()
    block_d = min(triton.next_power_of_2(dim), 128)
    acc = _acc(compute_dtype)
    if one_per_bag:
        grid = (triton.cdiv(n, _ROWS), triton.cdiv(dim, block_d))
        _gather_rows[grid](
            weight,
            ids,
            psw,
            out,
            n,
            dim,
            weight.stride(0),
            HAS_PSW=psw is not None,
            ACC=acc,
            ROWS=_ROWS,
            BLOCK_D=block_d,
        )
    elif n <= _SHORT * s:  # short bags (one-hot features given as bags): many bags a program
        grid = (triton.cdiv(s, _BAGS), triton.cdiv(dim, block_d))
        _pool_short_bags[grid](
            weight,
            ids,
            offsets,
            psw,
            out,
            s,
            dim,
            weight.stride(0),
            HAS_PSW=psw is not None,
            ACC=acc,
            BAGS=_BAGS,
            BLOCK_D=block_d,
            num_warps=_SHORT_WARPS,
        )
    else:
        grid = (s, triton.cdiv(dim, block_d))
        _pool_bags[grid](
            weight,
            ids,
            offsets,
            psw,
            out,
            dim,
            weight.stride(0),
            HAS_PSW=psw is not None,
            ACC=acc,
            BLOCK_N=_BLOCK_N,
            BLOCK_D=block_d,
            num_warps=_POOL_WARPS,
        )
    return out


class _TritonPooled(torch.autograd.Function):
    """The forward kernel; the backward keeps its gradient beside the storage for the fused update."""

    @staticmethod
    def forward(ctx, weight, ids, offsets, psw, compute_dtype, storage, one_per_bag):
        ctx.storage = storage
        ctx.one_per_bag = one_per_bag
        ctx.save_for_backward(ids, offsets, psw)
        return pool(weight, ids, offsets, psw, compute_dtype, one_per_bag)

    @staticmethod
    def backward(ctx, grad):  # (S, D)
        ids, offsets, psw = ctx.saved_tensors
        ctx.storage.defer_grad(ids, grad.contiguous(), offsets, psw, ctx.one_per_bag)
        return None, None, None, None, None, None, None


def pooled_lookup(
    storage,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    psw: torch.Tensor | None,
    compute_dtype: torch.dtype,
    one_per_bag: bool,
) -> torch.Tensor:
    """:func:`hybridembed.kernels.pooled_lookup` with Triton kernels: ``storage.weight``'s rows
    ``ids`` (N,) pooled into bags ``offsets`` (S+1,) -> (S, D). The gradient is kept by
    ``storage`` (see the module docstring). Per-id weights that need a gradient of their own
    are the caller's to send to the eager path."""
    weight = storage.weight
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return pool(weight.detach(), ids, offsets, psw, compute_dtype, one_per_bag)
    return _TritonPooled.apply(weight, ids, offsets, psw, compute_dtype, storage, one_per_bag)


# --- the fused reduce and update -------------------------------------------------------------
@triton.jit
def _update_rows(
    weight,
    s1,
    s2,
    rows,
    g,
    keep_row,
    d,
    dm,
    D,
    stride_w,
    stride_s,
    lr,
    eps,
    b1,
    b2,
    wd,
    OPT: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    SKIP_ZERO: tl.constexpr,
    ACC: tl.constexpr,
):
    """One optimizer step on the rows ``rows`` (M,) where ``keep_row`` (M,), with their summed
    gradients ``g`` (M, BLOCK_D) in ACC. The hyper-parameters arrive in float64 (a Python float
    would be float32): exact for a float64 table, rounded once to float32 for the others (as the
    eager ops round them)."""
    c1, c2 = 1.0 - b1, 1.0 - b2
    if ACC != tl.float64:
        lr, eps, wd = tl.cast(lr, ACC), tl.cast(eps, ACC), tl.cast(wd, ACC)
        c1, b2, c2 = tl.cast(c1, ACC), tl.cast(b2, ACC), tl.cast(c2, ACC)
    if SKIP_ZERO:  # a dynamic table's default row is never updated
        keep_row = keep_row & (rows != 0)
    keep = keep_row[:, None] & dm[None, :]
    rows = rows.to(tl.int64)
    wp = weight + rows[:, None] * stride_w + d[None, :]
    w = tl.load(wp, mask=keep, other=0.0).to(ACC)
    if MAXIMIZE:
        g = -g
    g = g + wd * w  # L2 weight decay (wd = 0: none)
    if OPT == 0:  # SGD
        w = w - lr * g
    elif OPT == 1:  # Adagrad: lr is the decayed lr of this step
        sp = s1 + rows[:, None] * stride_s + d[None, :]
        s = tl.load(sp, mask=keep, other=0.0) + g * g
        tl.store(sp, s, mask=keep)
        w = w - lr * (g / (tl.sqrt(s) + eps))
    elif OPT == 2:  # row-wise Adagrad: one accumulator per row, the mean square of the row's gradient
        ms = tl.sum(tl.where(dm[None, :], g * g, 0.0), 1) / D  # (M,)
        s = tl.load(s1 + rows, mask=keep_row, other=0.0) + ms
        tl.store(s1 + rows, s, mask=keep_row)
        w = w - lr * (g * (1.0 / (tl.sqrt(s) + eps))[:, None])
    else:  # Adam (SparseAdam's formula): lr is the bias-corrected step size
        mp = s1 + rows[:, None] * stride_s + d[None, :]
        vp = s2 + rows[:, None] * stride_s + d[None, :]
        m = tl.load(mp, mask=keep, other=0.0)
        v = tl.load(vp, mask=keep, other=0.0)
        m = m + c1 * (g - m)
        v = v * b2 + c2 * (g * g)
        tl.store(mp, m, mask=keep)
        tl.store(vp, v, mask=keep)
        w = w - lr * (m / (tl.sqrt(v) + eps))
    tl.store(wp, w.to(weight.dtype.element_ty), mask=keep)


@triton.jit
def _reduce_update(
    sorted_ids,
    perm,
    bag_of,
    psw,
    grad,
    buf,
    weight,
    s1,
    s2,
    N,
    D,
    stride_w,
    stride_s,
    lr: tl.float64,
    eps: tl.float64,
    b1: tl.float64,
    b2: tl.float64,
    wd: tl.float64,
    HOT1: tl.constexpr,
    HAS_PSW: tl.constexpr,
    OPT: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    SKIP_ZERO: tl.constexpr,
    ACC: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Chunk c of the sorted ids: complete runs updated here, cut runs' partial sums to buf[c].

    The walk, id by id, one (BLOCK_D,) row in registers: for long runs (multi-hot bags), where a
    program holds little and many run at once (faster than :func:`_reduce_update_short` there)."""
    c = tl.program_id(0)
    p0 = c * CHUNK
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    first = tl.load(sorted_ids + p0)
    prev = tl.load(sorted_ids + p0 - 1, mask=p0 > 0, other=-1)
    head = (p0 > 0) & (prev == first)  # the chunk's first run began in an earlier chunk
    acc = tl.zeros([BLOCK_D], dtype=ACC)
    for k in range(0, CHUNK):
        p = p0 + k
        if p < N:
            row = tl.load(sorted_ids + p)
            src = tl.load(perm + p).to(tl.int64)  # the id's position in the batch
            if HOT1:
                bag = src
            else:
                bag = tl.load(bag_of + src)
            g = tl.load(grad + bag * D + d, mask=dm, other=0.0).to(ACC)
            if HAS_PSW:
                g = g * tl.load(psw + src).to(ACC)
            acc += g
            nxt = tl.load(sorted_ids + p + 1, mask=p + 1 < N, other=-1)
            if nxt != row:  # the run ends here
                if head:  # (began in an earlier chunk: _finish_runs completes it)
                    tl.store(buf + (2 * c) * BLOCK_D + d, acc)
                else:
                    one = tl.arange(0, 1)
                    _update_rows(
                        weight,
                        s1,
                        s2,
                        row + one,
                        acc[None, :],
                        one == 0,
                        d,
                        dm,
                        D,
                        stride_w,
                        stride_s,
                        lr,
                        eps,
                        b1,
                        b2,
                        wd,
                        OPT,
                        MAXIMIZE,
                        SKIP_ZERO,
                        ACC,
                    )
                acc = tl.zeros([BLOCK_D], dtype=ACC)
                head = p < 0  # (False, as a tensor: the loop carries one type)
            elif k == CHUNK - 1:  # the chunk ends inside a run
                if head:
                    tl.store(buf + (2 * c) * BLOCK_D + d, acc)
                else:
                    tl.store(buf + (2 * c + 1) * BLOCK_D + d, acc)


@triton.jit
def _segment_add(a, a_starts, b, b_starts):
    """The combine of a segmented sum: ``b`` restarts the sum where a segment starts in it."""
    return tl.where(b_starts != 0, b, a + b), a_starts | b_starts


@triton.jit
def _reduce_update_short(
    sorted_ids,
    perm,
    bag_of,
    psw,
    grad,
    buf,
    weight,
    s1,
    s2,
    N,
    D,
    stride_w,
    stride_s,
    lr: tl.float64,
    eps: tl.float64,
    b1: tl.float64,
    b2: tl.float64,
    wd: tl.float64,
    HOT1: tl.constexpr,
    HAS_PSW: tl.constexpr,
    OPT: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    SKIP_ZERO: tl.constexpr,
    ACC: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """:func:`_reduce_update` for short runs (one-hot features): the chunk's gradient rows read at
    once, a (CHUNK, BLOCK_D) tile, summed per run by a segmented scan and the runs' rows updated
    together, no load waiting for the one before it."""
    c = tl.program_id(0)
    p0 = c * CHUNK
    k = tl.arange(0, CHUNK)
    p = p0 + k
    pm = p < N
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    row = tl.load(sorted_ids + p, mask=pm, other=-1)
    prev = tl.load(sorted_ids + p - 1, mask=pm & (p > 0), other=-1)
    nxt = tl.load(sorted_ids + p + 1, mask=p + 1 < N, other=-1)
    src = tl.load(perm + p, mask=pm, other=0).to(tl.int64)  # each id's position in the batch
    if HOT1:
        bag = src
    else:
        bag = tl.load(bag_of + src, mask=pm, other=0)
    g = tl.load(grad + bag[:, None] * D + d[None, :], mask=pm[:, None] & dm[None, :], other=0.0).to(ACC)
    if HAS_PSW:
        g = g * tl.load(psw + src, mask=pm, other=0.0).to(ACC)[:, None]
    starts = tl.broadcast_to(((row != prev) | (k == 0)).to(tl.int32)[:, None], (CHUNK, BLOCK_D))
    sums, _ = tl.associative_scan((g, starts), 0, _segment_add)  # at a run's last id: the run's sum
    first = tl.load(sorted_ids + p0)
    before = tl.load(sorted_ids + p0 - 1, mask=p0 > 0, other=-1)  # (-1: no id)
    in_head = (row == first) & (
        row == before
    )  # the chunk's first run, begun in an earlier chunk (_finish_runs ends it)
    ends = pm & ((nxt != row) | (k == CHUNK - 1))  # a run's last id in this chunk
    cut = ends & (nxt == row)  # the chunk ends inside the run
    _update_rows(
        weight,
        s1,
        s2,
        row,
        sums,
        ends & ~cut & ~in_head,
        d,
        dm,
        D,
        stride_w,
        stride_s,
        lr,
        eps,
        b1,
        b2,
        wd,
        OPT,
        MAXIMIZE,
        SKIP_ZERO,
        ACC,
    )
    slot = tl.where(
        in_head, 2 * c, 2 * c + 1
    )  # partial sums: the first run's to buf[2c], a cut last one's to buf[2c + 1]
    tl.store(buf + slot[:, None] * BLOCK_D + d[None, :], sums, mask=((ends & in_head) | (cut & ~in_head))[:, None])


@triton.jit
def _carry_partials(sorted_ids, run_chunk, buf, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Chunk c's first run, when it began in an earlier chunk c0: its partial sum added to buf[c0]'s
    second row (c0's last run, the same run), atomically: one add per chunk the run covers."""
    c = tl.program_id(0)
    p0 = c * CHUNK
    d = tl.arange(0, BLOCK_D)
    first = tl.load(sorted_ids + p0)
    prev = tl.load(sorted_ids + p0 - 1, mask=p0 > 0, other=-1)
    if (p0 > 0) & (prev == first):
        c0 = tl.load(run_chunk + c)
        tl.atomic_add(buf + (2 * c0 + 1) * BLOCK_D + d, tl.load(buf + (2 * c) * BLOCK_D + d))


@triton.jit
def _finish_runs(
    sorted_ids,
    buf,
    weight,
    s1,
    s2,
    N,
    D,
    stride_w,
    stride_s,
    lr: tl.float64,
    eps: tl.float64,
    b1: tl.float64,
    b2: tl.float64,
    wd: tl.float64,
    OPT: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    SKIP_ZERO: tl.constexpr,
    ACC: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The run that starts in chunk c and goes on past it (if any): its sum, gathered in buf[c]'s
    second row by _carry_partials, applied."""
    c = tl.program_id(0)
    p0 = c * CHUNK
    q = tl.minimum(p0 + CHUNK, N) - 1  # the chunk's last position
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    row = tl.load(sorted_ids + q)
    nxt = tl.load(sorted_ids + q + 1, mask=q + 1 < N, other=-1)
    first = tl.load(sorted_ids + p0)
    prev = tl.load(sorted_ids + p0 - 1, mask=p0 > 0, other=-1)
    through = (p0 > 0) & (prev == first) & (first == row)  # the run began before this chunk
    if (nxt == row) & (through == 0):
        one = tl.arange(0, 1)
        acc = tl.load(buf + (2 * c + 1) * BLOCK_D + one[:, None] * 0 + d[None, :])  # (1, BLOCK_D)
        _update_rows(
            weight,
            s1,
            s2,
            row + one,
            acc,
            one == 0,
            d,
            dm,
            D,
            stride_w,
            stride_s,
            lr,
            eps,
            b1,
            b2,
            wd,
            OPT,
            MAXIMIZE,
            SKIP_ZERO,
            ACC,
        )


def last_start(inside: torch.Tensor) -> torch.Tensor:
    """(C,) bool, False at 0 -> (C,) int64: for each chunk the last chunk at or before it not
    ``inside`` (a run begins there). The cumulative max of those indices, taken as a count and
    a scatter: CUDA's cummax scans a 1-D tensor in one block (0.7 ms for 266k chunks on an H200)."""
    k = torch.cumsum(~inside, 0)  # (C,) >= 1: the run-beginning chunks so far
    at = torch.zeros(inside.numel() + 1, dtype=torch.int64, device=inside.device)
    at[torch.where(inside, 0, k)] = torch.arange(inside.numel(), device=inside.device)  # (slot 0: a sink)
    return at[k]


def apply_fused(
    storage,
    ids: torch.Tensor,
    grad: torch.Tensor,
    bag_of: torch.Tensor | None,
    psw: torch.Tensor | None,
    hp: dict,
    scale: float = 1.0,
) -> None:
    """One optimizer step of ``storage`` from a kept lookup gradient: ids (N,) (row slots),
    the bags' gradient ``grad`` (S, D), each id's bag ``bag_of`` (N,) (None: id i is bag i) and
    multiplier ``psw`` (N,) or None, times ``scale`` (a sharded job's mean over ranks: one pass
    over ``grad`` here). Duplicate ids are summed first (one update per row, as the dense
    optimizer on ``nn.Embedding``). ``storage.step`` must already count this step."""
    n, dim = ids.numel(), storage.dim
    if n == 0:
        return
    if scale != 1.0:
        grad = grad * scale
    opt = storage.optimizer
    h = step_hparams(opt, hp, storage.step)
    names = list(opt.state_spec(hp))
    weight = storage.weight.detach()
    s1 = storage.state[names[0]] if names else weight
    s2 = storage.state[names[1]] if len(names) > 1 else s1
    key = ids.to(torch.int32) if weight.shape[0] < 2**31 else ids.to(torch.int64)
    sorted_ids, perm = torch.sort(key, stable=True)  # (N,): equal rows side by side, in batch order
    short = bag_of is None or n <= _TILE * grad.shape[0]  # (one-hot features: runs of a few ids)
    chunk, warps = (_TILE_CHUNK, _TILE_WARPS) if short else (_CHUNK, _UPDATE_WARPS)
    chunks = triton.cdiv(n, chunk)
    block_d = triton.next_power_of_2(dim)
    acc = _acc(storage.compute_dtype)
    buf = torch.empty(2 * chunks, block_d, dtype=storage.compute_dtype, device=weight.device)
    if bag_of is not None and bag_of.dtype != torch.int64:
        bag_of = bag_of.to(torch.int64)
    args = (weight, s1, s2, n, dim, weight.stride(0), s1.stride(0), h.lr, h.eps, h.b1, h.b2, h.weight_decay)
    flags = dict(
        OPT=h.opt,
        MAXIMIZE=h.maximize,
        SKIP_ZERO=bool(storage.keyed),
        ACC=acc,
        CHUNK=chunk,
        BLOCK_D=block_d,
    )
    (_reduce_update_short if short else _reduce_update)[(chunks,)](
        sorted_ids,
        perm,
        bag_of,
        psw,
        grad,
        buf,
        *args,
        HOT1=bag_of is None,
        HAS_PSW=psw is not None,
        num_warps=warps,
        **flags,
    )
    # per chunk, the chunk where the run at its start began: read off the chunks' edges only (a scan
    # over N / C values, no host sync). A chunk lying wholly inside a run begun earlier passes it on.
    firsts = torch.arange(0, n, chunk, device=weight.device)  # (chunks,) each chunk's first position
    first = sorted_ids.index_select(0, firsts)
    last = sorted_ids.index_select(0, (firsts + chunk - 1).clamp_(max=n - 1))
    before = torch.cat([first.new_full((1,), -1), sorted_ids.index_select(0, firsts[1:] - 1)])
    inside = (before == first) & (first == last)  # the chunk lies inside a run begun before it
    run_chunk = torch.cat([inside.new_zeros(1, dtype=torch.int64), last_start(inside)[:-1]])  # (chunks,)
    _carry_partials[(chunks,)](sorted_ids, run_chunk, buf, CHUNK=chunk, BLOCK_D=block_d)
    _finish_runs[(chunks,)](sorted_ids, buf, *args, **flags)
