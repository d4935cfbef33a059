"""What every storage shares: rows in one matrix, optimizer state beside them, the update.

:class:`RowStorage` implements the parts of :class:`~hybridembed.storage.Storage` (the
protocol) that do not depend on how ids map to rows. A storage holds ``weight`` (R, D),
one ``nn.Parameter`` for a group of tables, and ``state``: the optimizer's per-row
tensors, (R,) or (R, D), float32 (float64 for float64 tables). The collection writes the
per-table ``state_dict`` entries; the storage itself writes none.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ..config import TableConfig
from ..errors import HybridEmbedError
from ..input import bag_index
from ..kernels import cpu_fused, reduce_rows
from ..kernels.backend import uses_triton
from ..kernels.fused import fusable
from ..kernels.lookup import Bags, weight_grad
from ..utils import advise_huge_pages

__all__ = ["RowStorage", "add_sparse"]


# id -> storage, for the custom ops of compiled lookups (ops take tensors and numbers: the id names the
# storage); every storage registers itself when made, copied or unpickled (a compiled graph's op may run
# before any Python code of the step could)
_STORAGES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _register(storage) -> None:
    _STORAGES[id(storage)] = storage


def storage_of_key(key: int):
    """The storage :func:`storage_key` named (None if it is gone)."""
    return _STORAGES.get(key)


def add_sparse(acc: torch.Tensor | None, grad: torch.Tensor) -> torch.Tensor:
    """``acc + grad`` for a sparse ``grad`` (R, D): rows concatenated when ``acc`` is sparse too
    (the result is uncoalesced), added into it when dense, ``grad`` itself when ``acc`` is None."""
    if acc is None:
        return grad
    if not acc.is_sparse:
        return acc + grad
    idx = torch.cat([acc._indices(), grad._indices()], 1)
    return torch.sparse_coo_tensor(idx, torch.cat([acc._values(), grad._values()]), acc.shape, check_invariants=False)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class RowStorage(nn.Module):
    """The shared half of :class:`~hybridembed.storage.Storage`; subclasses add the lookup
    (``resolve``) and per-table access (``row_offset``, ``table_index``, ranges, ids)."""

    kind = "abstract"  # data (checkpoint manifests): "dense" or "dynamic"
    keyed = False  # ids are keys (any int64), not row numbers
    remote = False  # the rows live elsewhere (parameter servers): nothing to save or apply here
    tiered = False  # the rows live in files, a cache of them in memory (TieredStorage): read by ranges
    streamed = False  # checkpoints write and read its tables a part at a time (tiered: larger than memory)
    grad_sink = None  # the lookup's gradient reaches weight.grad through autograd
    kernels = "eager"  # the kernel backend (hybridembed.kernels.backend); the collection sets it

    def __init__(self) -> None:
        super().__init__()
        self.state: dict[str, torch.Tensor] = {}
        self.optimizer = None
        self.step = 0
        # Changes since the last checkpoint (he.save(incremental=True) writes only these):
        # ``_changed`` (slots,) bool marks rows (and their optimizer state or counters) written
        # since; ``_removed`` lists (2, E) (id, table index) of rows a dynamic table dropped
        # since. Kept only once a checkpoint started them (``track_changes``): None before.
        self._changed: torch.Tensor | None = None
        self._removed: list[torch.Tensor] = []
        self.checkpoint_base: str | None = None  # the checkpoint version the changes are counted from
        # a 0-d leaf on the host that requires grad, an input of every lookup traced by torch.compile:
        # its (zero) gradient is what the compiled backward's op returns (modules/compiled.py)
        self._compile_sink = torch.zeros((), requires_grad=True)
        # lookup gradients kept by the Triton kernels' backward for the fused update at the step:
        # (ids (N,), output gradient (S, D), offsets (S+1,), per-id multipliers (N,) or None, one id per bag)
        self._deferred: list[tuple] = []
        _register(self)

    def __setstate__(self, state) -> None:  # (a deepcopy or an unpickled storage: known to compiled lookups too)
        super().__setstate__(state)
        _register(self)

    # --- changes since the last checkpoint -------------------------------------------------
    def track_changes(self) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Start counting changes afresh (a checkpoint's snapshot): returns the changes counted
        so far (``(changed (slots,) bool or None, removed)``) and clears them."""
        old = (self._changed, self._removed)
        self._changed = torch.zeros(self.weight.shape[0], dtype=torch.bool, device=self.weight.device)
        self._removed = []
        return old

    def restore_changes(self, changed: torch.Tensor | None, removed: list[torch.Tensor]) -> None:
        """Add back changes taken by :meth:`track_changes` (a checkpoint that was not committed)."""
        if self._changed is None:
            return
        if changed is None:  # changes were not counted before: nothing is known to be unchanged
            self._changed.fill_(True)
        else:
            n = min(changed.numel(), self._changed.numel())
            self._changed[:n] |= changed[:n].to(self._changed.device)
        self._removed = list(removed) + self._removed

    def _mark(self, slots: torch.Tensor) -> None:
        """Rows ``slots`` (any shape of row numbers) changed since the last checkpoint."""
        if self._changed is not None and slots.numel():
            self._changed.index_fill_(0, slots.reshape(-1).long(), True)

    def _mark_span(self, start: int, stop: int) -> None:
        if self._changed is not None:
            self._changed[start:stop] = True

    def _new_state(self, rows: int, per_element: bool, fill: float) -> torch.Tensor:
        shape = (rows, self.dim) if per_element else (rows,)
        t = torch.empty(shape, dtype=self.compute_dtype, device=self.weight.device)
        advise_huge_pages(t)
        return t.fill_(fill)

    def attach_optimizer(self, optimizer, hparams: dict) -> None:
        """Allocate ``optimizer``'s per-row state beside the rows; resets the step."""
        self.optimizer = optimizer
        self.hparams = hparams
        self.step = 0
        if self._changed is not None:  # every row's state is new: a checkpoint's next delta holds them all
            self._changed.fill_(True)
        self.state = {
            name: self._new_state(self.weight.shape[0], per_element, fill)
            for name, (per_element, fill) in optimizer.state_spec(hparams).items()
        }

    def rows_by_id(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A keyed table's (ids ascending (K,), copies of their rows (K, D)) (its ``table_slots``)."""
        ids, slots = self.table_slots(name)
        return ids, self.weight.detach().index_select(0, slots)

    def reset_state_rows(self, slots: torch.Tensor) -> None:
        """Optimizer state of ``slots`` back to its initial value (rows given to new ids)."""
        if self.optimizer is None or slots.numel() == 0:
            return
        self._mark(slots)
        for name, (_, fill) in self.optimizer.state_spec(self.hparams).items():
            self.state[name].index_fill_(0, slots, fill)

    def updatable(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Bool mask of the rows of ``ids`` an optimizer may update; None for all (dense)."""
        return None

    def grad_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The pending sparse gradient as (distinct row ids (U,), summed rows (U, D)); None if none."""
        if (
            self._deferred
            and self.weight.grad is None
            and not self.keyed
            and cpu_fused.runs_on(self.kernels, self.weight)
        ):
            # (kept lookup gradients on the CPU: summed per row by the fused step's reduction, no sparse gradient)
            ids, grad, bag_of, psw = self._kept_batch(self._take_deferred())
            return cpu_fused.reduce_kept(ids, grad, bag_of, psw, self.weight.shape[0]) if ids.numel() else None
        self.materialize_grad()
        g = self.weight.grad
        if g is None:
            return None
        if not g.is_sparse:
            names = ", ".join(t.name for t in self.tables)
            raise HybridEmbedError(
                f"tables {names}: a dense gradient reached the embedding rows (a loss term computed over the whole "
                "table, e.g. an L2 penalty on its weight). hybridembed tables train row-sparse: regularise with the "
                "optimizer's weight_decay (applied to the rows a step touches), or put the penalty on the looked-up "
                "rows (the layer outputs) instead of the table"
            )
        return reduce_rows(g)

    # --- gradients kept for the fused update (kernels="triton") -------------------------------
    def defer_grad(
        self,
        ids: torch.Tensor,
        grad: torch.Tensor,
        offsets: torch.Tensor,
        psw: torch.Tensor | None,
        one_per_bag: bool,
        rows_of: torch.Tensor | None = None,
    ) -> None:
        """A lookup's gradient, as the Triton backward leaves it: ``grad`` (S, D) of the bags
        ``offsets`` (S+1,) of row slots ``ids`` (N,), with multipliers ``psw`` (N,). Kept for the
        fused reduce-and-update at the optimizer step when the optimizer has one; otherwise made
        into the eager sparse gradient now (``weight.grad``, or the storage's grad sink).
        ``rows_of`` (S,): bag s's gradient is row ``rows_of[s]`` of ``grad`` (any number of rows:
        the model's own gradient buffer, read where it lies; see ``cpu_fused.pooled_parts``)."""
        self._deferred.append((ids, grad, offsets, psw, one_per_bag, rows_of))
        # (clip_grad_norm_ over a parameter list finds them from the parameter; a plain reference, so that
        # deepcopy and pickling of a model follow it; dropped once the kept gradients are)
        self.weight._hybridembed_storage = self
        if self.optimizer is None or not self._fusable():
            self.materialize_grad()

    def _fusable(self) -> bool:
        return fusable(self.optimizer, self.hparams)

    def materialize_grad(self) -> None:
        """Turns the kept lookup gradients into the eager sparse gradient (the reference path):
        before clipping, for an optimizer without a fused update, or a sharded collection's hooks."""
        entries = self._take_deferred()
        for ids, grad, offsets, psw, one, rows_of in entries:
            grad = grad if rows_of is None else grad.index_select(0, rows_of)  # (S, D)
            bags = Bags(offsets, ids.numel(), 1 if one else None)
            self.accumulate_grad(weight_grad(grad, ids, bags, psw, self.weight, self.compute_dtype))

    def fused_ready(self) -> bool:
        """The pending gradient is all kept lookup gradients, and the optimizer has a fused update."""
        return (
            bool(self._deferred)
            and self.weight.grad is None
            and self.optimizer is not None
            and self._fused_here()  # (not after a move to a device its kernels do not run on)
            and self._fusable()
        )

    def _fused_here(self) -> bool:
        """The fused update runs where the rows are: Triton on CUDA, the fused CPU step on the CPU."""
        return uses_triton(self.kernels, self.weight) or cpu_fused.runs_on(self.kernels, self.weight)

    @torch.no_grad()
    def apply_fused(self, hparams: dict, scale: float = 1.0) -> None:
        """One optimizer step from the kept lookup gradients, times ``scale``: duplicates summed and
        rows updated in one pass (:func:`hybridembed.kernels.triton_lookup.apply_fused` on CUDA, no
        host sync; :func:`hybridembed.kernels.cpu_fused.apply_fused` on the CPU)."""
        if uses_triton(self.kernels, self.weight):
            from ..kernels.triton_lookup import apply_fused
        else:
            apply_fused = cpu_fused.apply_fused

        ids, grad, bag_of, psw = self._kept_batch(self._take_deferred())
        self.step += 1
        if ids.numel() == 0:
            return
        self._mark(ids)
        apply_fused(self, ids, grad, bag_of, psw, hparams, scale)

    def _kept_batch(self, entries: list[tuple]) -> tuple:
        """Kept lookup gradients -> one batch: (ids (N,), bags' gradient (S', D), each id's row of it
        (N,) or None (id i is row i), multipliers (N,) or None)."""
        if len(entries) == 1:
            ids, grad, offsets, psw, one, rows_of = entries[0]
            fused_cpu = cpu_fused.runs_on(self.kernels, self.weight)
            if not one and offsets.numel() == ids.numel() + 1 and fused_cpu:
                # (one id a bag, given as a Jagged: seen here in one pass, instead of each id's bag
                # made and gathered; on the host, where reading the answer waits for nothing)
                one = bool(offsets[1:].sub(offsets[:-1]).eq(1).all())
            if one:
                bag_of = rows_of  # (each id's row of the model's gradient buffer, or None: id i is row i)
            elif fused_cpu:  # (made where needed; the counting sort reads the bags as they are)
                bag_of = cpu_fused.BagRows(offsets, ids.numel(), rows_of)
            else:
                bag_of = bag_index(offsets, ids.numel())
                bag_of = bag_of if rows_of is None else rows_of.index_select(0, bag_of)
        else:  # several lookups (or backwards) this step: one batch of bags
            entries = [e if e[5] is None else (*e[:1], e[1].index_select(0, e[5]), *e[2:5], None) for e in entries]
            ids, grad = torch.cat([e[0] for e in entries]), torch.cat([e[1] for e in entries])  # (N,), (S, D)
            bag_of, first = [], 0
            for e_ids, e_grad, offsets, _, one, _ in entries:
                n = e_ids.numel()
                bag_of.append((torch.arange(n, device=ids.device) if one else bag_index(offsets, n)) + first)
                first += e_grad.shape[0]
            bag_of = torch.cat(bag_of)
            psw = None
            if any(e[3] is not None for e in entries):
                psw = torch.cat([e[3] if e[3] is not None else grad.new_ones(e[0].numel()) for e in entries])
        return ids, grad, bag_of, psw

    def clear_grad(self) -> None:
        """Drops the pending gradient (``zero_grad``)."""
        self.weight.grad = None
        self._take_deferred()

    def _take_deferred(self) -> list[tuple]:
        entries, self._deferred = self._deferred, []
        self.weight.__dict__.pop("_hybridembed_storage", None)
        return entries

    def accumulate_grad(self, grad: torch.Tensor, distinct: bool = False) -> None:
        """Adds a lookup's sparse gradient (R, D) to ``weight.grad`` (the lookup's grad sink).

        Two sparse gradients are joined by concatenating their rows (uncoalesced), measured 8x
        faster than autograd's sparse ``+`` for 26 per-layer lookups a step; the optimizer sums
        duplicate rows once. ``distinct`` is for storages that track it (dynamic). A gradient sized
        to the matrix before it grew (rows added between forward and backward) is resized."""
        self.weight.grad = add_sparse(self.weight.grad, self._fit(grad))

    def _fit(self, grad: torch.Tensor) -> torch.Tensor:
        """A sparse gradient sized to the matrix as it is now (it may have grown since the forward)."""
        if grad.shape == self.weight.shape:
            return grad
        return torch.sparse_coo_tensor(grad._indices(), grad._values(), self.weight.shape, check_invariants=False)

    @torch.no_grad()
    def apply_gradient(
        self, ids: torch.Tensor, grad: torch.Tensor, hparams: dict, row_stat: torch.Tensor | None = None
    ) -> None:
        """One optimizer step on rows ``ids`` (U,) distinct (any order), with summed gradient ``grad`` (U, D).

        ``row_stat`` (U,): a row-wise optimizer's per-row statistic (the mean square of the
        row's gradient) when these rows are column slices of wider rows (taken over the whole row)."""
        self.step += 1
        mask = self.updatable(ids)
        if mask is not None and not bool(mask.all()):  # (copies the rows only when some are held back)
            ids, grad = ids[mask], grad[mask]
            row_stat = None if row_stat is None else row_stat[mask]
        if ids.numel() == 0:
            return
        self._mark(ids)
        if self._fusable() and cpu_fused.runs_on(self.kernels, self.weight):  # one pass per row, no temporaries
            cpu_fused.apply_rows(self, ids, grad, hparams, row_stat)
            return
        w, opt, g = self.weight, self.optimizer, grad.to(self.compute_dtype)
        state = {k: v.index_select(0, ids) for k, v in self.state.items()}  # gathered copies
        if opt.additive(hparams):  # row += scale * t: one scatter-add, the rows are never gathered
            t, scale = opt.delta(g, state, self.step, hparams, *(() if row_stat is None else (row_stat,)))
            # dense += coalesced sparse: a parallel per-row axpy; measured 2.1x faster than the
            # serial index_add_ on 92k distinct sorted rows (2 threads), 1.3x on 600k. That
            # kernel (add_dense_sparse_worker_*) needs distinct rows only, not sorted ones, and
            # this tensor never leaves here.
            upd = torch.sparse_coo_tensor(
                ids.unsqueeze(0), t.to(w.dtype), w.shape, is_coalesced=True, check_invariants=False
            )
            w.add_(upd, alpha=scale)
        else:
            rows = w.index_select(0, ids).to(self.compute_dtype)  # (U, D)
            w.index_copy_(0, ids, opt.update(rows, g, state, self.step, hparams).to(w.dtype))
        for k, v in state.items():
            self.state[k].index_copy_(0, ids, v)

    @torch.no_grad()
    def apply_parts(self, parts, hparams: dict) -> None:
        """One optimizer step from several parts' reduced gradients (:class:`~hybridembed.optim.hooks.RowParts`:
        a replicated table's, one part per rank; a parameter server's pushes, one part per trainer).
        The fused CPU step reads each part's rows where they
        lie and sums them as it steps the rows, where every row is updatable and :meth:`apply_gradient`
        is this class's (:func:`hybridembed.kernels.cpu_fused.apply_parts`: the same bits as the sums
        applied); otherwise the sums are made and applied."""
        ready = None
        if (
            type(self).apply_gradient is RowStorage.apply_gradient
            and type(self).updatable is RowStorage.updatable
            and self._fusable()
            and cpu_fused.runs_on(self.kernels, self.weight)
        ):
            ready = cpu_fused.parts_ready(self, parts.ids, parts.rows)
        if ready is None:
            summed = parts.summed(self.weight.dtype, self.compute_dtype, self.weight.shape[0])
            if summed is not None:
                self.apply_gradient(summed.ids, summed.rows, hparams)
            return
        self.step += 1
        self._mark(cpu_fused.apply_parts(self, ready, parts.divisor, hparams))

    def after_step(self) -> None:
        """Called by the optimizer after every step, whether or not this storage had a gradient."""

    def read_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """(K,) row slots -> (K, D) copies of their rows (no autograd)."""
        return self.weight.detach().index_select(0, slots)

    # --- per-table helpers ---------------------------------------------------------------
    def _table(self, name: str) -> TableConfig:
        """Table ``name``'s config; unknown names are refused, naming the storage's tables."""
        for t in self.tables:
            if t.name == name:
                return t
        names = ", ".join(t.name for t in self.tables)
        raise HybridEmbedError(f"table {name!r} is not in this storage; it holds: {names}")

    def _row_bytes(self) -> int:
        """Bytes of one row and its optimizer state."""
        return self.weight.shape[1] * self.weight.element_size() + sum(
            (v[0].numel() if v.dim() > 1 else 1) * v.element_size() for v in self.state.values()
        )

    def _check_rows_data(self, table: str, data: dict[str, Any], cols: int | None = None) -> tuple[int, int]:
        """Checks ``data``: ``{"weight": (K, C), state name: (K, C) per-element or (K,) row-wise}``
        (any subset of those keys; C is ``cols`` when given, else the same for every (K, C)
        entry) -> (K, C) (C is 0 when only row-wise state is given). Raises, naming the bad
        entry, before anything is written."""
        if not isinstance(data, dict):
            raise HybridEmbedError(
                f"table {table!r}: rows to write must be a dict of tensors, got {type(data).__name__}"
            )
        allowed = ["weight", *self.state]
        unknown = [k for k in data if k not in allowed]
        if unknown:
            raise HybridEmbedError(
                f"table {table!r}: cannot write {unknown[0]!r}; allowed keys: {', '.join(allowed)} "
                "(the rows and this storage's optimizer state)"
            )
        k = None
        for name, v in data.items():
            per_element = name == "weight" or self.state[name].dim() > 1
            if not isinstance(v, torch.Tensor) or not v.is_floating_point():
                got = f"{v.dtype} tensor" if isinstance(v, torch.Tensor) else type(v).__name__
                raise HybridEmbedError(f"table {table!r}: {name!r} must be a floating point tensor, got {got}")
            if v.dim() != (2 if per_element else 1):
                want = "(K, C) (rows x columns)" if per_element else "(K,) (one value per row)"
                raise HybridEmbedError(f"table {table!r}: {name!r} must be {want}, got shape {tuple(v.shape)}")
            if per_element:
                if cols is not None and v.shape[1] != cols:
                    raise HybridEmbedError(f"table {table!r}: {name!r} has {v.shape[1]} columns, expected {cols}")
                cols = v.shape[1]
            if k is not None and v.shape[0] != k:
                raise HybridEmbedError(f"table {table!r}: {name!r} has {v.shape[0]} rows, the other entries {k}")
            k = v.shape[0]
        if k is None:
            raise HybridEmbedError(f"table {table!r}: nothing to write; give 'weight' and/or optimizer state")
        return k, cols or 0

    def _check_ids_data(
        self, table: str, ids: Any, rows: Any, state: dict[str, Any] | None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Checks a ``write_ids`` call: (K,) distinct integer ids, rows (K, D), state of K rows.
        -> (ids as int64 on the storage's device, ``{"weight": rows, **state}``)."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point() or ids.dtype == torch.bool:
            got = f"{tuple(ids.shape)} {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise HybridEmbedError(f"table {table!r}: ids must be a (K,) integer tensor, got {got}")
        if state is not None and not isinstance(state, dict):
            raise HybridEmbedError(
                f"table {table!r}: state must be a dict of tensors or None, got {type(state).__name__}"
            )
        if state and "weight" in state:
            raise HybridEmbedError(f"table {table!r}: pass the rows as rows, not in state")
        data = {"weight": rows, **(state or {})}
        k, _ = self._check_rows_data(table, data, self.dim)
        if k != ids.numel():
            raise HybridEmbedError(f"table {table!r}: {ids.numel()} ids but {k} rows")
        ids = ids.to(self.weight.device, torch.int64)
        if k and ids.unique().numel() != k:
            raise HybridEmbedError(f"table {table!r}: an id appears more than once in the ids to write")
        return ids, data

    def _apply(self, fn, recurse=True):  # .to(device) moves the optimizer state with the rows
        out = super()._apply(fn, recurse)
        self.state = {k: v.to(self.weight.device) for k, v in self.state.items()}
        if self._changed is not None:
            self._changed = self._changed.to(self.weight.device)
            self._removed = [r.to(self.weight.device) for r in self._removed]
        return out

    @property
    def memory_bytes(self) -> int:
        """Bytes of rows and optimizer state."""
        return sum(t.numel() * t.element_size() for t in [self.weight, *self.state.values()])

    # The collection writes one state_dict entry per table; the group matrix has none.
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        return

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        if strict:
            unexpected.extend(k for k in state_dict if k.startswith(prefix))
