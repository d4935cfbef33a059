"""Joined lookups: a model's ``torch.cat`` of its deferred embedding outputs made by the kernel call.

Most recommendation models join their features' rows side by side before the dense part
(``torch.cat([emb(x) for ...], 1)``; DLRM's ``torch.cat([x] + ly, 1)``). A group's kernel call
writes its bags one feature after the other, (F x B, D), and the ``cat`` then copies every row
again into (B, W): at 26 features x 4,096 x 64 that copy is 27 MB, a third of a one-process step
on a 2-core machine (``docs/benchmarks.md``). FBGEMM's and TorchRec's layout is the joined one.

When the ``cat`` is the first use of a forward's deferred outputs (:mod:`.grouped`), along their
last dim (or dim 1 of (B, 1, D) outputs, DeepCTR's layout), and the outputs it joins are every
lookup of their group queued (one id a bag each, pooled by sum, of one batch size; other groups'
lookups stay queued), the queue hands the whole ``cat`` to the collection: the group's ids are
taken batch by batch (bag ``b * slots + s`` is the cat's ``s``-th input's bag ``b``), so the
kernel's (B x slots, D) output *is* the joined tensor; the ``cat``'s other inputs (a dense part's
(B, k x D) output) are bags with no id, filled after. Its gradient is kept as it lies for the
fused CPU step (each id's row of the joined gradient). Anything else (other layouts, kernels,
per-id weights, a dense input whose width is not a multiple of the rows') takes the usual path:
the lookups run, then ``torch.cat`` copies.

The joined outputs' own values are the ``cat``'s columns, copied out when a later op reads one
(rare: a model reads the joined tensor); see :class:`Made`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import HybridEmbedError
from ..input import Jagged
from ..kernels import cpu_fused

__all__ = ["lookup_joined", "prepare", "Ready", "Made", "JOINS"]

JOINS = (torch.cat, torch.concat, torch.concatenate)  # (the torch functions whose first use this takes)


class _KeptJoined(torch.autograd.Function):
    """``embedding_bag`` over bags in the joined layout -> (B, W), the dense inputs written in
    their columns; the backward keeps the rows' gradient beside the storage where it lies and
    gives each dense input its columns."""

    @staticmethod
    def forward(ctx, weight, ids, offsets, ones, storage, rows_of, shape, cols, *dense):
        ctx.storage, ctx.rows_of, ctx.cols, ctx.d, ctx.ones = storage, rows_of, cols, weight.shape[1], ones
        ctx.shapes = [x.shape for x in dense]
        ctx.keep = weight.requires_grad
        ctx.save_for_backward(ids)
        return _joined(weight, ids, offsets, shape, cols, dense)

    @staticmethod
    def backward(ctx, grad):  # (B, W) or (B, slots, D)
        g = grad if grad.is_contiguous() else grad.contiguous()
        if ctx.keep:
            (ids,) = ctx.saved_tensors
            source = g.view(-1, ctx.d)  # (B x slots, D): bag b * slots + s
            ctx.storage.defer_grad(ids, source, ctx.ones, None, True, ctx.rows_of)
        flat = _rows(g)
        return (None,) * 8 + tuple(flat[:, a:b].view(shape) for (a, b), shape in zip(ctx.cols, ctx.shapes))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (B, ...) viewed as (B, W): not ``view(B, -1)``, which an empty batch makes ambiguous."""
    return t.view(t.shape[0], math.prod(t.shape[1:]))


def _ones(ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids.numel() + 1, dtype=torch.int64, device=ids.device)


def _joined(weight, ids, offsets, shape, cols, dense) -> torch.Tensor:
    out = F.embedding_bag(ids, weight, offsets, mode="sum", include_last_offset=True)
    out = torch.ops.aten._unsafe_view(out, shape)  # (not a view for autograd: the model may change it in place)
    flat = _rows(out)
    for (a, b), x in zip(cols, dense):
        flat[:, a:b].copy_(x.reshape(shape[0], b - a))
    return out


def lookup_joined(
    collection,
    requests: Sequence[tuple[str, Jagged]],
    outs: Sequence[tuple],
    pieces: list[Any],
    train: bool,
    others: Sequence[str] = (),
):
    """``torch.cat(pieces, 1)`` where each piece is the index of a request ``(feature, ids)`` (the
    queue's, checked; its output's ``(shape, dtype)`` in ``outs``: (B, D), or (B, 1, D) when every
    piece is 3-D) or a tensor: made by one kernel call in the joined layout, as (the joined tensor,
    its :class:`Made`), or None where this layout does not apply (nothing was looked up then: the
    caller runs the usual path). ``others``: the features of lookups still queued besides (none of
    the requests' group may be among them)."""
    ready = prepare(collection, requests, outs, pieces, others)
    return None if ready is None else ready.run(train)


def prepare(collection, requests, outs: Sequence[tuple], pieces: list[Any], others: Sequence[str] = ()):
    """:func:`lookup_joined`'s checks (nothing looked up, nothing changed): a :class:`Ready` to run,
    or None where the joined layout does not apply."""
    feats = [collection._keyed(feature, i) for i, (feature, _) in enumerate(requests)]
    js = [ids for _, ids in requests]
    f0 = feats[0]
    storage = collection.storages[f0.group]
    cdt, b, d = f0.table.compute_dtype, js[0].values.numel(), storage.dim
    nd = len(outs[0][0])
    each = (b, d) if nd == 2 else (b, 1, d)  # (every output's shape)
    if not (
        all(f.group == f0.group and f.table.combiner == "sum" for f in feats)
        and all(j.weights is None and collection._trusted(j) and j.values.numel() == b for j in js)
        and all(tuple(shape) == each and dtype == cdt for shape, dtype in outs)
        and not any(f in collection._features and collection._features[f].group == f0.group for f in others)
        and cdt == storage.weight.dtype
        and cpu_fused.runs_on(storage.kernels, storage.weight)
    ):
        return None
    slot_of, cols, dense, width = {}, [], [], 0
    for p in pieces:
        if isinstance(p, int):
            slot_of[p] = width // d
            width += d
            continue
        k = p.shape[1] * d if nd == 3 else p.shape[1]  # (its width in the joined rows)
        if not (p.shape[0] == b and p.shape[-1] % d == 0 and p.shape[nd - 1] == (d if nd == 3 else p.shape[1])):
            return None
        if p.dtype != cdt or p.device != storage.weight.device:
            return None
        cols.append((width, width + k))
        dense.append(p)
        width += k
    shape = (b, width) if nd == 2 else (b, width // d, d)
    return Ready(collection, storage, feats, js, slot_of, cols, dense, shape, each)


class Ready:
    """A joined lookup checked by :func:`prepare`, to run."""

    def __init__(self, collection, storage, feats, js, slot_of: dict, cols: list, dense: list, shape, each):
        self.collection, self.storage, self.slot_of, self.each = collection, storage, slot_of, each
        self.order = sorted(slot_of, key=slot_of.get)  # the requests in the cat's order
        self.feats, self.js = [feats[i] for i in self.order], [js[i] for i in self.order]
        self.cols, self.dense, self.shape = cols, dense, shape

    def run(self, train: bool) -> tuple[torch.Tensor, Made]:
        """The lookup (validated first: bad ids raise and change nothing) -> (the joined tensor, its Made)."""
        collection, storage, slot_of, order = self.collection, self.storage, self.slot_of, self.order
        b, d, nf = self.shape[0], storage.dim, len(self.feats)
        slots = self.shape[1] if len(self.shape) == 3 else self.shape[1] // d
        batch = collection._assemble_small(storage, self.feats, self.js, [b] * nf, [b] * nf)
        collection._validate([batch], {f.jkey: j for f, j in zip(self.feats, self.js)})
        collection._plan_group(batch, train)
        plan, batch.plan = batch.plan, None
        ids, _ = plan.commit()  # (F x B,) row slots, feature after feature
        dev = ids.device
        ids = ids.view(nf, b).t().contiguous().view(-1)  # bag b * F + k: the cat's k-th lookup's bag b
        ones = collection._one_per_bag(ids.numel(), dev)  # (kept by the collection: no arange a step)
        if slots == nf:
            offsets, rows_of = ones, None
        else:  # the dense inputs' columns are bags with no id; each id's bag is its row of the (B x slots, D) output
            taken = torch.tensor([slot_of[i] for i in order], dtype=torch.int64, device=dev)
            before = torch.zeros(slots + 1, dtype=torch.int64, device=dev)
            before[taken + 1] = 1
            before = before.cumsum(0)[:-1]  # (slots,): lookups before each slot
            offsets = torch.empty(b * slots + 1, dtype=torch.int64, device=dev)
            torch.add(torch.arange(b, device=dev).mul_(nf).unsqueeze(1), before, out=offsets[:-1].view(b, slots))
            offsets[-1] = ids.numel()
            rows_of = (torch.arange(b, device=dev).mul_(slots).unsqueeze(1) + taken).view(-1)
        if ids.dtype != offsets.dtype:
            offsets = offsets.to(ids.dtype)
        weight, cols, dense = storage.weight, self.cols, self.dense
        grad = torch.is_grad_enabled() and (weight.requires_grad or any(x.requires_grad for x in dense))
        if grad:
            out = _KeptJoined.apply(weight, ids, offsets, ones, storage, rows_of, self.shape, cols, *dense)
        else:
            out = _joined(weight.detach(), ids, offsets, self.shape, cols, dense)
        spans = [(slot_of[i] * d, slot_of[i] * d + d) for i in range(nf)]
        return out, Made(out, spans, [self.each] * nf, grad, storage, ids.view(b, nf), order)


class Made:
    """A joined lookup's result, for its outputs' own values when a later op reads one: the
    columns of the joined tensor, copied; where that tensor was changed in place since, the rows
    looked up again (a dense table of this process, unchanged since: no optimizer step, no
    write); else an error. ``spans``/``shapes``: each request's columns and output shape;
    ``storage``, ``ids`` (B, F) and ``order``: where a request's rows can be looked up again (None:
    nowhere, a sharded job's rows come from their owners)."""

    def __init__(self, out, spans: list, shapes: list, grad: bool, storage=None, ids=None, order=()):
        self.out, self.version, self.spans, self.shapes, self.grad = out, out._version, spans, shapes, grad
        self.storage, self.ids = storage, ids  # (B, F) row slots in the cat's order
        self.column = {i: k for k, i in enumerate(order)}  # request -> its column of ids
        if storage is not None:
            self.step, self.wversion = storage.step, storage.weight._version

    def value(self, i: int) -> torch.Tensor:
        """Request ``i``'s output."""
        (a, b), shape = self.spans[i], self.shapes[i]
        if self.out._version == self.version:
            return _rows(self.out)[:, a:b].clone().view(shape)
        st = self.storage
        if (  # (a parameter server's pulled rows are not kept: never looked up again)
            st is not None
            and st.step == self.step
            and st.weight._version == self.wversion
            and not st.keyed
            and not st.remote
        ):
            ids = self.ids[:, self.column[i]].contiguous()
            with torch.set_grad_enabled(self.grad):
                return cpu_fused.pooled_lookup(st, ids, _ones(ids), None, True).view(shape)
        raise HybridEmbedError(
            "an embedding output was read after the torch.cat that joined it (made by the lookup itself) was "
            "changed in place and its rows cannot be looked up again here: they are gone. Read it before changing "
            "the joined tensor, or convert the model with he.convert(model, grouped=False)"
        )
