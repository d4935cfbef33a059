"""``DenseStorage``: the rows of a group of fixed-size tables in one matrix.

Table ``t`` of the group owns rows ``[row_offset[t], row_offset[t] + num_embeddings[t])``
of ``weight`` (R, D). Optimizer state tensors, when an optimizer adds them, are kept in
``state`` beside the rows with the same leading dimension R, so they move with the rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .. import init as _init
from ..config import TableConfig
from ..utils import advise_huge_pages

__all__ = ["DenseStorage"]


class DenseStorage(nn.Module):
    """Rows of several tables of one dim and dtype: ``weight`` (R, D), one ``nn.Parameter``."""

    kind = "dense"

    def __init__(self, tables: Sequence[TableConfig], seed: int = 0, device: torch.device | str | None = None):
        super().__init__()
        self.tables = list(tables)
        self.dim = self.tables[0].embedding_dim
        self.dtype = self.tables[0].dtype
        self.compute_dtype = self.tables[0].compute_dtype  # of updates and optimizer state
        offsets, total = {}, 0
        for t in self.tables:
            offsets[t.name] = total
            total += t.num_embeddings
        self.row_offset: dict[str, int] = offsets
        self.num_rows = total
        weight = torch.empty(total, self.dim, dtype=self.dtype, device=device)
        advise_huge_pages(weight)  # before the first write, so the pages fault in huge
        with torch.no_grad():
            for t in self.tables:
                rows = torch.arange(t.num_embeddings, device=weight.device)
                _init.generate(
                    t.init,
                    seed,
                    t.name,
                    rows,
                    self.dim,
                    out=weight[offsets[t.name] : offsets[t.name] + t.num_embeddings],
                )
        self.weight = nn.Parameter(weight)
        self.state: dict[str, torch.Tensor] = {}  # optimizer state, (R,) or (R, D) each
        self.optimizer = None
        self.step = 0

    # --- optimizer state beside the rows ------------------------------------------------
    def attach_optimizer(self, optimizer, hparams: dict) -> None:
        """Allocate ``optimizer``'s per-row state beside the rows; resets the step.

        State is float32 (float64 for float64 tables), whatever the storage dtype."""
        self.optimizer = optimizer
        self.step = 0
        self.state = {}
        for name, (per_element, fill) in optimizer.state_spec(hparams).items():
            shape = (self.num_rows, self.dim) if per_element else (self.num_rows,)
            t = torch.empty(shape, dtype=self.compute_dtype, device=self.weight.device)
            advise_huge_pages(t)
            self.state[name] = t.fill_(fill)

    @torch.no_grad()
    def apply(self, ids: torch.Tensor, grad: torch.Tensor, hparams: dict) -> None:
        """One optimizer step on rows ``ids`` (U,) distinct, with summed gradient ``grad`` (U, D)."""
        self.step += 1
        w = self.weight
        if ids.numel() == 0:
            return
        opt, g = self.optimizer, grad.to(self.compute_dtype)
        state = {k: v.index_select(0, ids) for k, v in self.state.items()}  # gathered copies
        if opt.additive(hparams):  # row += delta: one scatter-add, the rows are never gathered
            t, scale = opt.delta(g, state, self.step, hparams)
            w.index_add_(0, ids, t.to(w.dtype), alpha=scale)
        else:
            rows = w.index_select(0, ids).to(self.compute_dtype)  # (U, D)
            w.index_copy_(0, ids, opt.update(rows, g, state, self.step, hparams).to(w.dtype))
        for k, v in state.items():
            self.state[k].index_copy_(0, ids, v)

    def table_state(self, name: str) -> dict[str, torch.Tensor]:
        """Views of table ``name``'s rows of each optimizer state tensor."""
        start = self.row_offset[name]
        n = next(t.num_embeddings for t in self.tables if t.name == name)
        return {k: v[start : start + n] for k, v in self.state.items()}

    def table_rows(self, name: str) -> torch.Tensor:
        """(num_embeddings, D) view of table ``name``'s rows (shares memory)."""
        start = self.row_offset[name]
        n = next(t.num_embeddings for t in self.tables if t.name == name)
        return self.weight.detach()[start : start + n]

    def _apply(self, fn, recurse=True):  # .to(device) moves the optimizer state with the rows
        out = super()._apply(fn, recurse)
        self.state = {k: v.to(self.weight.device) for k, v in self.state.items()}
        return out

    @property
    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [self.weight, *self.state.values()])

    # The collection writes one state_dict entry per table; the group matrix has none.
    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: D401
        return

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        if strict:
            unexpected.extend(k for k in state_dict if k.startswith(prefix))

    def extra_repr(self) -> str:
        names = ", ".join(t.name for t in self.tables)
        return f"rows={self.num_rows}, dim={self.dim}, dtype={self.dtype}, tables=[{names}]"
