"""Lookups inside ``torch.compile``: a path with no host sync and no data-dependent size, so
the forward of an :class:`~hybridembed.EmbeddingCollection` (and of a converted model's layers)
compiles with ``fullgraph=True``, in training as in eval.

The eager path validates ids on the host (one sync, a :class:`~hybridembed.InvalidInputError`
naming the feature and position), drops padding (sizes that depend on the data) and hands the
backward's gradient to the storage through an autograd function. Under compilation:

- padding stays in place, masked: pad positions read row 0 with multiplier 0, so every size is
  the input's; the combiners' scales (:func:`~hybridembed.kernels.bag_scale`) count only the
  kept ids, as the eager path does;
- validation is ``torch._assert_async`` on the device (no sync): an id out of range fails the
  compiled call with a RuntimeError naming the feature, before any row changes (rows change at
  the optimizer step, outside the graph);
- the pooled lookup is the custom op ``hybridembed::pooled`` (one ``embedding_bag``), opaque to
  the compiler; its backward is the custom op ``hybridembed::keep_grad``, which drops the pad
  positions and gives the bags' gradient to the storage (``defer_grad``), exactly what the eager
  backward gives it. The optimizer step (eager) then applies it: fused where the storage's
  kernels fuse, as in eager mode. Results and updates equal the eager path's.

Dynamic tables (ids resolved by probing and inserting into a hash table) are not on this path:
under compilation their lookups raise a :class:`~hybridembed.ConfigError` saying so.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..kernels import bag_scale

__all__ = ["compiling", "feature_part", "pooled", "pooled_rows", "storage_key"]

_STORAGES: dict[int, weakref.ref] = {}  # key -> the storage whose rows a compiled lookup read


def compiling() -> bool:
    """Whether this code is being traced by ``torch.compile`` / ``torch.export``."""
    return torch.compiler.is_compiling()


def storage_key(storage) -> int:
    """The int that names ``storage`` to the custom ops (ops take tensors and numbers only)."""
    key = id(storage)
    if key not in _STORAGES or _STORAGES[key]() is not storage:
        _STORAGES[key] = weakref.ref(storage)
    return key


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
    storage = _STORAGES[key]()
    if storage is None:  # (the model was dropped between forward and backward)
        return zero
    lengths = offsets[1:] - offsets[:-1]
    if not bool(keep.all()):
        bag = torch.repeat_interleave(
            torch.arange(lengths.numel(), device=ids.device), lengths, output_size=ids.numel()
        )
        lengths = torch.bincount(bag[keep], minlength=lengths.numel())
        ids, psw = ids[keep], psw[keep]
    kept = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=ids.device)
    torch.cumsum(lengths, 0, out=kept[1:])
    storage.defer_grad(ids, grad.contiguous(), kept, psw, False)
    return zero


@_keep_grad.register_fake
def _(grad, ids, offsets, psw, keep, key):
    return torch.empty((), device="cpu")


def _setup(ctx, inputs, output):
    weight, ids, offsets, psw, keep, sink, key = inputs
    ctx.save_for_backward(ids, offsets, psw, keep)
    ctx.key = key


def _backward(ctx, grad):
    ids, offsets, psw, keep = ctx.saved_tensors
    return None, None, None, None, None, _keep_grad(grad, ids, offsets, psw, keep, ctx.key), None


_pooled.register_autograd(_backward, setup_context=_setup)


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
    if table.dynamic is not None:
        raise ConfigError(
            f"feature {feature!r}: table {table.name!r} is dynamic, and dynamic tables' lookups (hash probes and "
            "inserts) do not run inside torch.compile yet; compile the dense part of the model, or look the "
            "dynamic tables up outside the compiled function"
        )
    n = table.num_embeddings
    ok = ((ids >= 0) & (ids < n)) | ~keep
    torch._assert_async(ok.all(), f"feature {feature!r}: an id is out of range [0, {n}) (or a negative id)")
    cdt = table.compute_dtype
    w = keep.to(cdt) if weights is None else torch.where(keep, weights.to(cdt), 0)
    psw = bag_scale(combiner, offsets, w, ids.numel(), cdt)  # (N,): the combiner's scale, pads 0
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
) -> torch.Tensor:
    """One feature's compiled lookup (:func:`feature_part`, then :func:`pooled`): (S, D) in the
    table's compute dtype."""
    slots, psw = feature_part(feature, table, row_offset, ids, offsets, keep, weights, combiner)
    return pooled(storage, slots, offsets, psw, keep, table.compute_dtype)
