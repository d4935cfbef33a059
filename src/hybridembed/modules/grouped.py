"""Grouped lookups for models that call their embedding layers one by one.

A plain model looks its features up layer by layer (DeepCTR: 52 calls per step). Each
call of a converted layer is *deferred*: it is queued on its collection's
:class:`LookupQueue` and returns a :class:`DeferredRows`, a tensor that knows its shape,
dtype and device but holds no data yet. The first time any deferred output is used by a
torch op (the ``torch.cat`` that joins a model's embeddings, an MLP layer, ``.sum()``),
every lookup queued so far runs at once through
:meth:`~hybridembed.EmbeddingCollection.lookup_many`: one kernel call per group of
tables, one validation sync, one sparse gradient per group. The op then runs on the real
rows; autograd sees ordinary tensors. When that first use is a ``torch.cat`` of the queued
outputs along their last dim, the kernel call may write the joined tensor itself (:mod:`.joined`).

Rules that keep this exact:

- Results are those of the per-layer calls: the same rows, the same gradients; only the
  number of kernel calls changes. Queries of metadata (``shape``, ``size()``, ``dim()``,
  ``dtype``, ``device``) answer without running the lookups.
- A queue holds lookups of one mode (grad enabled, inference mode, training): a call in
  another mode runs the queue first. The model's forward ends with nothing queued
  (:func:`hybridembed.convert` adds forward hooks: lookups are deferred only while the
  converted model's forward runs, and what is left runs when it returns). A layer called
  on its own, outside the model's forward, looks up at once.
- Structure, dtype and device of the ids are checked when the layer is called; the range
  of the ids when the queue runs (one sync for all of them), so an out-of-range id is
  reported at the first use of any output of that forward, naming the table and position.
  A queue that fails changes no table, and every one of its outputs re-raises the error.
- Tracing and compiling (``torch.jit``, ``torch.fx``, ``torch.compile``) see per-layer
  calls: nothing is deferred there. ``he.convert(model, grouped=False)`` turns it off.
- Known limit: ``torch.autograd.Function.apply`` (a custom autograd function, or
  ``torch.utils.checkpoint`` with ``use_reentrant=True``) does not go through
  ``__torch_function__``; handed a deferred output directly, it records the placeholder,
  not the rows, and the table gets no gradient (reentrant checkpoint says so with an error).
  Pass such functions an op's result (``torch.cat``, ``x * 1``) or convert with
  ``grouped=False``.

    >>> import torch, hybridembed as he
    >>> ec = he.EmbeddingCollection([he.TableConfig("a", 10, 4), he.TableConfig("b", 10, 4)])
    >>> queue = LookupQueue(ec)
    >>> queue.enter()                     # (convert's hooks do this when the model's forward begins)
    >>> x = queue.request("a", he.Jagged(torch.tensor([1, 2]), torch.tensor([0, 1, 2])), (2, 4))
    >>> y = queue.request("b", he.Jagged(torch.tensor([3]), torch.tensor([0, 1])), (1, 4))
    >>> x.shape, len(queue)               # metadata only: nothing has run yet
    (torch.Size([2, 4]), 2)
    >>> z = torch.cat([x, y])             # first use: both lookups run, one kernel call
    >>> z.shape, len(queue), queue.flushes
    (torch.Size([3, 4]), 0, 1)
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import _symbolic_trace as _fx

from ..input import Jagged
from .joined import JOINS

__all__ = ["DeferredRows", "LookupQueue", "deferral_possible"]

# metadata a deferred output answers by itself, without running its lookup
_METADATA = {
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.ndimension,
    torch.Tensor.numel,
    torch.Tensor.nelement,
    torch.Tensor.shape.__get__,
    torch.Tensor.ndim.__get__,
    torch.Tensor.dtype.__get__,
    torch.Tensor.device.__get__,
    torch.Tensor.is_cuda.__get__,
    torch.Tensor.layout.__get__,
    torch.Tensor.is_sparse.__get__,
}


_fx_tracing = getattr(_fx, "is_fx_symbolic_tracing", None) or getattr(_fx, "is_fx_tracing", lambda: False)


def deferral_possible() -> bool:
    """False while tracing or compiling, where a deferred tensor would be baked into a graph."""
    if torch._C._get_tracing_state() is not None or torch.compiler.is_compiling():
        return False
    return not _fx_tracing()


def _real(x: Any) -> Any:
    if isinstance(x, DeferredRows):
        return x.materialize()
    if type(x) in (list, tuple) and any(isinstance(v, DeferredRows) for v in x):
        return type(x)(_real(v) for v in x)
    if type(x) is dict and any(isinstance(v, DeferredRows) for v in x.values()):
        return {k: _real(v) for k, v in x.items()}
    return x


class DeferredRows(torch.Tensor):
    """The output of a queued lookup: shape, dtype and device now, data at first use."""

    _queue: LookupQueue | None
    _value: torch.Tensor | None
    _error: BaseException | None
    _joined: tuple | None  # (a joined lookup's Made, this output's request in it): see .joined

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, queue: LookupQueue):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        t._queue, t._value, t._error, t._joined = queue, None, None, None
        return t

    def materialize(self) -> torch.Tensor:
        """The real output (runs the queue if it has not run yet)."""
        if self._value is None:
            if self._joined is not None:  # (made by a joined lookup: its columns of the cat)
                made, i = self._joined
                self._value, self._joined = made.value(i), None
                return self._value
            if self._error is None and self._queue is not None:
                self._queue.flush()
            if self._error is not None:
                raise self._error
            if self._value is None:  # pragma: no cover - a bug if reached
                raise RuntimeError("a deferred embedding lookup was never run")
        return self._value

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if func in JOINS:  # (a cat that is the first use of the queued lookups: made by their kernel call)
            joined = _join(args, kwargs or {})
            if joined is not None:
                return joined
        args = tuple(_real(a) for a in args)
        kwargs = {k: _real(v) for k, v in kwargs.items()} if kwargs else {}
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # pragma: no cover - guarded above
        raise RuntimeError(
            f"a deferred embedding output reached {func} without going through __torch_function__; "
            "convert the model with he.convert(model, grouped=False) and report this"
        )

    def __repr__(self, *, tensor_contents=None) -> str:  # printing is a use: the queue runs
        return repr(self.materialize())

    def __reduce_ex__(self, proto):
        return self.materialize().__reduce_ex__(proto)


def _join(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """``torch.cat(tensors, dim)`` made by a joined lookup (:mod:`.joined`), or None."""
    tensors = args[0] if args else kwargs.get("tensors")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis", 0))
    if type(tensors) not in (list, tuple) or len(args) > 2 or set(kwargs) - {"tensors", "dim", "axis"}:
        return None
    if not isinstance(dim, int) or isinstance(dim, bool):
        return None
    queue = next((t._queue for t in tensors if isinstance(t, DeferredRows) and t._value is None), None)
    return None if queue is None else queue.flush_joined(list(tensors), dim)


class _Request:
    __slots__ = ("feature", "ids", "post", "out", "shape", "dtype")

    def __init__(
        self, feature: str, ids: Jagged, post: Callable | None, out: DeferredRows, shape: tuple, dtype: torch.dtype
    ):
        self.feature, self.ids, self.post, self.out = feature, ids, post, out
        self.shape, self.dtype = shape, dtype  # (the output's: read from the DeferredRows, each costs a dispatch)

    def finish(self, rows: torch.Tensor) -> torch.Tensor:
        """The lookup's rows -> the requested output: ``post(rows)``, or rows in the output's
        dtype and shape."""
        if self.post is not None:
            return self.post(rows)
        if not isinstance(rows, torch.Tensor):  # (a sequence feature's Jagged of rows)
            return rows
        if rows.dtype != self.dtype:
            rows = rows.to(self.dtype)
        return rows.reshape(self.shape)


def _on_stack(frame) -> bool:
    """Whether ``frame`` is running in this thread (None: unknown, taken as running)."""
    if frame is None:
        return True
    f = sys._getframe(1)
    while f is not None:
        if f is frame:
            return True
        f = f.f_back
    return False


class _ThreadState(threading.local):
    """A queue's state in one thread: forwards running in other threads (a threaded server) have
    their own lookups, mode and depth, so one forward's bad ids or exception never fails another's."""

    def __init__(self) -> None:
        self.pending: list[_Request] = []
        self.mode: tuple[bool, bool, bool] | None = None
        self.depth = 0  # forwards of the owning model under way: lookups are deferred only inside one
        self.defer = False
        self.handling: list[BaseException | None] = []  # per forward under way: the exception handled around it
        self.frames: list = []  # per forward under way: the frame that called its pre-hook
        self.flushes_at_enter = 0  # the queue's flushes when the outermost forward began


def _in_thread(name: str) -> property:
    return property(lambda q: getattr(q._thread, name), lambda q, v: setattr(q._thread, name, v))


class LookupQueue:
    """Lookups on one collection, requested one by one and run together (see the module docstring).
    Each thread has its own queue state."""

    depth = _in_thread("depth")
    handling = _in_thread("handling")

    def __init__(self, collection) -> None:
        self.collection = collection
        self._thread = _ThreadState()
        self.flushes = 0  # times the queue ran (one kernel call per group each time)

    def __getstate__(self) -> dict:  # (copies start with nothing queued)
        return {"collection": self.collection, "flushes": self.flushes}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._thread = _ThreadState()

    @property
    def active(self) -> bool:
        """Whether a lookup requested now is deferred: inside the model's forward, not tracing
        (decided when the outermost forward began)."""
        t = self._thread
        return t.depth > 0 and t.defer

    def enter(self, frame=None) -> None:
        """The owning model's forward begins (``frame``: the frame running it, while it runs).

        A forward that was interrupted by a ``BaseException`` torch does not run hooks for
        (``KeyboardInterrupt``) left its state behind: it is dropped here, when its frame is no
        longer on the stack."""
        t = self._thread
        if t.depth and t.frames and not _on_stack(t.frames[-1]):
            self._drop("the forward that requested this lookup was interrupted")
            t.depth, t.frames, t.handling = 0, [], []
        if t.depth == 0:
            t.defer = deferral_possible()
            t.flushes_at_enter = self.flushes
        t.depth += 1
        t.frames.append(frame)

    def exit(self, ok: bool = True, error: BaseException | None = None) -> None:
        """The owning model's forward ends: what is still queued runs now (dropped if it raised).

        A forward that raised (``error``) before its lookups ran tells the collection
        (``step_failed``): a sharded one tells the other ranks, which wait for this rank's lookups
        in their exchange, that it will not make them."""
        t = self._thread
        t.depth = max(0, t.depth - 1)
        if t.frames:
            t.frames.pop()
        if t.depth:
            return
        if ok:
            self.flush()
            return
        unsent = bool(t.pending) or self.flushes == t.flushes_at_enter
        self._drop("the forward that requested this lookup raised")
        if unsent:
            try:
                self.collection.step_failed(error if error is not None else RuntimeError("the forward raised"))
            except Exception:  # noqa: BLE001 - this forward is failing already, with its own error
                pass

    def _drop(self, why: str) -> None:
        dropped, self._thread.pending = self._thread.pending, []
        for r in dropped:
            r.out._error, r.out._queue = RuntimeError(why), None

    def __len__(self) -> int:
        return len(self._thread.pending)

    def capture(self, call: Callable[[], Any]) -> list[tuple[str, Jagged]]:
        """The lookups ``call()`` requests (a converted layer called on its next input), checked as
        the queue checks them, as ``(feature, ids)``: recorded, not run (their outputs raise if
        used). What this thread had queued stays queued. For ``he.prefetch``."""
        t = self._thread
        saved = (t.pending, t.depth, t.defer, t.mode)
        t.pending, t.depth, t.defer = [], 1, True
        try:
            call()
            got = t.pending
        finally:
            dropped = t.pending
            t.pending, t.depth, t.defer, t.mode = saved
            for r in dropped:
                r.out._error, r.out._queue = RuntimeError("a lookup recorded for a prefetch has no rows"), None
        return [(r.feature, r.ids) for r in got]

    def request(
        self,
        feature: str,
        ids: Jagged,
        shape: tuple[int, ...],
        dtype: torch.dtype | None = None,
        post: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> DeferredRows:
        """Queues the lookup of ``ids`` for ``feature``; its output, ``post(rows)`` when given,
        will have ``shape`` and ``dtype`` (the table's compute dtype by default)."""
        ids, compute_dtype, device = self.collection._request_input(feature, ids)
        return self._enqueue(feature, ids, post, shape, compute_dtype if dtype is None else dtype, device)

    def request_rows(self, feature: str, ids: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> DeferredRows:
        """:meth:`request` of ``ids`` (N,), one per bag, whose rows (N, D) are returned in
        ``dtype`` and viewed as ``shape`` (a converted ``nn.Embedding``: the common call, kept
        short)."""
        return self.request(feature, Jagged(ids, self.collection._one_per_bag(ids.shape[0], ids.device)), shape, dtype)

    def _enqueue(self, feature: str, ids: Jagged, post, shape, dtype: torch.dtype, device) -> DeferredRows:
        """Queues checked ``ids``; a call in another mode (grad, inference, training) runs the queue first."""
        t = self._thread
        mode = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), self.collection.training)
        if t.pending and mode != t.mode:
            self.flush()
        t.mode = mode
        out = DeferredRows(shape, dtype, device, self)
        t.pending.append(_Request(feature, ids, post, out, tuple(shape), dtype))
        return out

    def flush_joined(self, tensors: list, dim: int) -> torch.Tensor | None:
        """``torch.cat(tensors, dim)`` of 2-D tensors along their last dim, or of 3-D ones along
        dim 1 (outputs (B, 1, D)), when they hold every queued lookup of their group: made by one
        kernel call in the joined layout (:mod:`.joined`), or None (nothing run) where it does not
        apply. The other groups' queued lookups stay queued."""
        t = self._thread
        waiting = {id(r.out): r for r in t.pending}
        reqs, pieces, nd = [], [], None
        for x in tensors:
            if isinstance(x, DeferredRows) and (x._value is None or x._joined is not None):
                r = waiting.pop(id(x), None)
                if r is None or r.post is not None or not (len(r.shape) == 2 or r.shape[1:2] == (1,)):
                    return None  # (another queue's, one joined already, twice in this cat, a shaped output)
                pieces.append(len(reqs))
                reqs.append(r)
                nd = nd or len(r.shape)
            elif isinstance(x, torch.Tensor):
                v = x._value if isinstance(x, DeferredRows) else x  # (a deferred output run already: its rows)
                if v is None or v.dim() not in (2, 3):
                    return None
                pieces.append(v)
            else:
                return None
        if (
            nd is None
            or any(len(r.shape) != nd for r in reqs)
            or any(not isinstance(p, int) and p.dim() != nd for p in pieces)
        ):
            return None
        joined = getattr(self.collection, "_lookup_joined", None)
        if dim not in ((1, -1) if nd == 2 else (1, -2)) or joined is None or t.mode[1]:
            return None
        grad, _, train = t.mode
        if torch.is_grad_enabled() != grad or torch.is_inference_mode_enabled():
            return None  # (a cat in another grad mode than its lookups': the lookups, then the cat in its own)
        queued = t.pending
        t.pending = [r for r in queued if id(r.out) in waiting]  # (other groups' lookups: still queued)
        others = [r.feature for r in t.pending]
        try:
            with torch.set_grad_enabled(grad):
                out = joined(
                    [(r.feature, r.ids) for r in reqs], [(r.shape, r.dtype) for r in reqs], pieces, train, others
                )
        except BaseException as e:  # (as a failed flush: every queued output re-raises it)
            t.pending = []
            for r in queued:
                r.out._error, r.out._queue = e, None
            self.flushes += 1
            raise
        if out is None:
            t.pending = queued
            return None
        self.flushes += 1
        out, made = out
        for i, r in enumerate(reqs):
            r.out._joined, r.out._queue = (made, i), None
        return out

    def flush(self) -> None:
        """Runs every queued lookup: one kernel call per group."""
        reqs, self._thread.pending = self._thread.pending, []
        if not reqs:
            return
        grad, inference, train = self._thread.mode
        self.flushes += 1
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                rows = self.collection._lookup_many([(r.feature, r.ids) for r in reqs], train, checked=True)
                for r, x in zip(reqs, rows):
                    r.out._value = r.finish(x)
                    r.out._queue = None
        except BaseException as e:
            for r in reqs:
                r.out._error, r.out._queue = e, None
            raise
