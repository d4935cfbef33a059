"""The Numba kernels of :mod:`hybridembed.kernels.cpu_fused` (imported only when Numba is).

Compiled on first use and cached on disk (``cache=True``: Numba's cache beside this file, or
its user-wide cache where this directory is read-only), so a later process loads them in
milliseconds. Every kernel releases the GIL (``nogil``): :mod:`.cpu_fused` runs one slice of
the rows per thread.

Arrays, as NumPy views of the storage's tensors: ``weight`` (R, D); ``s1``, ``s2`` the
optimizer's state as 2-D arrays (a row-wise state (R,) viewed as (R, 1); a dummy (1, 1) when
the optimizer has none); ``hp`` the step's numbers in the compute dtype: ``[lr, eps, 1 - b1,
b2, 1 - b2, weight_decay, D, 1, 0, scale]`` (``scale`` multiplies each row's gradient as it is
read; see :mod:`.fused` for the formulas; the constants come typed from it: a Python number
would make Numba compute a float32 table in float64).

One kernel per optimizer (its arithmetic without branches in the row loop). A step is bound by
memory latency, not arithmetic: the rows of a batch are scattered over the table, and each
row's update waits for its row and its state. So each kernel asks for the row and state
``_AHEAD`` rows ahead (``llvm.prefetch``, every cache line of them) while it updates this one: 2.2x faster than
without (26 x 200k x 64 float32, 213k ids, row-wise Adagrad, 1 thread).
"""

from __future__ import annotations

import numpy as np
from llvmlite import binding as _llvm
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.cpython.unsafe.numbers import trailing_zeros as _trailing_zeros
from numba.extending import intrinsic

__all__ = ["ROW_KERNELS"]

_AHEAD = 4  # rows ahead that are prefetched
_AHEAD_IDS = 16  # ids ahead whose row and gradient are prefetched (ids_sgd)
_LINES = 8  # cache lines of a row prefetched by straight hints (_prefetch_row); more by a loop
_OPAQUE = _llvm.llvm_version_info[0] >= 15  # LLVM with opaque pointers names the intrinsic by address space only


def _hint_fn(builder):
    """``llvm.prefetch`` declared in the builder's module, taking an i8 pointer (every declaration alike)."""
    i32 = ir.IntType(32)
    fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32])
    return cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0" if _OPAQUE else "llvm.prefetch.p0i8")


@intrinsic
def _prefetch(typingctx, arr, row):
    """A hint that ``arr[row, 0]``'s cache line will be read and written soon (no fault, no wait)."""
    sig = types.void(arr, row)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        zero = context.get_constant(types.intp, 0)
        idx = [context.cast(builder, args[1], signature.args[1], types.intp)] + [zero] * (aryty.ndim - 1)
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, idx, wraparound=False, boundscheck=False)
        i32 = ir.IntType(32)
        ptr = builder.bitcast(ptr, ir.IntType(8).as_pointer())
        builder.call(_hint_fn(builder), [ptr, i32(1), i32(3), i32(1)])  # (write, keep in all caches, data)
        return context.get_dummy_value()

    return sig, codegen


def _row_codegen(write: int):
    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        zero = context.get_constant(types.intp, 0)
        r = context.cast(builder, args[1], signature.args[1], types.intp)
        ptr = cgutils.get_item_pointer(
            context, builder, aryty, ary, [r] + [zero] * (aryty.ndim - 1), wraparound=False, boundscheck=False
        )
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        base = builder.bitcast(ptr, i8p)
        item = context.get_constant(types.intp, context.get_abi_sizeof(context.get_data_type(aryty.dtype)))
        width = builder.extract_value(ary.shape, 1) if aryty.ndim > 1 else context.get_constant(types.intp, 1)
        lines = builder.udiv(
            builder.add(builder.mul(width, item), context.get_constant(types.intp, 63)),
            context.get_constant(types.intp, 64),
        )
        fn = _hint_fn(builder)

        def line(k):  # (the hint for line k of the row)
            at = builder.gep(base, [builder.mul(k, context.get_constant(types.intp, 64))])
            builder.call(fn, [at, i32(write), i32(3), i32(1)])

        # rows of up to _LINES lines: one jump into straight hints (a loop's counter, compare and
        # branch a line cost the step of 2.1M ids ~2 ms); longer rows: a loop. No row r (as in a
        # (1, 1) stand-in for absent state): no hint, tested before the jump, so that the jump's
        # count of lines is the same for every row (a count made 0 for such rows cost ~3 ms more)
        end = builder.append_basic_block("prefetched")
        inside = builder.append_basic_block("row_inside")
        longer = builder.append_basic_block("longer_row")
        builder.cbranch(builder.icmp_unsigned("<", r, builder.extract_value(ary.shape, 0)), inside, end)
        builder.position_at_end(inside)
        cases = [builder.append_basic_block(f"lines_{n}") for n in range(_LINES + 1)]
        switch = builder.switch(lines, longer)
        for n, block in enumerate(cases):
            switch.add_case(n, block)
        for n, block in enumerate(cases):  # (n lines: line n - 1, then the n - 1 before it)
            builder.position_at_end(block)
            if n:
                line(context.get_constant(types.intp, n - 1))
            builder.branch(cases[n - 1] if n > 1 else end)
        builder.position_at_end(longer)
        with cgutils.for_range(builder, lines) as loop:
            line(loop.index)
        builder.branch(end)
        builder.position_at_end(end)
        return context.get_dummy_value()

    return codegen


@intrinsic
def _prefetch_row(typingctx, arr, r):
    """Every cache line of ``arr[r]`` (a row of 64 float32 spans four) asked for, to be read and
    written. In LLVM IR from the row's address: a row taken as a view (``arr[r]``) counts a reference
    to the array, an atomic add that the threads of a step contend for (the step of 2.1M ids
    bucket by bucket, 2 threads: 63 -> 54 ms, with a row past the array tested before the jump)."""
    return types.void(arr, r), _row_codegen(1)


@intrinsic
def _prefetch_row_read(typingctx, arr, r):
    """Every cache line of ``arr[r]`` asked for, to be read only (for rows a loop only reads; in
    :func:`bucket_walk` the same speed as a write's hint, measured)."""
    return types.void(arr, r), _row_codegen(0)


@njit(nogil=True, cache=True, inline="always")
def _ahead_rows(weight, s1, s2, ids, u, hi):  # pragma: no cover (compiled)
    if u + _AHEAD < hi:
        r = ids[u + _AHEAD]
        _prefetch_row(weight, r)
        _prefetch_row(s1, r)
        _prefetch_row(s2, r)


@njit(nogil=True, cache=True, inline="always")
def _row_grad(g, weight, row, u, grad, hp, maximize):  # pragma: no cover (compiled)
    dim = g.shape[0]
    scale = hp[9]
    for d in range(dim):
        g[d] = grad[u, d] * scale
    if maximize:
        for d in range(dim):
            g[d] = -g[d]
    wd = hp[5]
    if wd != 0:
        for d in range(dim):
            g[d] += wd * weight[row, d]


# --- one optimizer step on one row, g its gradient -------------------------------------------------------
@njit(nogil=True, cache=True, inline="always")
def _sgd(weight, s1, s2, row, g, ms, hp):  # pragma: no cover (compiled)
    lr = hp[0]
    for d in range(g.shape[0]):
        weight[row, d] -= lr * g[d]


@njit(nogil=True, cache=True, inline="always")
def _adagrad(weight, s1, s2, row, g, ms, hp):  # pragma: no cover (compiled)
    lr, eps = hp[0], hp[1]
    for d in range(g.shape[0]):
        s = s1[row, d] + g[d] * g[d]
        s1[row, d] = s
        weight[row, d] -= lr * (g[d] / (np.sqrt(s) + eps))


@njit(nogil=True, cache=True, inline="always")
def _rowwise(weight, s1, s2, row, g, ms, hp):  # pragma: no cover (compiled)
    """``ms`` < 0: the row's mean squared gradient is taken from ``g`` (else given: column slices),
    summed in eight running sums kept in registers (one sum was a chain of dependent adds, each
    waiting for the last: the update of 562k scattered rows 33.5 -> 20.8 ms on 2 threads)."""
    lr, eps = hp[0], hp[1]
    if ms < 0:
        dim = g.shape[0]
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = hp[8]
        d8 = dim - dim % 8
        for d in range(0, d8, 8):
            a0 += g[d] * g[d]
            a1 += g[d + 1] * g[d + 1]
            a2 += g[d + 2] * g[d + 2]
            a3 += g[d + 3] * g[d + 3]
            a4 += g[d + 4] * g[d + 4]
            a5 += g[d + 5] * g[d + 5]
            a6 += g[d + 6] * g[d + 6]
            a7 += g[d + 7] * g[d + 7]
        for d in range(d8, dim):
            a0 += g[d] * g[d]
        ms = (((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))) / hp[6]
    s = s1[row, 0] + ms
    s1[row, 0] = s
    r = hp[7] / (np.sqrt(s) + eps)
    for d in range(g.shape[0]):
        weight[row, d] -= lr * (g[d] * r)


@njit(nogil=True, cache=True, inline="always")
def _adam(weight, s1, s2, row, g, ms, hp):  # pragma: no cover (compiled)
    lr, eps, c1, b2, c2 = hp[0], hp[1], hp[2], hp[3], hp[4]
    for d in range(g.shape[0]):
        m = s1[row, d]
        m = m + c1 * (g[d] - m)
        v = s2[row, d] * b2 + c2 * (g[d] * g[d])
        s1[row, d] = m
        s2[row, d] = v
        weight[row, d] -= lr * (m / (np.sqrt(v) + eps))


# --- the kernels: distinct rows (update; their gradients summed before, by embedding_bag over the sorted ids:
# a kernel that summed each run of sorted ids itself lost to it, measured) and each id in place (SGD) -----------
# rows_*(weight, s1, s2, ids, grad, row_stat, lo, hi, hp, maximize): rows ids[lo:hi] (distinct) with their summed
# gradients; row_stat (U,) the rows' mean squared gradients for row-wise Adagrad over column slices (empty: from grad).
# (written out per optimizer, not made by a factory: Numba caches module-level functions only)
@njit(nogil=True, cache=True)
def rows_sgd(weight, s1, s2, ids, grad, row_stat, lo, hi, hp, maximize):  # pragma: no cover
    g = np.empty(weight.shape[1], dtype=grad.dtype)
    minus = hp[8] - hp[7]
    for u in range(lo, hi):
        _ahead_rows(weight, s1, s2, ids, u, hi)
        row = ids[u]
        _row_grad(g, weight, row, u, grad, hp, maximize)
        _sgd(weight, s1, s2, row, g, row_stat[u] if row_stat.shape[0] > 0 else minus, hp)


@njit(nogil=True, cache=True)
def rows_adagrad(weight, s1, s2, ids, grad, row_stat, lo, hi, hp, maximize):  # pragma: no cover
    g = np.empty(weight.shape[1], dtype=grad.dtype)
    minus = hp[8] - hp[7]
    for u in range(lo, hi):
        _ahead_rows(weight, s1, s2, ids, u, hi)
        row = ids[u]
        _row_grad(g, weight, row, u, grad, hp, maximize)
        _adagrad(weight, s1, s2, row, g, row_stat[u] if row_stat.shape[0] > 0 else minus, hp)


@njit(nogil=True, cache=True)
def rows_rowwise(weight, s1, s2, ids, grad, row_stat, lo, hi, hp, maximize):  # pragma: no cover
    g = np.empty(weight.shape[1], dtype=grad.dtype)
    minus = hp[8] - hp[7]
    for u in range(lo, hi):
        _ahead_rows(weight, s1, s2, ids, u, hi)
        row = ids[u]
        _row_grad(g, weight, row, u, grad, hp, maximize)
        _rowwise(weight, s1, s2, row, g, row_stat[u] if row_stat.shape[0] > 0 else minus, hp)


@njit(nogil=True, cache=True)
def rows_adam(weight, s1, s2, ids, grad, row_stat, lo, hi, hp, maximize):  # pragma: no cover
    g = np.empty(weight.shape[1], dtype=grad.dtype)
    minus = hp[8] - hp[7]
    for u in range(lo, hi):
        _ahead_rows(weight, s1, s2, ids, u, hi)
        row = ids[u]
        _row_grad(g, weight, row, u, grad, hp, maximize)
        _adam(weight, s1, s2, row, g, row_stat[u] if row_stat.shape[0] > 0 else minus, hp)


# optimizer code (kernels.fused.FUSED) -> kernel
ROW_KERNELS = (rows_sgd, rows_adagrad, rows_rowwise, rows_adam)


@njit(nogil=True, cache=True)
def ids_sgd(weight, ids, bag_of, psw, grad, hp, maximize, skip_zero, part, parts):  # pragma: no cover
    """SGD without weight decay is linear in the gradient, so each id's gradient (its bag's row
    ``grad[bag_of[i]]``, bag_of empty: ``grad[i]``, times ``psw[i]``; psw empty: 1) times ``scale`` is
    applied to its row where it lies, in batch order: no sort, no reduced (U, D) gradient. This
    call takes the rows ``row % parts == part`` (each row on one thread, its ids in batch order
    whatever the threads); ``skip_zero``: slot 0 (a dynamic table's default row) is never updated."""
    n, dim = ids.shape[0], weight.shape[1]
    bags = bag_of.shape[0] > 0
    step = -hp[0] * hp[9] if not maximize else hp[0] * hp[9]  # (-lr * scale: w += step * g)
    for i in range(n):
        if i + _AHEAD_IDS < n:
            j = i + _AHEAD_IDS
            if ids[j] % parts == part:
                _prefetch_row(weight, ids[j])
                _prefetch_row(grad, bag_of[j] if bags else j)
        row = ids[i]
        if row % parts != part or (skip_zero and row == 0):
            continue
        b = bag_of[i] if bags else i
        m = step * psw[i] if psw.shape[0] > 0 else step
        for d in range(dim):
            weight[row, d] += m * grad[b, d]


@njit(nogil=True, cache=True)
def bag_rows(offsets, rows_of, lo, hi, out):  # pragma: no cover (compiled)
    """Each id of bags ``lo:hi`` (``offsets`` (S+1,)) -> its bag's gradient row ``rows_of[b]`` (empty: b)."""
    mapped = rows_of.shape[0] > 0
    for b in range(lo, hi):
        r = rows_of[b] if mapped else b
        for i in range(offsets[b], offsets[b + 1]):
            out[i] = r


# --- grouping a batch's ids by row without a comparison sort (cpu_fused.group_by_row) ---------------------------
# A counting sort in two levels: ids into buckets of 2**shift rows (a slice of the ids per thread, each with
# its own counts: bucket_counts, then bucket_scatter), then each bucket's ids by row with one array of
# 2**shift counts that stays in the core's cache (bucket_rows). Stable: a row's ids keep batch order.
# bucket_counts cuts a thread's slice into a few consecutive pieces, each with its own counts, walked
# abreast: an id's count waits for the last store to the same count, and ids of one bucket follow each
# other (power-law ids, few buckets), so one piece at a time is a chain of dependent increments (2.1M
# ids on one thread: 3.2 ms counted one by one, 1.6 ms four abreast). (The scatter, walked so, was slower:
# four times the places written at once.)
@njit(nogil=True, cache=True)
def bucket_counts(ids, rows, shift, los, his, counts):  # pragma: no cover (compiled)
    """``counts[k, b]`` += the ids of piece k (``ids[los[k]:his[k]]``) in bucket b (rows ``b << shift``
    ..); returns an id not in ``0 .. rows - 1`` (counting stops there), or -1."""
    pieces = los.shape[0]
    m = his[0] - los[0]
    for k in range(pieces):
        m = min(m, his[k] - los[k])
    for j in range(m):
        for k in range(pieces):
            i = los[k] + j
            r = ids[i]
            if r < 0 or r >= rows:
                return i
            counts[k, r >> shift] += 1
    for k in range(pieces):
        for i in range(los[k] + m, his[k]):
            r = ids[i]
            if r < 0 or r >= rows:
                return i
            counts[k, r >> shift] += 1
    return -1


@njit(nogil=True, cache=True)
def bucket_scatter(ids, offsets, rows_of, psw, shift, lo, hi, at, b_ids, b_src, b_w):  # pragma: no cover
    """The ids of bags ``lo:hi`` (``offsets`` (S+1,); empty: bag b holds id b) into their buckets' places
    (``at[b]``: the next place of bucket b, advanced), each with its gradient row, its bag's
    (``rows_of[b]``; empty: b: no (N,) array of them made and read first), and multiplier (``psw[i]``;
    empty: none)."""
    one, mapped, weighted = offsets.shape[0] == 0, rows_of.shape[0] > 0, psw.shape[0] > 0
    for bag in range(lo, hi):
        src = rows_of[bag] if mapped else bag
        s, e = (bag, bag + 1) if one else (offsets[bag], offsets[bag + 1])
        for i in range(s, e):
            r = ids[i]
            b = r >> shift
            p = at[b]
            at[b] = p + 1
            b_ids[p] = r
            b_src[p] = src
            if weighted:
                b_w[p] = psw[i]


@njit(nogil=True, cache=True, inline="always")
def _take_marked(seen, low, high, out, at):  # pragma: no cover (compiled)
    """The rows marked in ``seen`` (a bit a row, words ``low >> 6`` to ``high >> 6``), ascending, into
    ``out[at:]``, found by their trailing zeros, the words left zeros; returns their number."""
    one = np.uint64(1)
    m = at
    for j in range(low >> 6, (high >> 6) + 1):
        word = seen[j]
        if word == 0:
            continue
        seen[j] = 0
        while word != 0:
            out[m] = (j << 6) + _trailing_zeros(word)
            word &= word - one
            m += 1
    return m - at


@njit(nogil=True, cache=True)
def bucket_rows(
    b_ids, b_src, b_w, starts, shift, lo, hi, counts, seen, src, w, rows, first, distinct
):  # pragma: no cover
    """Buckets ``lo:hi`` (their ids at ``starts[b]:starts[b + 1]``) sorted by row, stably: each id's
    gradient row into ``src`` (and multiplier into ``w``) at its sorted place; bucket b's distinct
    rows ascending into ``rows[starts[b]:]``, each one's first sorted place into ``first[starts[b]:]``,
    their number into ``distinct[b]``. ``counts`` (2**shift,) int32 zeros and ``seen`` (a bit a row
    of the bucket: (2**shift + 63) // 64,) uint64 zeros, both left zeros. The rows with ids are
    found from the bits (64 rows a word, each set bit by its trailing zeros): a bucket costs its
    ids and its distinct rows, not a walk over every row's count (one-hot batches: 26 x 8,192 ids
    of 5.2M rows, 6.4 -> 1.3 ms on one thread; 2.1M ids, 17 -> 12 ms)."""
    mask = (1 << shift) - 1
    weighted = w.shape[0] > 0
    one = np.uint64(1)
    for b in range(lo, hi):
        s, e = starts[b], starts[b + 1]
        if s == e:
            distinct[b] = 0
            continue
        low, high = mask, 0
        for i in range(s, e):
            k = b_ids[i] & mask
            counts[k] += 1
            seen[k >> 6] |= one << np.uint64(k & 63)
            low = min(low, k)
            high = max(high, k)
        d, place = _take_marked(seen, low, high, rows, s), s
        for q in range(s, s + d):
            k = rows[q]
            c = counts[k]
            rows[q] = (b << shift) + k
            first[q] = place
            counts[k] = place
            place += c
        distinct[b] = d
        for i in range(s, e):
            k = b_ids[i] & mask
            p = counts[k]
            counts[k] = p + 1
            src[p] = b_src[i]
            if weighted:
                w[p] = b_w[i]
        for j in range(s, s + d):
            counts[rows[j] & mask] = 0


@njit(nogil=True, cache=True, inline="always")
def _step_row(opt, weight, s1, s2, row, g, ms, hp):  # pragma: no cover (compiled)
    """One row stepped by optimizer ``opt`` (the code of :data:`ROW_KERNELS`) with its gradient ``g``."""
    if opt == 0:
        _sgd(weight, s1, s2, row, g, ms, hp)
    elif opt == 1:
        _adagrad(weight, s1, s2, row, g, ms, hp)
    elif opt == 2:
        _rowwise(weight, s1, s2, row, g, ms, hp)
    else:
        _adam(weight, s1, s2, row, g, ms, hp)


@njit(nogil=True, cache=True, inline="always")
def _step_marked(rows, m, base, acc, weight, s1, s2, opt, hp, maximize, skip_zero):  # pragma: no cover (compiled)
    """Rows ``base + rows[:m]`` (ascending) stepped by optimizer ``opt`` with their sums ``acc[rows[q]]``
    (times ``scale``; used up: the step's gradient is made in place), the next rows' row and state
    prefetched; row 0 skipped where ``skip_zero``."""
    ms = hp[8] - hp[7]
    for q in range(m):
        if q + _AHEAD < m:
            r = base + rows[q + _AHEAD]
            _prefetch_row(weight, r)
            _prefetch_row(s1, r)
            _prefetch_row(s2, r)
        k = rows[q]
        row = base + k
        if skip_zero and row == 0:
            continue
        g = acc[k]
        _row_grad(g, weight, row, k, acc, hp, maximize)
        _step_row(opt, weight, s1, s2, row, g, ms, hp)


@njit(nogil=True, cache=True)
def bucket_walk(
    b_ids, b_src, b_w, starts, shift, lo, hi, grad, acc, seen, rows, weight, s1, s2, opt, hp, maximize, skip_zero
):  # pragma: no cover (compiled)
    """Buckets ``lo:hi`` (their ids at ``starts[b]:starts[b + 1]``, as :func:`bucket_scatter` left them,
    in batch order within a bucket) summed and stepped without a sort: each id's gradient row
    (``grad[b_src[i]]``, times ``b_w[i]``; empty: 1) added into its row's place of ``acc``
    (2**shift, D), a bucket's rows at once, in the core's cache (a row's first id writes its place,
    a bit a row in ``seen`` says which are written: no zeroing); then each row of the bucket with
    ids, ascending (``rows``: (2**shift,) room for them), takes the step of optimizer ``opt`` (the
    code of :data:`ROW_KERNELS`) with its sum, times ``scale``. A row's ids are summed in batch
    order, as ``embedding_bag`` over the sorted ids sums them: the same rows, bit for bit, without
    the sorted ids, the segments and the (U, D) gradient written out and read back.
    ``skip_zero``: row 0 (a dynamic table's default row) is never updated. ``seen`` is left zeros."""
    mask = (1 << shift) - 1
    one = np.uint64(1)
    dim = grad.shape[1]
    weighted = b_w.shape[0] > 0
    for b in range(lo, hi):
        s, e = starts[b], starts[b + 1]
        if s == e:
            continue
        low, high = mask, 0
        for i in range(s, e):
            if i + _AHEAD_IDS < e:
                _prefetch_row_read(grad, b_src[i + _AHEAD_IDS])
            k = b_ids[i] & mask
            j, bit = k >> 6, one << np.uint64(k & 63)
            src = b_src[i]
            w = b_w[i] if weighted else hp[7]
            if seen[j] & bit:
                if weighted:
                    for d in range(dim):
                        acc[k, d] += w * grad[src, d]
                else:
                    for d in range(dim):
                        acc[k, d] += grad[src, d]
            else:
                seen[j] |= bit
                if weighted:
                    for d in range(dim):
                        acc[k, d] = w * grad[src, d]
                else:
                    for d in range(dim):
                        acc[k, d] = grad[src, d]
                low = min(low, k)
                high = max(high, k)
        m = _take_marked(seen, low, high, rows, 0)
        _step_marked(rows, m, b << shift, acc, weight, s1, s2, opt, hp, maximize, skip_zero)


@njit(nogil=True, cache=True, inline="always")
def _direct_sum(ids, offsets, rows_of, low, high, nrows, grad, acc, seen):  # pragma: no cover (compiled)
    """A kept gradient's rows ``low:high`` summed straight into ``acc`` (high - low, D), in batch order:
    the ids of bags ``offsets`` (S+1,; empty: bag b holds id b), bag b's gradient row ``rows_of[b]``
    (empty: b); a row's first id writes its place, a bit a row in ``seen`` (zeros) says which are
    written. Returns False for an id not in ``0 .. nrows - 1``. (No multipliers: ``embedding_bag``
    fuses each multiply-add, and the sort's path keeps its rounding.)"""
    one = np.uint64(1)
    single, mapped = offsets.shape[0] == 0, rows_of.shape[0] > 0
    n = ids.shape[0]
    nbags = n if single else offsets.shape[0] - 1
    dim = grad.shape[1]
    for bag in range(nbags):
        src = rows_of[bag] if mapped else bag
        s, e = (bag, bag + 1) if single else (offsets[bag], offsets[bag + 1])
        for i in range(s, e):
            if i + _AHEAD_IDS < n:  # (its sum's row: one outside this thread's rows is past acc, not asked)
                _prefetch_row(acc, ids[i + _AHEAD_IDS] - low)
            r = ids[i]
            if r < low or r >= high:
                if r < 0 or r >= nrows:
                    return False
                continue
            k = r - low
            j, bit = k >> 6, one << np.uint64(k & 63)
            if seen[j] & bit:
                for d in range(dim):
                    acc[k, d] += grad[src, d]
            else:
                seen[j] |= bit
                for d in range(dim):
                    acc[k, d] = grad[src, d]
    return True


@njit(nogil=True, cache=True)
def direct_sums(
    ids, offsets, rows_of, low, high, nrows, grad, acc, seen, rows, out_ids, out_rows, at
):  # pragma: no cover (compiled)
    """Rows ``low:high`` of a kept gradient summed (:func:`_direct_sum`), then each row with ids,
    ascending: its row into ``out_ids[at]``, its sum into ``out_rows[at]``, ``at`` advanced. Returns
    the place after the last written, or -1 for an id out of range (``seen`` then not zeros). For
    tables whose sums fit a cache (every thread walks all the ids, each summing its own range of
    rows): no buckets, no sort, the gradient rows read in the order they lie."""
    if not _direct_sum(ids, offsets, rows_of, low, high, nrows, grad, acc, seen):
        return -1
    m = _take_marked(seen, 0, high - low - 1, rows, 0)
    dim = grad.shape[1]
    for q in range(m):
        k = rows[q]
        out_ids[at] = low + k
        for d in range(dim):
            out_rows[at, d] = acc[k, d]
        at += 1
    return at


@njit(nogil=True, cache=True)
def direct_walk(
    ids, offsets, rows_of, low, high, grad, acc, seen, rows, weight, s1, s2, opt, hp, maximize, skip_zero
):  # pragma: no cover (compiled)
    """:func:`bucket_walk` for a table whose sums fit a cache: rows ``low:high`` of the kept gradient
    summed (:func:`_direct_sum`), then each row with ids stepped, ascending (:func:`_step_marked`).
    Returns False for an id out of range (nothing stepped)."""
    if not _direct_sum(ids, offsets, rows_of, low, high, weight.shape[0], grad, acc, seen):
        return False
    m = _take_marked(seen, 0, high - low - 1, rows, 0)
    _step_marked(rows, m, low, acc, weight, s1, s2, opt, hp, maximize, skip_zero)
    return True


@njit(nogil=True, cache=True)
def bucket_join(rows, first, starts, distinct, lo, hi, u, out_rows, out_first):  # pragma: no cover (compiled)
    """Buckets ``lo:hi``'s distinct rows and first places, one after another from ``out_*[u]``."""
    for b in range(lo, hi):
        s = starts[b]
        for j in range(distinct[b]):
            out_rows[u] = rows[s + j]
            out_first[u] = first[s + j]
            u += 1


@njit(nogil=True, cache=True)
def mark_rows(ids, rows, lo, hi, bits):  # pragma: no cover (compiled)
    """A bit a row (``bits`` (⌈rows / 64⌉,) uint64) set for each id of ``ids[lo:hi]``; returns an id
    not in ``0 .. rows - 1`` (marking stops there), or -1."""
    one = np.uint64(1)
    for i in range(lo, hi):
        r = ids[i]
        if r < 0 or r >= rows:
            return i
        bits[r >> 6] |= one << np.uint64(r & 63)
    return -1


@njit(nogil=True, cache=True, inline="always")
def _popcount(w):  # pragma: no cover (compiled)
    """The set bits of the uint64 ``w``."""
    w = w - ((w >> np.uint64(1)) & np.uint64(0x5555555555555555))
    w = (w & np.uint64(0x3333333333333333)) + ((w >> np.uint64(2)) & np.uint64(0x3333333333333333))
    w = (w + (w >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return np.int64((w * np.uint64(0x0101010101010101)) >> np.uint64(56))


@njit(nogil=True, cache=True)
def count_marked(bits, lo, hi):  # pragma: no cover (compiled)
    """The rows marked in any of ``bits`` (T, W) (each thread's marks), words ``lo:hi``."""
    c = 0
    for j in range(lo, hi):
        w = bits[0, j]
        for t in range(1, bits.shape[0]):
            w |= bits[t, j]
        c += _popcount(w)
    return c


@njit(nogil=True, cache=True)
def distinct_rows(ids, nrows, bits, base, uniq, inverse, first):  # pragma: no cover (compiled)
    """``torch.unique(ids, return_inverse=True)`` of row numbers ``0 .. nrows - 1`` without a sort: a
    bit a row marked (``bits``: (nrows + 63) // 64 zeros), the marked rows ascending into ``uniq``
    (``base[w]``: the distinct rows before word w), each id's place among them into ``inverse`` by
    the bits below its own, each distinct row's first id into ``first``. Returns their number, or
    -1 - i for the first id i out of range (nothing usable then)."""
    one = np.uint64(1)
    n = ids.shape[0]
    for i in range(n):
        r = ids[i]
        if r < 0 or r >= nrows:
            return -1 - i
        bits[r >> 6] |= one << np.uint64(r & 63)
    c = 0
    for w in range(bits.shape[0]):
        base[w] = c
        x = bits[w]
        while x != 0:
            uniq[c] = (w << 6) + _trailing_zeros(x)
            x &= x - one
            c += 1
    for i in range(n):
        r = ids[i]
        w = r >> 6
        inverse[i] = base[w] + _popcount(bits[w] & ((one << np.uint64(r & 63)) - one))
    for i in range(n - 1, -1, -1):
        first[inverse[i]] = i
    return c


@njit(nogil=True, cache=True)
def merge_rows(a_ids, a_rows, b_ids, b_rows, out_ids, out_rows, divisor):  # pragma: no cover (compiled)
    """Two sets of distinct row ids, each ascending, and their rows -> their union ascending in
    ``out_ids``, each row ``(a + b) / divisor`` (or the one side's, divided) in ``out_rows``;
    returns the union's size, or -1 when a side is not strictly ascending (nothing usable then)."""
    na, nb, dim = a_ids.shape[0], b_ids.shape[0], out_rows.shape[1]
    i = j = u = 0
    while i < na or j < nb:
        if i < na and (j >= nb or a_ids[i] <= b_ids[j]):
            if i > 0 and a_ids[i] <= a_ids[i - 1]:
                return -1
            r = a_ids[i]
            if j < nb and b_ids[j] == r:
                if j > 0 and b_ids[j] <= b_ids[j - 1]:
                    return -1
                for d in range(dim):
                    out_rows[u, d] = (a_rows[i, d] + b_rows[j, d]) / divisor
                j += 1
            else:
                for d in range(dim):
                    out_rows[u, d] = a_rows[i, d] / divisor
            i += 1
        else:
            if j > 0 and b_ids[j] <= b_ids[j - 1]:
                return -1
            r = b_ids[j]
            for d in range(dim):
                out_rows[u, d] = b_rows[j, d] / divisor
            j += 1
        out_ids[u] = r
        u += 1
    return u


@njit(nogil=True, cache=True)
def merged_step(
    a_ids, a_rows, b_ids, b_rows, divisor, i, i_end, j, j_end, out_ids, at, weight, s1, s2, opt, hp, maximize
):  # pragma: no cover (compiled)
    """:func:`merge_rows` and the step in one pass: the union of ``a_ids[i:i_end]`` and ``b_ids[j:j_end]``
    (each strictly ascending, checked by the caller), each row stepped by optimizer ``opt`` with the
    gradient ``(a + b) / divisor`` (one side's alone where the other lacks the row; then times
    ``scale``, as :func:`merge_rows` then a row kernel compute it), the next rows of both sides
    prefetched; the union's ids written from ``out_ids[at]`` on. Returns their count."""
    acc = np.empty((1, weight.shape[1]), dtype=a_rows.dtype)
    g = acc[0]
    dim = weight.shape[1]
    ms = hp[8] - hp[7]
    u = at
    while i < i_end or j < j_end:
        if i + _AHEAD < i_end:
            r = a_ids[i + _AHEAD]
            _prefetch_row(weight, r)
            _prefetch_row(s1, r)
            _prefetch_row(s2, r)
        if j + _AHEAD < j_end:
            r = b_ids[j + _AHEAD]
            _prefetch_row(weight, r)
            _prefetch_row(s1, r)
            _prefetch_row(s2, r)
        if i < i_end and (j >= j_end or a_ids[i] <= b_ids[j]):
            row = a_ids[i]
            if j < j_end and b_ids[j] == row:
                for d in range(dim):
                    g[d] = (a_rows[i, d] + b_rows[j, d]) / divisor
                j += 1
            else:
                for d in range(dim):
                    g[d] = a_rows[i, d] / divisor
            i += 1
        else:
            row = b_ids[j]
            for d in range(dim):
                g[d] = b_rows[j, d] / divisor
            j += 1
        out_ids[u] = row
        u += 1
        _row_grad(g, weight, row, 0, acc, hp, maximize)
        _step_row(opt, weight, s1, s2, row, g, ms, hp)
    return u - at


@njit(nogil=True, cache=True)
def ascending_within(ids, nrows):  # pragma: no cover (compiled)
    """Whether ``ids`` are strictly ascending row numbers of ``[0, nrows)``."""
    n = ids.shape[0]
    if n == 0:
        return True
    if ids[0] < 0 or ids[n - 1] >= nrows:
        return False
    for k in range(1, n):
        if ids[k] <= ids[k - 1]:
            return False
    return True
