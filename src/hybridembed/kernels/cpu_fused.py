"""The fused CPU step: each distinct row's gradient reduced and its optimizer update applied in
one pass (Numba kernels, :mod:`._numba_kernels`), for tables on the CPU with ``kernels="auto"``
(when Numba is installed) or ``kernels="numba"``.

Shape legend: ``N`` ids of a group's batch, ``S`` bags, ``U`` distinct rows, ``D`` dim.

**Forward**: PyTorch's ``embedding_bag`` (one call per group, as the eager path). **Backward**:
nothing is computed; the output gradient (S, D) and the ids are kept beside the storage
(:meth:`RowStorage.defer_grad`, as the Triton path does on CUDA). **Step**
(:func:`apply_fused`): the ids are sorted (``torch.sort``, int32, stable: equal rows side by
side in batch order), then every run of equal ids is summed from the kept gradient and its row
and optimizer state are read, updated and written once: no sparse gradient, no (U, D)
temporary, no separate reduce, square or scatter pass. The runs are cut into one slice per
thread (by ids, so a hot id's long run is one thread's), each slice a GIL-free kernel call.
Already-reduced rows (a sharded job's exchanged gradients, a parameter server's pushes) take
:func:`apply_rows`, the same update without the reduction.

Which optimizers: :data:`hybridembed.kernels.fused.FUSED` (SGD without momentum, Adagrad,
row-wise Adagrad, Adam, each with ``weight_decay`` and ``maximize``), on float32 and float64
tables; everything else (momentum, other optimizers, half-precision tables, clipping, per-id
weights that need their own gradient) turns the kept gradient into the eager sparse gradient
first, so the result is the eager path's. Without Numba the eager ops run, and the first table
that would have used the kernels logs one line saying so.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F

from ..utils import get_logger
from .fused import step_hparams

__all__ = ["available", "runs_on", "pooled_lookup", "apply_fused", "apply_rows"]

_log = get_logger("hybridembed.kernels")
_DTYPES = (torch.float32, torch.float64)
_MIN_PER_THREAD = 4096  # ids (or rows) below which a slice is not worth a thread


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


class _Kept(torch.autograd.Function):
    """``embedding_bag``; the backward keeps its gradient beside the storage for the fused step."""

    @staticmethod
    def forward(ctx, weight, ids, offsets, psw, storage, one_per_bag):
        ctx.storage, ctx.one_per_bag = storage, one_per_bag
        ctx.save_for_backward(ids, offsets, psw)
        return F.embedding_bag(ids, weight, offsets, mode="sum", per_sample_weights=psw, include_last_offset=True)

    @staticmethod
    def backward(ctx, grad):  # (S, D)
        ids, offsets, psw = ctx.saved_tensors
        ctx.storage.defer_grad(ids, grad.contiguous(), offsets, psw, ctx.one_per_bag)
        return None, None, None, None, None, None


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


def _threads(work: int) -> int:
    return max(1, min(torch.get_num_threads(), work // _MIN_PER_THREAD))


def _run(fn, slices: list[tuple[int, int]], *args) -> None:
    """``fn(*head, lo, hi, *tail)`` for each slice, one per thread (this one runs the first)."""
    global _pool
    if len(slices) == 1:
        fn(*args[0], *slices[0], *args[1])
        return
    with _pool_lock:
        if _pool is None or _pool._max_workers < len(slices) - 1:
            _pool = ThreadPoolExecutor(max_workers=max(len(slices) - 1, 1), thread_name_prefix="hybridembed-step")
        pool = _pool
    futures = [pool.submit(fn, *args[0], lo, hi, *args[1]) for lo, hi in slices[1:]]
    fn(*args[0], *slices[0], *args[1])
    for f in futures:
        f.result()


def _state(storage, hp: dict) -> tuple[np.ndarray, np.ndarray]:
    """The optimizer's state as two 2-D arrays (see :mod:`._numba_kernels`)."""
    names = list(storage.optimizer.state_spec(hp))
    arrays = [storage.state[n].numpy() for n in names]
    arrays = [a.reshape(-1, 1) if a.ndim == 1 else a for a in arrays]
    dummy = np.zeros((1, 1), dtype=storage.weight.detach().numpy().dtype)
    return (arrays[0] if arrays else dummy), (arrays[1] if len(arrays) > 1 else dummy)


def _hparams(storage, hp: dict) -> tuple[np.ndarray, int, bool]:
    h = step_hparams(storage.optimizer, hp, storage.step)
    dt = storage.weight.detach().numpy().dtype
    row = [h.lr, h.eps, 1.0 - h.b1, h.b2, 1.0 - h.b2, h.weight_decay, float(storage.dim), 1.0, 0.0]
    return np.array(row, dtype=dt), h.opt, h.maximize


def apply_fused(storage, ids: torch.Tensor, grad: torch.Tensor, bag_of: torch.Tensor | None, psw, hp: dict) -> None:
    """One optimizer step of ``storage`` from a kept lookup gradient: ids (N,) (row slots), the
    bags' gradient ``grad`` (S, D), each id's bag ``bag_of`` (N,) (None: id i is bag i) and
    multiplier ``psw`` (N,) or None. ``storage.step`` must already count this step."""
    from . import _numba_kernels as K

    n = ids.numel()
    if n == 0:
        return
    weight = storage.weight.detach()
    key = ids.to(torch.int32) if weight.shape[0] < 2**31 else ids
    sorted_ids, perm = torch.sort(key, stable=True)  # equal rows side by side, in batch order
    _, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    starts = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=starts[1:])
    s1, s2 = _state(storage, hp)
    hpa, opt, maximize = _hparams(storage, hp)
    cdt = weight.dtype
    g = grad.to(cdt).contiguous().numpy()
    bags = np.zeros(0, dtype=np.int64) if bag_of is None else bag_of.to(torch.int64).numpy()
    mult = np.zeros(0, dtype=g.dtype) if psw is None else psw.to(cdt).contiguous().numpy()
    u = counts.numel()
    t = _threads(n)
    if t == 1:
        slices = [(0, u)]
    else:  # one slice of runs per thread, cut where a run begins near k N / t
        cuts = torch.searchsorted(starts, torch.arange(1, t, dtype=torch.int64) * n // t).clamp_(max=u).tolist()
        edges = sorted({0, *cuts, u})
        slices = [(a, b) for a, b in zip(edges, edges[1:]) if b > a]
    head = (weight.numpy(), s1, s2, sorted_ids.numpy(), perm.numpy(), starts.numpy())
    tail = (bags, mult, g, hpa, maximize, bool(storage.keyed))
    _run(K.KERNELS[opt], slices, head, tail)


def apply_rows(storage, ids: torch.Tensor, grad: torch.Tensor, hp: dict, row_stat: torch.Tensor | None) -> None:
    """One optimizer step of ``storage`` on rows ``ids`` (U,) distinct with their summed gradients
    ``grad`` (U, D) (and, for row-wise Adagrad over column slices, the whole rows' mean squared
    gradients ``row_stat`` (U,)). ``storage.step`` must already count this step."""
    from . import _numba_kernels as K

    u = ids.numel()
    if u == 0:
        return
    weight = storage.weight.detach()
    cdt = weight.dtype
    s1, s2 = _state(storage, hp)
    hpa, opt, maximize = _hparams(storage, hp)
    g = grad.to(cdt).contiguous().numpy()
    stat = np.zeros(0, dtype=g.dtype) if row_stat is None else row_stat.to(cdt).contiguous().numpy()
    t = _threads(u)
    edges = [u * k // t for k in range(t + 1)]
    slices = [(a, b) for a, b in zip(edges, edges[1:]) if b > a]
    head = (weight.numpy(), s1, s2, ids.to(torch.int64).contiguous().numpy(), g, stat)
    _run(K.ROW_KERNELS[opt], slices, head, (hpa, maximize))
