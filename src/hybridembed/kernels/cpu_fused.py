"""The fused CPU step: each distinct row's optimizer update in one pass over the row and its
state (Numba kernels, :mod:`._numba_kernels`), for tables on the CPU with ``kernels="auto"``
(when Numba is installed) or ``kernels="numba"``.

Shape legend: ``N`` ids of a group's batch, ``S`` bags, ``U`` distinct rows, ``D`` dim.

**Forward**: PyTorch's ``embedding_bag`` (one call per group, as the eager path). **Backward**:
nothing is computed; the output gradient (S, D) and the ids are kept beside the storage
(:meth:`RowStorage.defer_grad`, as the Triton path does on CUDA). **Step**
(:func:`apply_fused`): where the batch has many ids for the table's rows, the ids go into
buckets of rows (a counting sort's first level) and each bucket's rows are summed in the core's
cache and stepped at once (:func:`_walked`, ``bucket_walk``: no sort, no (U, D) gradient).
Otherwise the ids are grouped by row, stably (torch's int32 stable sort) and each
distinct row's gradient is summed by one ``embedding_bag`` over the grouped ids (FBGEMM's SpMDM
kernel inside PyTorch, on its threads): (U, D). Then :func:`apply_rows`: one Numba kernel per optimizer reads each row
and its state, applies the update and writes them back, prefetching the rows a few ahead (the
rows are scattered over the table: the pass is bound by memory latency); one slice of rows per
thread, each a GIL-free call. No sparse gradient and no other (U, D) temporary: the eager path
gathers the state, computes the update in several whole-tensor passes and scatters both back.
Already-reduced rows (a sharded job's exchanged gradients, a parameter server's pushes) go to
:func:`apply_rows` directly. SGD without weight decay is linear in the gradient: each id's
gradient is added to its row where it lies, in batch order, without the grouping and the
reduction (:func:`_sgd_in_place`), except on multi-hot batches that repeat rows enough for
the grouped step to win (:func:`repeats`).

Measured side by side (docs/benchmarks.md, "The fused CPU step", "The step walked bucket by
bucket"): a kernel that summed each row's gradient itself walking the sorted ids lost to this
split; walking buckets whose sums stay in the core's cache, it wins (2.1M ids: 54 against 62-64
ms a step).

Which optimizers: :data:`hybridembed.kernels.fused.FUSED` (SGD without momentum, Adagrad,
row-wise Adagrad, Adam, each with ``weight_decay`` and ``maximize``), on float32 and float64
tables; everything else (momentum, other optimizers, half-precision tables, clipping, per-id
weights that need their own gradient) turns the kept gradient into the eager sparse gradient
first, so the result is the eager path's. Without Numba the eager ops run, and the first table
that would have used the kernels logs one line saying so.
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F

from ..utils import get_logger, release_openmp_workers
from .fused import FUSED, step_hparams
from .lookup import sorted_segments

__all__ = [
    "available",
    "runs_on",
    "pooled_lookup",
    "pooled_parts",
    "apply_fused",
    "apply_rows",
    "merge_rows",
    "parts_ready",
    "apply_parts",
    "distinct_rows",
]

_log = get_logger("hybridembed.kernels")
_DTYPES = (torch.float32, torch.float64)
_MIN_PER_THREAD = 4096  # ids (or rows) below which a slice is not worth a thread
# ids grouped by row with a counting sort (group_by_row) where a batch has at least one id for this many of
# the table's rows (a bucket with ids walks its words of a bit a row: 512 at most), and this many ids;
# one-hot batches of 26 x 200k rows (24 rows an id) included: docs/benchmarks.md, "One-hot batches counted"
_COUNTED_ROWS = 32
_COUNTED_MIN = 1 << 16
# rows a bucket of the counting sort: 2**15 int32 counts, 128 KiB, in a core's cache (16: 5% slower, multi-hot)
_BUCKET_SHIFT = 15
_PIECES = 4  # pieces of a thread's ids counted abreast, each with its own counts (see _numba_kernels.bucket_counts)
# a thread's sums of a bucket's rows in the step walked bucket by bucket (_walked): a core's cache
_WALK_BYTES = 1 << 20
# a table whose rows' sums (rows x D) fit this many bytes (a share of a server's last-level cache) has a
# kept gradient summed straight into them (reduce_kept: _direct), with no buckets or sort
_DIRECT_BYTES = 8 << 20
_DIRECT_DTYPES = (torch.float32, torch.float64)
# ... and the step takes them so (_direct_walk) where the batch has at least this many ids a row of the table
# (fewer: the bucket walk's sums, in a core's cache, measured as fast or faster; docs/benchmarks.md, "Sums
# straight into a small table's rows")
_DIRECT_WALK_IDS = 8
# SGD without weight decay on multi-hot bags takes the grouped step (each distinct row's gradients summed, then
# the row updated once) where a batch holds this many ids a distinct row or more, else each id in place; the
# distinct rows are counted (a bit a row) only where the batch has an id for at most _MARKED_ROWS rows
_GROUPED_SGD_REPEATS = 2.0
_MARKED_ROWS = 64
# distinct_rows marks a bit a row where the rows are at most this many an id (its bits at most the ids' own bytes)
_DISTINCT_ROWS = 64


@functools.cache
def available() -> bool:
    """Numba imports (its kernels then compile on first use); logs once why not otherwise."""
    try:
        from . import _numba_kernels  # noqa: F401
    except Exception as e:  # (ImportError, or a Numba that does not match this NumPy)
        _log.info(
            "the fused CPU step needs Numba (%s: %s); the CPU tables run the eager ops "
            "(pip install numba for the fused step)",
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
        )
        return False
    return True


def runs_on(kernels: str, weight: torch.Tensor) -> bool:
    """Whether a storage whose backend is ``kernels`` takes the fused CPU step for ``weight``."""
    return kernels in ("auto", "numba") and weight.device.type == "cpu" and weight.dtype in _DTYPES and available()


def _bags(ids, weight, offsets, psw) -> torch.Tensor:
    """``embedding_bag`` of the detached rows: PyTorch's forward-only kernel, without the bag index,
    the bag sizes and the rest its own backward would need (0.15-0.3 ms of a one-hot forward of 26 x
    8,192 ids here)."""
    return F.embedding_bag(ids, weight.detach(), offsets, mode="sum", per_sample_weights=psw, include_last_offset=True)


class _Kept(torch.autograd.Function):
    """``embedding_bag``; the backward keeps its gradient beside the storage for the fused step."""

    @staticmethod
    def forward(ctx, weight, ids, offsets, psw, storage, one_per_bag):
        ctx.storage, ctx.one_per_bag = storage, one_per_bag
        ctx.save_for_backward(ids, offsets, psw)
        return _bags(ids, weight, offsets, psw)

    @staticmethod
    def backward(ctx, grad):  # (S, D)
        ids, offsets, psw = ctx.saved_tensors
        ctx.storage.defer_grad(ids, grad.contiguous(), offsets, psw, ctx.one_per_bag)
        return None, None, None, None, None, None


class _KeptParts(torch.autograd.Function):
    """``embedding_bag`` split into the features' outputs (``sizes`` bags each); the backward keeps
    the features' gradients beside the storage where they lie (see :func:`pooled_parts`)."""

    @staticmethod
    def forward(ctx, weight, ids, offsets, psw, storage, one_per_bag, sizes):
        ctx.storage, ctx.one_per_bag = storage, one_per_bag
        ctx.save_for_backward(ids, offsets, psw)
        out = _bags(ids, weight, offsets, psw)
        # (not views for autograd, as unsafe_split's: a caller may change an output in place)
        return tuple(torch.unsafe_split_with_sizes(out, sizes))

    @staticmethod
    def backward(ctx, *grads):  # each (B_f, D)
        ids, offsets, psw = ctx.saved_tensors
        source, rows_of = _in_place(grads)
        if source is None:  # (apart: joined, as autograd's split would have)
            source = torch.cat([g.contiguous() for g in grads])
        ctx.storage.defer_grad(ids, source, offsets, psw, ctx.one_per_bag, rows_of)
        return None, None, None, None, None, None, None


def _in_place(grads) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Features' gradients that are views of one buffer whose rows of D elements hold them (a
    model that concatenates the outputs, ``torch.cat(outs, 1)``, DLRM's ``cat([x] + ly, 1)``) ->
    (that buffer as (rows, D), each bag's row in it (S,)); else (None, None)."""
    g0 = grads[0]
    d = g0.shape[1]
    base = g0.untyped_storage()
    if d == 0 or any(
        g.dim() != 2
        or g.stride(1) != 1
        or g.stride(0) % d
        or g.storage_offset() % d
        or g.untyped_storage().data_ptr() != base.data_ptr()
        or g.dtype != g0.dtype
        for g in grads
    ):
        return None, None
    rows = base.nbytes() // (g0.element_size() * d)
    source = g0.as_strided((rows, d), (d, 1), 0)
    dev = g0.device
    steps = [g.stride(0) // d for g in grads]  # (each feature's bag b at row starts[f] + b * steps[f])
    starts = [g.storage_offset() // d for g in grads]
    if all(g.shape[0] == g0.shape[0] for g in grads):  # (features of one batch size: one (F, B) grid, 3 ops)
        grid = torch.arange(g0.shape[0], device=dev) * torch.tensor(steps, device=dev)[:, None]
        return source, grid.add_(torch.tensor(starts, device=dev)[:, None]).view(-1)
    rows_of = torch.cat([torch.arange(g.shape[0], device=dev) * k + o for g, k, o in zip(grads, steps, starts)])
    return source, rows_of


def pooled_parts(storage, ids, offsets, psw, one_per_bag: bool, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """:func:`pooled_lookup` split into features of ``sizes`` bags: (B_f, D) each. Their gradients
    reach the step where the model left them: when they are views of one buffer (the model
    concatenated the outputs), that buffer is kept as it is with each bag's row in it, and the
    step's reduction reads the rows there; the (S, D) copy that autograd's backward of a split
    makes (26 features x 8,192 bags x 64: 54 MB a step, ~4 ms here) is not made. So a gradient
    tensor given to ``backward`` by hand (``torch.autograd.backward(outs, grads)``) is read at
    ``opt.step()``: change it only after the step (as with the Triton path on CUDA)."""
    if not (torch.is_grad_enabled() and storage.weight.requires_grad):
        return tuple(torch.unsafe_split_with_sizes(pooled_lookup(storage, ids, offsets, psw, one_per_bag), sizes))
    return _KeptParts.apply(storage.weight, ids, offsets, psw, storage, one_per_bag, list(sizes))


def pooled_lookup(storage, ids, offsets, psw, one_per_bag: bool) -> torch.Tensor:
    """``storage.weight``'s rows ``ids`` (N,) pooled into bags ``offsets`` (S+1,) -> (S, D), its
    gradient kept by ``storage`` for :func:`apply_fused`. The storage's dtype is its compute dtype."""
    weight = storage.weight
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return F.embedding_bag(
            ids, weight.detach(), offsets, mode="sum", per_sample_weights=psw, include_last_offset=True
        )
    return _Kept.apply(weight, ids, offsets, psw, storage, one_per_bag)


# --- the step ----------------------------------------------------------------------------------
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:  # (a forked child has none of its parent's threads: it makes its own pool)
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _threads(work: int) -> int:
    return max(1, min(torch.get_num_threads(), work // _MIN_PER_THREAD))


def _run(fn, slices: list[tuple[int, int]], *args) -> None:
    """``fn(*head, lo, hi, *tail)`` for each slice, one per thread (this one runs the first)."""
    _each([(fn, *args[0], lo, hi, *args[1]) for lo, hi in slices])


def _each(calls: list[tuple]) -> list:
    """``fn(*args)`` for each ``(fn, *args)``, one per thread (this one runs the first): their results."""
    global _pool
    if len(calls) == 1:
        return [calls[0][0](*calls[0][1:])]
    with _pool_lock:  # (one pool for the process; calls beyond its workers wait their turn)
        if _pool is None:
            workers = max(1, (os.cpu_count() or 2) - 1)
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hybridembed-step")
        pool = _pool
    release_openmp_workers()  # (torch's idle workers would spin on the cores these threads need)
    futures = [pool.submit(*c) for c in calls[1:]]
    first = calls[0][0](*calls[0][1:])
    return [first] + [f.result() for f in futures]


def _state(storage, hp: dict) -> tuple[np.ndarray, np.ndarray]:
    """The optimizer's state as two 2-D arrays (see :mod:`._numba_kernels`)."""
    names = list(storage.optimizer.state_spec(hp))
    arrays = [storage.state[n].numpy() for n in names]
    arrays = [a.reshape(-1, 1) if a.ndim == 1 else a for a in arrays]
    dummy = np.zeros((1, 1), dtype=storage.weight.detach().numpy().dtype)
    return (arrays[0] if arrays else dummy), (arrays[1] if len(arrays) > 1 else dummy)


def _hparams(storage, hp: dict, scale: float = 1.0) -> tuple[np.ndarray, int, bool]:
    h = step_hparams(storage.optimizer, hp, storage.step)
    dt = storage.weight.detach().numpy().dtype
    row = [h.lr, h.eps, 1.0 - h.b1, h.b2, 1.0 - h.b2, h.weight_decay, float(storage.dim), 1.0, 0.0, scale]
    return np.array(row, dtype=dt), h.opt, h.maximize


def apply_fused(
    storage,
    ids: torch.Tensor,
    grad: torch.Tensor,
    bag_of: torch.Tensor | BagRows | None,
    psw,
    hp: dict,
    scale: float = 1.0,
) -> None:
    """One optimizer step of ``storage`` from a kept lookup gradient: ids (N,) (row slots), the
    bags' gradient ``grad`` (S, D), each id's bag ``bag_of`` (N,) or a :class:`BagRows` (None: id i is bag i) and
    multiplier ``psw`` (N,) or None, times ``scale`` (applied by the kernel to each distinct row's
    summed gradient, as the eager path scales its reduced rows). ``storage.step`` must already
    count this step.

    SGD without weight decay applies each id's gradient in place (:func:`_sgd_in_place`) unless
    the batch's bags repeat rows enough (:func:`repeats`); the other optimizers, and SGD then,
    sum each distinct row's gradient and step the row: straight into a small table's rows where the
    batch has many ids a row (:func:`_direct_walk`), bucket by bucket where it has many ids for the
    table's rows (:func:`_walked`), else by :func:`reduce_kept` and :func:`apply_rows`."""
    if ids.numel() == 0:
        return
    hpa, opt, maximize = _hparams(storage, hp, scale)
    # (SGD without weight decay is linear in the gradient: in place at any number of ids a bag,
    # docs/benchmarks.md "SGD in place at any number of ids a bag"; grouped where bags repeat rows
    # enough, "SGD: in place or grouped")
    if opt == FUSED["SGD"] and hpa[5] == 0:
        if not isinstance(bag_of, BagRows) or repeats(ids, storage.weight.shape[0]) < _GROUPED_SGD_REPEATS:
            _sgd_in_place(storage, ids, grad, _made(bag_of), psw, hpa, maximize)
            return
    if _direct_walk(storage, ids, grad, bag_of, psw, hp, hpa, opt, maximize) or _walked(
        storage, ids, grad, bag_of, psw, hp, hpa, opt, maximize
    ):
        return
    uniq, rows = reduce_kept(ids, grad, bag_of, psw, storage.weight.shape[0])
    if storage.keyed:  # slot 0, a dynamic table's default row, is never updated (it sorts first)
        if uniq.numel() and int(uniq[0]) == 0:
            uniq, rows = uniq[1:], rows[1:]
    apply_rows(storage, uniq, rows, hp, None, scale)


def repeats(ids: torch.Tensor, nrows: int) -> float:
    """A batch's ids (N,) of rows ``0 .. nrows - 1`` per distinct row, N / U: the same number whatever
    the threads (each marks a bit a row for its slice of the ids, then the marks are OR'd and counted),
    so the path it picks depends on the batch alone, not on the machine or on earlier steps. 0.0 where
    not counted: fewer than ``_COUNTED_MIN`` ids, fewer than one id for ``_MARKED_ROWS`` rows, no
    Numba, or an id out of range.

    What it decides (SGD without weight decay, multi-hot bags; ``docs/benchmarks.md``, "SGD: in place
    or grouped"): applied in place, each id costs a read and a write of its row; grouped, the ids'
    gradients are summed first (one pass over the gradient rows) and each distinct row is written
    once. 26 x 64 tables, batch 8,192, whole steps, 2 threads, ms in place against grouped (walked
    bucket by bucket): 200k rows, power-law ids at 10 a bag (3.8 ids a row) 59.9 against 52.2, 2 a
    bag (2.6) 20.9 against 19.6, uniform ids at 10 a bag (1.2) 100.0 against 109.7; 50k rows,
    uniform at 10 a bag (2.0) 81.7 against 66.3, 5 a bag (1.5) 47.9 against 47.1; 100k rows,
    uniform at 10 a bag (1.5) 82.1 against 93.6. Counting costs 1.2 ns an id."""
    n = ids.numel()
    if n < _COUNTED_MIN or n * _MARKED_ROWS < nrows or ids.device.type != "cpu" or not available():
        return 0.0
    from . import _numba_kernels as K

    keys = _int64s(ids)
    t = _threads(n)
    bits = np.zeros((t, ((nrows + 63) >> 6)), np.uint64)
    cuts = [n * j // t for j in range(t + 1)]
    if any(r >= 0 for r in _each([(K.mark_rows, keys, nrows, cuts[j], cuts[j + 1], bits[j]) for j in range(t)])):
        return 0.0
    return n / max(1, K.count_marked(bits, 0, bits.shape[1]))


def _sgd_in_place(storage, ids, grad, bag_of, psw, hpa, maximize: bool) -> None:
    """SGD without weight decay (``bag_of``: each id's row of ``grad``; None: id i's is row i): each
    id's gradient applied to its row where it lies, in batch order (:func:`._numba_kernels.ids_sgd`;
    the rows split over the threads by residue)."""
    from . import _numba_kernels as K

    weight = storage.weight.detach()
    g = grad.to(weight.dtype)
    g = g if g.stride(-1) == 1 else g.contiguous()
    head = (
        weight.numpy(),
        ids.to(torch.int64).contiguous().numpy(),
        np.zeros(0, np.int64) if bag_of is None else bag_of.to(torch.int64).contiguous().numpy(),
        np.zeros(0, dtype=hpa.dtype) if psw is None else psw.to(weight.dtype).contiguous().numpy(),
        g.numpy(),
        hpa,
        maximize,
        bool(storage.keyed),
    )
    t = _threads(ids.numel())
    _run(K.ids_sgd, [(k, t) for k in range(t)], head, ())


def bag_rows(offsets: torch.Tensor, n: int, rows_of: torch.Tensor | None) -> torch.Tensor:
    """Each of the ``n`` ids of bags ``offsets`` (S+1,) -> its bag's row of the gradient: ``rows_of[b]``
    (None: b), (N,) int64; :func:`~hybridembed.input.jagged.bag_index` and a gather in one pass
    (measured 4.9 ms for those two, 2.1M ids of 213k bags)."""
    from . import _numba_kernels as K

    out = torch.empty(n, dtype=torch.int64)
    s = offsets.numel() - 1
    if s <= 0 or n == 0:
        return out
    offs, rows = _int64s(offsets), _int64s(rows_of)
    t = _threads(n)
    edges = [s * k // t for k in range(t + 1)]
    _run(K.bag_rows, [(a, b) for a, b in zip(edges, edges[1:]) if b > a], (offs, rows), (out.numpy(),))
    return out


def _int64s(t: torch.Tensor | None) -> np.ndarray:
    """A CPU tensor as a contiguous int64 array (None: an empty one, which the kernels read as absent)."""
    return np.zeros(0, np.int64) if t is None else t.to(torch.int64).contiguous().numpy()


class BagRows:
    """Each id's row of a kept gradient, not made yet: the ``n`` ids' bags ``offsets`` (S+1,) and each
    bag's row ``rows_of`` (S,) (None: bag b is row b). :func:`group_by_row` reads the bags as they are
    (no (N,) array made, then read: 1.2 ms of a step of 2.1M ids); :meth:`tensor` makes it (:func:`bag_rows`)
    for the paths that need it."""

    def __init__(self, offsets: torch.Tensor, n: int, rows_of: torch.Tensor | None):
        self.offsets, self.n, self.rows_of = offsets, n, rows_of
        self._made: torch.Tensor | None = None

    def tensor(self) -> torch.Tensor:
        if self._made is None:
            self._made = bag_rows(self.offsets, self.n, self.rows_of)
        return self._made


def _made(bag_of):
    """``bag_of`` as a tensor (or None): a :class:`BagRows` made."""
    return bag_of.tensor() if isinstance(bag_of, BagRows) else bag_of


def reduce_kept(ids: torch.Tensor, grad: torch.Tensor, bag_of: torch.Tensor | BagRows | None, psw, nrows: int) -> tuple:
    """A kept lookup gradient (as :func:`apply_fused` takes it) summed per distinct row: (the rows
    ascending (U,), their gradients (U, D)), by one ``embedding_bag`` over the ids grouped by row
    (:func:`group_by_row` where the batch has many ids for the table's rows, else a sort)."""
    summed = _direct(ids, grad, bag_of, psw, nrows)
    if summed is not None:
        return summed
    grouped = group_by_row(ids, nrows, bag_of, psw, grad.dtype) if grad.shape[0] < 2**31 else None
    if grouped is None:
        uniq, perm, seg = sorted_segments(ids, nrows)  # (U,), (N,), (U+1,)
        w = None if psw is None else psw.index_select(0, perm).to(grad.dtype)
        at = perm if bag_of is None else _made(bag_of).index_select(0, perm)
    else:
        uniq, at, seg, w = grouped
    return uniq, F.embedding_bag(at, grad, seg, mode="sum", per_sample_weights=w, include_last_offset=True)


def _direct(ids: torch.Tensor, grad: torch.Tensor, bag_of, psw, nrows: int) -> tuple | None:
    """:func:`reduce_kept` by :func:`._numba_kernels.direct_sums` where the table's sums fit
    :data:`_DIRECT_BYTES` (else None): each id's gradient row added straight into its row's sum, the
    rows with ids then written out ascending, each thread its own range of rows (written from the
    most it can hold; the later threads' then moved down). 26 x 1,000 rows x 64, 106k one-hot ids, one
    thread: 2.8 against 4.4 ms (the counting sort, then ``embedding_bag``); the same sums, bit for
    bit. Not where ids carry multipliers (``embedding_bag`` fuses each multiply-add: its rounding kept)."""
    n, dim = ids.numel(), grad.shape[1]
    if psw is not None or grad.dtype not in _DIRECT_DTYPES or not _fits_direct(ids, nrows, dim, grad):
        return None
    from . import _numba_kernels as K

    g = (grad if grad.stride(-1) == 1 else grad.contiguous()).numpy()
    edges = _row_ranges(nrows, _threads(n))
    at = np.cumsum([0] + [min(n, hi - lo) for lo, hi in edges]).tolist()
    uniq, rows = torch.empty(at[-1], dtype=torch.int64), torch.empty(at[-1], dim, dtype=grad.dtype)
    out = (uniq.numpy(), rows.numpy())
    head = (K.direct_sums, _int64s(ids), *_bag_arrays(bag_of))
    ends = _each(
        [
            (*head, lo, hi, nrows, g, *_direct_buffers(hi - lo, dim, g.dtype), *out, at[j])
            for j, (lo, hi) in enumerate(edges)
        ]
    )
    if min(ends) < 0:  # (an id out of range: the sort's path reports it)
        return None
    u = ends[0]
    for j in range(1, len(edges)):  # (numpy moves overlapping rows as a copy would)
        k = ends[j] - at[j]
        out[0][u : u + k], out[1][u : u + k] = out[0][at[j] : ends[j]], out[1][at[j] : ends[j]]
        u += k
    return uniq[:u], rows[:u]


def _direct_walk(storage, ids, grad, bag_of, psw, hp: dict, hpa: np.ndarray, opt: int, maximize: bool) -> bool:
    """The step of :func:`apply_fused` by :func:`._numba_kernels.direct_walk` where the table's sums
    fit :data:`_DIRECT_BYTES` and the batch has :data:`_DIRECT_WALK_IDS` ids a row (else False,
    nothing done): each id's gradient row added straight into its row's sum, then each row with ids
    stepped, each thread its own range of rows. The same rows as the sort's path, bit for bit (not
    where ids carry multipliers: see :func:`_direct`). 26 x 1,000 x 64, batch 4,096, 10 ids a bag, row-wise
    Adagrad, the optimizer's step alternated in one process: 10.3 against 15.8 ms (one thread), 8.0
    against 10.7 (two)."""
    from . import _numba_kernels as K

    weight = storage.weight.detach()
    nrows, dim = weight.shape
    if psw is not None or ids.numel() < _DIRECT_WALK_IDS * nrows or not _fits_direct(ids, nrows, dim, weight):
        return False
    g = grad.to(weight.dtype)
    g = (g if g.stride(-1) == 1 else g.contiguous()).numpy()
    # (every thread reads every id: an id out of range stops each before it steps a row)
    head = (K.direct_walk, _int64s(ids), *_bag_arrays(bag_of))
    tail = (weight.numpy(), *_state(storage, hp), opt, hpa, maximize, bool(storage.keyed))
    edges = _row_ranges(nrows, _threads(ids.numel()))
    return all(_each([(*head, lo, hi, g, *_direct_buffers(hi - lo, dim, g.dtype), *tail) for lo, hi in edges]))


def _fits_direct(ids: torch.Tensor, nrows: int, dim: int, rows: torch.Tensor) -> bool:
    """Whether ``nrows`` x ``dim`` sums in ``rows``' dtype fit :data:`_DIRECT_BYTES` (batches of 2**31 ids or
    rows or more left to the sort's path, as the counting sort leaves them)."""
    return (
        0 < nrows * dim * rows.element_size() <= _DIRECT_BYTES
        and max(ids.numel(), nrows, rows.shape[0]) < 2**31
        and ids.device.type == "cpu"
        and available()
    )


def _row_ranges(nrows: int, t: int) -> list[tuple[int, int]]:
    """Rows ``0 .. nrows - 1`` in ``t`` ranges, one a thread (empty ones left out)."""
    edges = [nrows * j // t for j in range(t + 1)]
    return [(lo, hi) for lo, hi in zip(edges, edges[1:]) if hi > lo]


def _direct_buffers(rows: int, dim: int, dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A direct thread's room: its rows' sums (rows, D), a bit a row (zeros), its rows with ids."""
    return np.empty((rows, dim), dtype), np.zeros((rows + 63) >> 6, np.uint64), np.empty(rows, np.int64)


def _bag_arrays(bag_of) -> tuple[np.ndarray, np.ndarray]:
    """(the bags' offsets, each bag's gradient row) as the kernels read them (empty: a bag an id; bag b's row b)."""
    if isinstance(bag_of, BagRows):
        return _int64s(bag_of.offsets), _int64s(bag_of.rows_of)
    return np.zeros(0, np.int64), _int64s(bag_of)  # (a bag an id: each id's row given, or its own place)


def group_by_row(
    ids: torch.Tensor, nrows: int, bag_of: torch.Tensor | BagRows | None, psw, dtype: torch.dtype
) -> tuple | None:
    """Ids (N,) of rows ``0 .. nrows - 1`` grouped by row, stably (a row's ids in batch order), as
    :func:`sorted_segments` and the gathers after it give them: (the distinct rows ascending (U,)
    int64, each sorted id's gradient row ``bag_of[i]`` (or i; a :class:`BagRows`: its bag's row) (N,) int32, the rows' segments (U+1,)
    int32, each sorted id's multiplier in ``dtype`` (N,) or None). None where the sort is used
    instead: fewer than one id for :data:`_COUNTED_ROWS` rows (each bucket with ids walks its
    bits), no Numba, or an id out of range (the sort's path reports it).

    A counting sort in two levels (:mod:`._numba_kernels`, ``bucket_*``), on the step's threads:
    the ids into buckets of ``2**_BUCKET_SHIFT`` rows, then each bucket by row with counts that
    stay in the core's cache, its rows with ids found from a bit a row. Measured with the reduction
    after it (26 x 200k x 64, batch 8,192, 10 ids a bag, 2.1M ids, 2 threads;
    ``benchmarks/bench_group.py``): 25.7-26.5 ms against 38-40 ms for the int32 radix sort, the
    distinct rows, the gathers and the reduction (docs/benchmarks.md, "Ids grouped by counting",
    "The lean step, a session later"). Places are int32: batches of 2**31 ids or more take the sort."""
    got = _bucketed(ids, nrows, bag_of, psw, dtype, _BUCKET_SHIFT)
    if got is None:
        return None
    from . import _numba_kernels as K

    b_ids, b_src, b_w, starts, t = got
    n, nb, shift = ids.numel(), starts.shape[0] - 1, _BUCKET_SHIFT
    src = torch.empty(n, dtype=torch.int32)
    w = torch.empty(n, dtype=dtype) if psw is not None else None
    rows, first, distinct = np.empty(n, np.int64), np.empty(n, np.int32), np.zeros(nb, np.int64)
    tail = (src.numpy(), b_w if w is None else w.numpy(), rows, first, distinct)
    parts = _bucket_parts(starts, n, t)
    zeros = [(np.zeros(1 << shift, np.int32), np.zeros(((1 << shift) + 63) >> 6, np.uint64)) for _ in parts]
    _each([(K.bucket_rows, b_ids, b_src, b_w, starts, shift, lo, hi, *z, *tail) for (lo, hi), z in zip(parts, zeros)])
    u = int(distinct.sum())
    uniq, seg = torch.empty(u, dtype=torch.int64), torch.empty(u + 1, dtype=torch.int32)
    out = (uniq.numpy(), seg.numpy())
    _each([(K.bucket_join, rows, first, starts, distinct, lo, hi, int(distinct[:lo].sum()), *out) for lo, hi in parts])
    seg[u] = n
    return uniq, src, seg, w


def _bucketed(ids: torch.Tensor, nrows: int, bag_of, psw, dtype: torch.dtype, shift: int) -> tuple | None:
    """The counting sort's first level (:func:`group_by_row`): each id, its gradient row and its
    multiplier into its bucket of ``2**shift`` rows, in batch order within a bucket: (ids (N,) int32,
    gradient rows (N,) int32, multipliers (N,) or empty, the buckets' first places (nb + 1,), the
    threads that did it), or None where counting does not apply (see :func:`group_by_row`)."""
    n = ids.numel()
    if (
        n < _COUNTED_MIN
        or n * _COUNTED_ROWS < nrows
        or max(n, nrows) >= 2**31
        or ids.device.type != "cpu"
        or not available()
    ):
        return None
    from . import _numba_kernels as K

    nb = ((nrows - 1) >> shift) + 1
    keys = _int64s(ids)
    wts = torch.zeros(0, dtype=dtype) if psw is None else psw.to(dtype).contiguous()
    t, k = _threads(n), _PIECES
    cuts = np.array([n * j // (t * k) for j in range(t * k + 1)], np.int64)  # (each thread's slice in k pieces)
    offs, rows_of = _bag_arrays(bag_of)
    if isinstance(bag_of, BagRows):  # (the slices cut between bags: each thread scatters whole bags)
        bag_cuts = np.searchsorted(offs, cuts, side="left")  # (the last: the first of the empty bags at the end)
        cuts = offs[bag_cuts]
    else:
        bag_cuts = cuts
    pieces = [(cuts[j * k : (j + 1) * k], cuts[j * k + 1 : (j + 1) * k + 1]) for j in range(t)]
    counts = np.zeros((t * k, nb), np.int64)
    if any(
        r >= 0
        for r in _each(
            [
                (K.bucket_counts, keys, nrows, shift, lo, hi, counts[j * k : (j + 1) * k])
                for j, (lo, hi) in enumerate(pieces)
            ]
        )
    ):
        return None
    counts = counts.reshape(t, k, nb).sum(1)  # (t, nb): each thread's
    starts = np.zeros(nb + 1, np.int64)
    np.cumsum(counts.sum(0), out=starts[1:])
    at = np.ascontiguousarray(starts[:-1] + np.cumsum(counts, 0) - counts)  # (t, nb): each slice's first places
    b_ids, b_src = np.empty(n, np.int32), np.empty(n, np.int32)
    b_w = np.empty(n if psw is not None else 0, wts.numpy().dtype)
    head = (K.bucket_scatter, keys, offs, rows_of, wts.numpy(), shift)
    _each([(*head, bag_cuts[j * k], bag_cuts[(j + 1) * k], at[j], b_ids, b_src, b_w) for j in range(t)])
    return b_ids, b_src, b_w, starts, t


def _bucket_parts(starts: np.ndarray, n: int, t: int) -> list[tuple[int, int]]:
    """Buckets split into ``t`` runs of about the same number of ids (empty runs left out)."""
    nb = starts.shape[0] - 1
    edges = np.searchsorted(starts, [n * j // t for j in range(t)]).tolist() + [nb]
    edges[0] = 0
    return [(edges[j], edges[j + 1]) for j in range(t) if edges[j] < edges[j + 1]]


def _walked(
    storage, ids: torch.Tensor, grad: torch.Tensor, bag_of, psw, hp: dict, hpa: np.ndarray, opt: int, maximize: bool
) -> bool:
    """The step of :func:`apply_fused` by :func:`._numba_kernels.bucket_walk`: the ids into buckets
    whose rows' sums fit a core's cache, each bucket's rows summed there and stepped at once
    (no sort, no segments, no (U, D) gradient written and read back). False (nothing done) where
    counting does not apply: the sort's path runs instead. The same rows as that path, bit for bit
    (each row's ids summed in batch order either way; where ids carry multipliers, within rounding:
    ``embedding_bag`` may fuse each multiply-add).

    Measured (26 x 200k x 64, batch 8,192, power-law ids, row-wise Adagrad, whole steps against the
    grouping, reduction and update, alternated in one process; docs/benchmarks.md, "The step walked
    bucket by bucket"): 10 ids a bag 53.8 / 54.5 against 62.1 / 63.6 ms, one-hot 14.3 / 15.6 against 15.3 / 16.5."""
    from . import _numba_kernels as K

    if grad.shape[0] >= 2**31:  # (gradient rows are int32 places)
        return False
    weight = storage.weight.detach()
    dim, cdt = weight.shape[1], weight.dtype
    shift = max(6, min(_BUCKET_SHIFT, (_WALK_BYTES // (dim * weight.element_size())).bit_length() - 1))
    got = _bucketed(ids, weight.shape[0], bag_of, psw, cdt, shift)
    if got is None:
        return False
    b_ids, b_src, b_w, starts, t = got
    g = grad.to(cdt)
    g = g if g.stride(-1) == 1 else g.contiguous()
    s1, s2 = _state(storage, hp)
    parts = _bucket_parts(starts, ids.numel(), t)
    bufs = [
        (
            np.empty((1 << shift, dim), g.numpy().dtype),
            np.zeros(((1 << shift) + 63) >> 6, np.uint64),
            np.empty(1 << shift, np.int64),
        )
        for _ in parts
    ]
    head = (K.bucket_walk, b_ids, b_src, b_w, starts, shift)
    tail = (weight.numpy(), s1, s2, opt, hpa, maximize, bool(storage.keyed))
    _each([(*head, lo, hi, g.numpy(), *buf, *tail) for (lo, hi), buf in zip(parts, bufs)])
    return True


def apply_rows(
    storage, ids: torch.Tensor, grad: torch.Tensor, hp: dict, row_stat: torch.Tensor | None, scale: float = 1.0
) -> None:
    """One optimizer step of ``storage`` on rows ``ids`` (U,) distinct with their summed gradients
    ``grad`` (U, D) times ``scale`` (and, for row-wise Adagrad over column slices, the whole rows'
    mean squared gradients ``row_stat`` (U,), of the rows as scaled: ``scale`` does not touch it).
    ``storage.step`` must already count this step."""
    from . import _numba_kernels as K

    u = ids.numel()
    if u == 0:
        return
    weight = storage.weight.detach()
    cdt = weight.dtype
    s1, s2 = _state(storage, hp)
    hpa, opt, maximize = _hparams(storage, hp, scale)
    g = grad.to(cdt).contiguous().numpy()
    stat = np.zeros(0, dtype=g.dtype) if row_stat is None else row_stat.to(cdt).contiguous().numpy()
    t = _threads(u)
    edges = [u * k // t for k in range(t + 1)]
    slices = [(a, b) for a, b in zip(edges, edges[1:]) if b > a]
    head = (weight.numpy(), s1, s2, ids.to(torch.int64).contiguous().numpy(), g, stat)
    _run(K.ROW_KERNELS[opt], slices, head, (hpa, maximize))


def merge_rows(ids: list[torch.Tensor], rows: list[torch.Tensor], divisor: float) -> tuple | None:
    """Several sets of distinct row ids, each ascending, with their rows (U_k, D) -> (their union
    ascending, each id's rows summed in the order of the sets and divided by ``divisor``), in one
    pass per further set; None where this cannot (no Numba, a dtype it does not take, a set not
    ascending): the caller then sums another way. Sets of other shapes are refused (the kernel reads
    without bounds checks)."""
    width = rows[0].shape[1] if rows and rows[0].dim() == 2 else -1
    if len(ids) != len(rows) or any(
        i.dim() != 1 or r.dim() != 2 or r.shape != (i.numel(), width) for i, r in zip(ids, rows)
    ):
        raise ValueError(
            f"merge_rows: (ids (U,), rows (U, D)) per set, one D; got {[(i.shape, r.shape) for i, r in zip(ids, rows)]}"
        )
    if len(ids) < 2 or not all(r.dtype in _DTYPES and r.dtype == rows[0].dtype for r in rows) or not available():
        return None
    from . import _numba_kernels as K

    acc_ids, acc = ids[0].to(torch.int64).contiguous(), rows[0].contiguous()
    for k in range(1, len(ids)):
        last = k == len(ids) - 1
        b_ids, b = ids[k].to(torch.int64).contiguous(), rows[k].contiguous()
        out_ids = torch.empty(acc_ids.numel() + b_ids.numel(), dtype=torch.int64)
        out = torch.empty(out_ids.numel(), acc.shape[1], dtype=acc.dtype)
        a, o = acc.numpy(), out.numpy()  # (the divisor in the rows' dtype: a float32 row is divided as float32)
        n = K.merge_rows(
            acc_ids.numpy(), a, b_ids.numpy(), b.numpy(), out_ids.numpy(), o, o.dtype.type(divisor if last else 1)
        )
        if n < 0:
            return None
        acc_ids, acc = out_ids[:n], out[:n]
    return acc_ids, acc


def parts_ready(storage, ids: list[torch.Tensor], rows: list[torch.Tensor]) -> tuple | None:
    """Several parts' reduced row gradients of ``storage`` (per part: distinct row ids (U_k,) strictly
    ascending, their rows (U_k, D) in the table's dtype) -> what :func:`apply_parts` steps them from:
    every part but the last summed (:func:`merge_rows`), as NumPy arrays; None where this cannot (no
    Numba, fewer than two parts, another dtype or shape, ids not strictly ascending rows of the table):
    the caller sums them first then. Nothing is changed either way."""
    weight = storage.weight.detach()
    nrows, dim = weight.shape
    if len(ids) < 2 or len(ids) != len(rows) or weight.dtype not in _DTYPES or not available():
        return None
    if any(i.dim() != 1 or r.shape != (i.numel(), dim) or r.dtype != weight.dtype for i, r in zip(ids, rows)):
        return None
    from . import _numba_kernels as K

    ids = [i.to(torch.int64).contiguous() for i in ids]
    if not all(K.ascending_within(i.numpy(), nrows) for i in ids):
        return None
    first = (ids[0], rows[0]) if len(ids) == 2 else merge_rows(ids[:-1], rows[:-1], 1.0)
    if first is None:
        return None
    a_ids, a = first
    return a_ids.numpy(), a.contiguous().numpy(), ids[-1].numpy(), rows[-1].contiguous().numpy()


def apply_parts(storage, ready: tuple, divisor: float, hp: dict) -> torch.Tensor:
    """One optimizer step of ``storage`` on the union of two parts' rows (:func:`parts_ready`), each
    row's gradient ``(a + b) / divisor`` made as the row is stepped (the bits of :func:`merge_rows`
    then :func:`apply_rows`, with no (U, D) sums written and read again); slices of the union by
    row, one per thread. ``storage.step`` must already count this step. Returns the union's ids."""
    from . import _numba_kernels as K

    a_ids, a, b_ids, b = ready
    weight = storage.weight.detach().numpy()
    s1, s2 = _state(storage, hp)
    hpa, opt, maximize = _hparams(storage, hp)
    na, nb = a_ids.shape[0], b_ids.shape[0]
    t = _threads(na + nb)
    ref, other = (a_ids, b_ids) if na >= nb else (b_ids, a_ids)
    cuts = [ref.shape[0] * k // t for k in range(t + 1)]
    theirs = [0, *np.searchsorted(other, ref[cuts[1:-1]]).tolist(), other.shape[0]]
    ia, ib = (cuts, theirs) if na >= nb else (theirs, cuts)
    out = np.empty(na + nb, dtype=np.int64)
    div = a.dtype.type(divisor)  # (in the rows' dtype, as merge_rows divides)
    tail = (weight, s1, s2, opt, hpa, maximize)
    at = [ia[k] + ib[k] for k in range(t)]  # (slice k's union starts there at the latest)
    counts = _each(
        [
            (K.merged_step, a_ids, a, b_ids, b, div, ia[k], ia[k + 1], ib[k], ib[k + 1], out, at[k], *tail)
            for k in range(t)
        ]
    )
    return torch.cat([torch.from_numpy(out[p : p + n]) for p, n in zip(at, counts)])


def distinct_rows(ids: torch.Tensor, nrows: int) -> tuple | None:
    """``torch.unique(ids, return_inverse=True)`` of row numbers ``0 .. nrows - 1``, and each distinct
    row's first id: (rows ascending (U,), each id's place among them (N,), each row's first position
    in ``ids`` (U,)), by a bit a row (:func:`._numba_kernels.distinct_rows`: no sort; 106k power-law
    ids of 2.6M rows, one thread: 0.9 against 2.0 ms). None where it does not run (no Numba, ids not
    on the host, more than :data:`_DISTINCT_ROWS` rows an id, an id out of range): the caller sorts."""
    n = ids.numel()
    if n == 0 or ids.device.type != "cpu" or nrows > _DISTINCT_ROWS * max(n, 1024) or not available():
        return None
    from . import _numba_kernels as K

    words, most = (nrows + 63) >> 6, min(n, nrows)
    uniq, inverse, first = np.empty(most, np.int64), np.empty(n, np.int64), np.empty(most, np.int64)
    c = K.distinct_rows(
        _int64s(ids), nrows, np.zeros(words, np.uint64), np.empty(words, np.int64), uniq, inverse, first
    )
    if c < 0:
        return None
    return torch.from_numpy(uniq[:c]), torch.from_numpy(inverse), torch.from_numpy(first[:c])
