"""What every storage shares: rows in one matrix, optimizer state beside them, the update.

A storage holds ``weight`` (R, D), one ``nn.Parameter`` for a group of tables, and
``state``: the optimizer's per-row tensors, (R,) or (R, D), float32 (float64 for float64
tables). The collection writes the per-table ``state_dict`` entries; the storage itself
writes none.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import HybridEmbedError
from ..kernels import reduce_rows
from ..utils import advise_huge_pages

__all__ = ["RowStorage", "add_sparse"]


def add_sparse(acc: torch.Tensor | None, grad: torch.Tensor) -> torch.Tensor:
    """``acc + grad`` for a sparse ``grad`` (R, D): rows concatenated when ``acc`` is sparse too
    (the result is uncoalesced), added into it when dense, ``grad`` itself when ``acc`` is None."""
    if acc is None:
        return grad
    if not acc.is_sparse:
        return acc + grad
    idx = torch.cat([acc._indices(), grad._indices()], 1)
    return torch.sparse_coo_tensor(idx, torch.cat([acc._values(), grad._values()]), acc.shape, check_invariants=False)


class RowStorage(nn.Module):
    kind = "abstract"

    def __init__(self) -> None:
        super().__init__()
        self.state: dict[str, torch.Tensor] = {}
        self.optimizer = None
        self.step = 0

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
        self.state = {
            name: self._new_state(self.weight.shape[0], per_element, fill)
            for name, (per_element, fill) in optimizer.state_spec(hparams).items()
        }

    def reset_state_rows(self, slots: torch.Tensor) -> None:
        """Optimizer state of ``slots`` back to its initial value (rows given to new ids)."""
        if self.optimizer is None or slots.numel() == 0:
            return
        for name, (_, fill) in self.optimizer.state_spec(self.hparams).items():
            self.state[name].index_fill_(0, slots, fill)

    def updatable(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Bool mask of the rows of ``ids`` an optimizer may update; None for all (dense)."""
        return None

    def grad_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The pending sparse gradient as (distinct row ids (U,), summed rows (U, D)); None if none."""
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

    def accumulate_grad(self, grad: torch.Tensor, distinct: bool = False) -> None:
        """Adds a lookup's sparse gradient (R, D) to ``weight.grad`` (the lookup's grad sink).

        Two sparse gradients are joined by concatenating their rows (uncoalesced), measured 8x
        faster than autograd's sparse ``+`` for 26 per-layer lookups a step; the optimizer sums
        duplicate rows once. ``distinct`` is for storages that track it (dynamic)."""
        self.weight.grad = add_sparse(self.weight.grad, grad)

    @torch.no_grad()
    def apply_gradient(self, ids: torch.Tensor, grad: torch.Tensor, hparams: dict) -> None:
        """One optimizer step on rows ``ids`` (U,) distinct (any order), with summed gradient ``grad`` (U, D)."""
        self.step += 1
        mask = self.updatable(ids)
        if mask is not None and not bool(mask.all()):  # (copies the rows only when some are held back)
            ids, grad = ids[mask], grad[mask]
        if ids.numel() == 0:
            return
        w, opt, g = self.weight, self.optimizer, grad.to(self.compute_dtype)
        state = {k: v.index_select(0, ids) for k, v in self.state.items()}  # gathered copies
        if opt.additive(hparams):  # row += scale * t: one scatter-add, the rows are never gathered
            t, scale = opt.delta(g, state, self.step, hparams)
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

    def after_step(self) -> None:
        """Called by the optimizer after every step, whether or not this storage had a gradient."""

    def _apply(self, fn, recurse=True):  # .to(device) moves the optimizer state with the rows
        out = super()._apply(fn, recurse)
        self.state = {k: v.to(self.weight.device) for k, v in self.state.items()}
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
