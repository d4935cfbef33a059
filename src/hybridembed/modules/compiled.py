"""Lookups inside ``torch.compile``: a path with no host sync and no data-dependent size, so
the forward of an :class:`~hybridembed.EmbeddingCollection` (and of a converted model's layers)
compiles with ``fullgraph=True``, in training as in eval.

The eager path validates ids on the host (one sync, a :class:`~hybridembed.InvalidInputError`
naming the feature and position), drops padding (sizes that depend on the data) and hands the
backward's gradient to the storage through an autograd function. Under compilation:

- padding stays in place, masked: pad positions read row 0 with multiplier 0, so every size is
  the input's; the combiners' scales (:func:`~hybridembed.kernels.bag_scale`) count only the
  kept ids, as the eager path does;
- validation is ``torch._assert_async`` on the device (no sync): on the CPU an id out of range
  fails the compiled call with a RuntimeError naming the feature, before any dense row changes
  (rows change at the optimizer step, outside the graph); on CUDA it is a device-side assert
  (reported later, without the message, and fatal to the CUDA context): validate inputs eagerly
  (``Jagged.validate``) where that matters;
- the pooled lookup is the custom op ``hybridembed::pooled`` (one ``embedding_bag``), opaque to
  the compiler; its backward is the custom op ``hybridembed::keep_grad``, which drops the pad
  positions and gives the bags' gradient to the storage (``defer_grad``), exactly what the eager
  backward gives it. The optimizer step (eager) then applies it: fused where the storage's
  kernels fuse, as in eager mode. Results and updates equal the eager path's.

Dynamic tables resolve ids to rows by probing and inserting into a hash table, data-dependent
work the compiler cannot trace: their lookup is the custom op ``hybridembed::dynamic_pooled``,
which resolves the kept ids (rows made on first sight in training, admission and eviction as in
eager mode) and pools them, opaque to the compiler; its backward is ``keep_grad`` as above.
One difference from eager mode: each dynamic feature resolves its ids on its own (eager mode
resolves a group's features together), so when several features share a dynamic storage the
order in which their new ids are admitted, and the LRU clock, differ; per-id weights that
require grad are refused (their gradient is not computed here).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..input import Jagged, bag_index, offsets_from_lengths
from ..kernels import bag_scale
from ..storage.base import storage_of_key

__all__ = ["compiled_forward", "compiling", "dynamic_rows", "feature_part", "pooled", "pooled_rows", "storage_key"]


def compiling() -> bool:
    """Whether this code is being traced by ``torch.compile`` / ``torch.export``."""
    return torch.compiler.is_compiling()


def storage_key(storage) -> int:
    """The int that names ``storage`` to the custom ops (ops take tensors and numbers only)."""
    return id(storage)  # (every storage is registered when made, copied or unpickled: storage.base)


@torch.library.custom_op("hybridembed::pooled", mutates_args=())
def _pooled(
    weight: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, psw: torch.Tensor, keep: torch.Tensor,
    sink: torch.Tensor, key: int,
) -> torch.Tensor:  # fmt: skip
    """(R, D) rows, (N,) slots, (S+1,) bag offsets, (N,) multipliers -> (S, D) weighted sums."""
    return F.embedding_bag(ids, weight, offsets, mode="sum", per_sample_weights=psw, include_last_offset=True)


@_pooled.register_fake
def _(weight, ids, offsets, psw, keep, sink, key):
    return weight.new_empty(offsets.shape[0] - 1, weight.shape[1])


@torch.library.custom_op("hybridembed::keep_grad", mutates_args=())
def _keep_grad(
    grad: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, psw: torch.Tensor, keep: torch.Tensor, key: int
) -> torch.Tensor:
    """The bags' gradient (S, D) -> the storage's kept gradient, pad positions dropped (runs eagerly,
    inside the compiled backward). Returns a 0-d zero on the host: the gradient of the storage's
    ``_compile_sink``, which makes the compiler keep this call (its real effect is the storage's)."""
    zero = torch.zeros(())
    storage = storage_of_key(key)
    if storage is None:  # (the model was dropped between forward and backward)
        return zero
    kept = offsets
    if not bool(keep.all()):  # (pads leave their bags)
        lengths = torch.bincount(bag_index(offsets, ids.numel())[keep], minlength=offsets.numel() - 1)
        ids, psw, kept = ids[keep], psw[keep], offsets_from_lengths(lengths)
    # (copies: the compiled backward may reuse its buffers once this op returns; the step reads these later)
    storage.defer_grad(ids.clone(), grad.clone(memory_format=torch.contiguous_format), kept.clone(), psw.clone(), False)
    return zero


@_keep_grad.register_fake
def _(grad, ids, offsets, psw, keep, key):
    return torch.empty((), device="cpu")  # (the sink's: a float32 host scalar)


def _setup(ctx, inputs, output):
    weight, ids, offsets, psw, keep, sink, key = inputs
    ctx.save_for_backward(ids, offsets, psw, keep)
    ctx.key = key


def _backward(ctx, grad):
    ids, offsets, psw, keep = ctx.saved_tensors
    return None, None, None, None, None, _keep_grad(grad, ids, offsets, psw, keep, ctx.key), None


_pooled.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("hybridembed::dynamic_pooled", mutates_args=())
def _dynamic_pooled(
    sink: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, psw: torch.Tensor, keep: torch.Tensor,
    key: int, table_index: int, dim: int, train: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A dynamic table's lookup, opaque to the compiler: the kept ids (N,) resolved to row slots by
    the hash table (rows made on first sight while training, admission and eviction as in eager
    mode), then one ``embedding_bag`` -> ((S, D) sums, (N,) slots, pads 0)."""
    storage = storage_of_key(key)
    kept = ids[keep]
    plan = storage.resolve(kept, [table_index], [kept.numel()], train)
    got, _ = plan.commit()
    slots = torch.zeros_like(ids)
    slots[keep] = got.to(torch.int64)
    cdt = psw.dtype
    weight = storage.weight.detach()
    weight = weight if weight.dtype == cdt else weight.to(cdt)
    rows = F.embedding_bag(slots, weight, offsets, mode="sum", per_sample_weights=psw, include_last_offset=True)
    return rows, slots


@_dynamic_pooled.register_fake
def _(sink, ids, offsets, psw, keep, key, table_index, dim, train):
    return psw.new_empty(offsets.shape[0] - 1, dim), torch.empty_like(ids)


def _dynamic_setup(ctx, inputs, output):
    sink, ids, offsets, psw, keep, key, table_index, dim, train = inputs
    ctx.save_for_backward(output[1], offsets, psw, keep)
    ctx.key = key


def _dynamic_backward(ctx, grad, _slots_grad):
    slots, offsets, psw, keep = ctx.saved_tensors
    return _keep_grad(grad, slots, offsets, psw, keep, ctx.key), None, None, None, None, None, None, None, None


_dynamic_pooled.register_autograd(_dynamic_backward, setup_context=_dynamic_setup)


def dynamic_rows(
    storage, table, table_index: int, ids: torch.Tensor, offsets: torch.Tensor, psw: torch.Tensor, keep: torch.Tensor,
    train: bool,
) -> torch.Tensor:  # fmt: skip
    """A dynamic table's compiled lookup (:func:`_dynamic_pooled`): (S, D) in its compute dtype."""
    sink = (
        storage._compile_sink
        if torch.is_grad_enabled() and storage.weight.requires_grad
        else storage._compile_sink.detach()
    )
    rows, _ = _dynamic_pooled(
        sink, ids, offsets, psw, keep, storage_key(storage), table_index, table.embedding_dim, train
    )
    return rows


def feature_part(
    feature: str,
    table,
    row_offset: int,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    keep: torch.Tensor,
    weights: torch.Tensor | None,
    combiner: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One feature's part of a compiled lookup: bags ``offsets`` (S+1,) of ``ids`` (N,) of
    ``table``, ``keep`` (N,) False at pads -> (its row slots ``row_offset + id`` (N,), pads 0;
    its per-id multipliers (N,): the weights and ``combiner``'s scale, pads 0). Checks the ids on
    the device (``torch._assert_async``: no sync)."""
    cdt = table.compute_dtype
    if weights is not None and weights.requires_grad:
        raise ConfigError(  # (not InvalidInputError: torch.compile cannot build an exception with its own __init__)
            f"feature {feature!r}: per-id weights that require grad are not trained inside torch.compile yet (their "
            "gradient is not computed there); detach them, or run this lookup eagerly"
        )
    if table.dynamic is None:  # (a dynamic table takes any int64 id)
        n = table.num_embeddings
        ok = ((ids >= 0) & (ids < n)) | ~keep
        torch._assert_async(ok.all(), f"feature {feature!r}: an id is out of range [0, {n}) (or a negative id)")
    w = keep.to(cdt) if weights is None else torch.where(keep, weights.to(cdt), 0)
    psw = bag_scale(combiner, offsets, w, ids.numel(), cdt)  # (N,): the combiner's scale, pads 0
    if table.dynamic is not None:  # (ids: resolved to slots inside the lookup op, by the hash table)
        return ids.to(torch.int64), (w if psw is None else psw)
    return torch.where(keep, ids.to(torch.int64) + row_offset, 0), (w if psw is None else psw)


def pooled(
    storage, slots: torch.Tensor, offsets: torch.Tensor, psw: torch.Tensor, keep: torch.Tensor, cdt: torch.dtype
) -> torch.Tensor:
    """Bags ``offsets`` (S+1,) of row ``slots`` (N,) of ``storage``, weighted by ``psw`` -> (S, D)
    sums in ``cdt``; the backward keeps the gradient for the storage (pads dropped)."""
    weight = storage.weight if storage.weight.dtype == cdt else storage.weight.to(cdt)
    if torch.is_grad_enabled() and storage.weight.requires_grad:
        return _pooled(weight, slots, offsets, psw, keep, storage._compile_sink, storage_key(storage))
    return F.embedding_bag(
        slots, weight.detach(), offsets, mode="sum", per_sample_weights=psw, include_last_offset=True
    )


def pooled_rows(
    storage,
    feature: str,
    table,
    row_offset: int,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    keep: torch.Tensor,
    weights: torch.Tensor | None,
    combiner: str,
    train: bool = True,
) -> torch.Tensor:
    """One feature's compiled lookup (:func:`feature_part`, then :func:`pooled`): (S, D) in the
    table's compute dtype."""
    slots, psw = feature_part(feature, table, row_offset, ids, offsets, keep, weights, combiner)
    if table.dynamic is not None:
        index = next(i for i, t in enumerate(storage.tables) if t.name == table.name)
        return dynamic_rows(storage, table, index, slots, offsets, psw, keep, train)
    return pooled(storage, slots, offsets, psw, keep, table.compute_dtype)


def compiled_forward(ec, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``ec``'s forward inside ``torch.compile`` (see the module docstring): per feature, its ids
    with padding masked in place, then one lookup per group of tables, as in eager mode.
    ``(B,)``/``(B, H)`` id tensors and :class:`Jagged` inputs; a sequence feature's output is
    padded ``(B, H, D)`` (zero rows at pads) whatever ``sequence_output`` says."""
    if any(getattr(st, "tiered", False) for st in ec.storages):
        raise ConfigError("tiered tables do not run inside torch.compile yet (their rows move between disk and cache)")
    if any(st.remote for st in ec.storages):
        raise ConfigError(
            "a parameter-server trainer's tables do not run inside torch.compile (their rows are pulled from the "
            "servers); compile the dense part of the model"
        )
    if not isinstance(inputs, Mapping) or set(inputs) != set(ec._features):
        raise ConfigError(f"inputs must be a mapping with exactly the features {', '.join(ec._features)}")
    parts: dict[int, list] = {}  # group -> [(feature, slots, offsets, psw, keep, sequence shape)]
    out: dict[str, torch.Tensor] = {}
    for f, feat in ec._features.items():
        x = inputs[f]
        seq = feat.table.combiner == "none"
        if isinstance(x, Jagged) and not seq:  # (every value an id, as in eager mode: no padding in a Jagged)
            ids, offsets, weights = x.values, x.offsets.to(torch.int64), x.weights
            shape = None
            keep = torch.ones_like(ids, dtype=torch.bool)
        elif isinstance(x, torch.Tensor) and x.dim() in (1, 2) and not x.is_floating_point():
            grid = x if x.dim() == 2 else x.unsqueeze(1)  # (B, H) (not reshape(B, -1): B may be 0)
            b, h = grid.shape
            ids, weights, shape = grid.reshape(-1), None, (b, h) if seq else None
            step = 1 if seq else h  # (a sequence: bags of one id)
            offsets = torch.arange(0, ids.numel() + 1, step, device=ids.device)
            keep = ids != ec.pad
        else:
            raise ConfigError(
                f"feature {f!r}: under torch.compile give a (B,) or (B, H) integer id tensor"
                + ("" if seq else " or a he.Jagged")
            )
        combiner = "sum" if seq else feat.table.combiner
        slots, psw = feature_part(f, feat.table, feat.row_offset, ids, offsets, keep, weights, combiner)
        if feat.dynamic:  # (its own lookup op: the hash table resolves the ids inside it)
            st = ec.storages[feat.group]
            out[f] = _shaped(
                dynamic_rows(st, feat.table, feat.table_index, slots, offsets, psw, keep, ec.training), keep, shape
            )
            continue
        parts.setdefault(feat.group, []).append((f, slots, offsets, psw, keep, shape))
    for group, items in parts.items():  # one call per group: the pieces joined
        storage = ec.storages[group]
        cdt = ec._features[items[0][0]].table.compute_dtype
        if len(items) == 1:
            _, slots, offsets, psw, keep, _ = items[0]
        else:
            total, pieces = 0, []
            for _, sl, off, _, _, _ in items:
                pieces.append(off[:-1] + total)
                total += sl.numel()
            pieces.append(torch.full((1,), total, dtype=torch.int64, device=items[0][1].device))
            offsets = torch.cat(pieces)
            slots, psw, keep = (torch.cat([it[k] for it in items]) for k in (1, 3, 4))
        rows = pooled(storage, slots, offsets, psw, keep, cdt)  # (S, D)
        for (f, _, _, _, kp, shape), part in zip(items, rows.split([it[2].numel() - 1 for it in items])):
            out[f] = _shaped(part, kp, shape)
    return {f: out[f] for f in ec._features}


def _shaped(rows: torch.Tensor, keep: torch.Tensor, shape: tuple[int, int] | None) -> torch.Tensor:
    """A pooled feature's (B, D) rows as they are; a sequence's (B*H, D) as (B, H, D), pads zero."""
    return rows if shape is None else (rows * keep.unsqueeze(1).to(rows.dtype)).reshape(*shape, rows.shape[-1])
