"""The layers :func:`hybridembed.convert` puts in a plain model's place, and their collection.

``HybridEmbedding`` / ``HybridEmbeddingBag`` behave as the ``nn.Embedding`` / ``nn.EmbeddingBag``
they replace (same call, same output) and read one table of the model's
:class:`ConvertedCollection` (registered on the model as ``model.hybridembed``), whose lookups a
forward queues and runs together (:mod:`hybridembed.modules.grouped`). They live here, beside the
collection, so that the layers below the verbs (a sharded job's swap of collections, export,
checkpoints) reach them without the verb.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, InvalidInputError
from ..input import Jagged, bag_index, offsets_from_lengths
from ..input.jagged import _INT_DTYPES
from ..storage import serial
from ..utils import get_logger
from .collection import EmbeddingCollection
from .compiled import compiling, pooled_rows
from .grouped import LookupQueue

__all__ = ["ConvertedCollection", "HybridEmbedding", "HybridEmbeddingBag", "COLLECTION_ATTR"]

log = get_logger(__name__)

COLLECTION_ATTR = "hybridembed"  # where convert registers the collection on the model


class ConvertedCollection(EmbeddingCollection):
    """The tables of a converted model (an :class:`~hybridembed.EmbeddingCollection`).

    The converted layers write its tables' ``state_dict`` entries under their own paths
    (``<layer path>.weight``), so the collection itself writes none and duplicates nothing.
    """

    lookup_queue: LookupQueue | None = None  # set by convert(grouped=True)
    _warned_unconsumed = False

    def lookup(self, feature: str, ids: Any) -> torch.Tensor | Jagged:
        self._check_consumed()
        return super().lookup(feature, ids)

    def lookup_rows(self, feature: str, ids: torch.Tensor) -> torch.Tensor:
        self._check_consumed()
        return super().lookup_rows(feature, ids)

    def _lookup_many(self, requests, train: bool | None, checked: bool) -> list[torch.Tensor | Jagged]:
        self._check_consumed()
        return super()._lookup_many(requests, train, checked)

    def _lookup_joined(self, requests, outs, pieces, train: bool, others=()) -> tuple | None:
        self._check_consumed()
        return super()._lookup_joined(requests, outs, pieces, train, others)

    def _check_consumed(self) -> None:
        """Warns once when a table's gradient was left by the last step with no optimizer to take
        it: the model was converted after its optimizer was built, and he.wrap_optimizer was not called."""
        if self._warned_unconsumed or not self.training:
            return
        idle = [t.name for s in self.storages if s.optimizer is None and s.weight.grad is not None for t in s.tables]
        if idle:
            self._warned_unconsumed = True
            shown = ", ".join(map(repr, idle[:3])) + (f" and {len(idle) - 3} more" if len(idle) > 3 else "")
            warnings.warn(
                f"tables {shown} have gradients that no optimizer step consumed: they are not training. Give them "
                "sparse updates with opt = he.wrap_optimizer(opt, model) after he.convert (a torch optimizer "
                "built before convert holds the replaced weights)",
                stacklevel=4,
            )

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        return

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        if strict:
            for key in state_dict:
                if key.startswith(prefix) and key[len(prefix) :].split(".", 1)[0] not in self._modules:
                    unexpected.append(key)


class _QueueHook:
    """Forward pre-hook and hook of a converted model: its layers' lookups are deferred while its
    forward runs; what is still queued runs when it returns."""

    def __init__(self, path: str, begin: bool):
        self.path = path  # the collection's module path (the hook survives deepcopy and pickling)
        self.begin = begin

    def __call__(self, module: nn.Module, args: Any, output: Any = None) -> None:
        if compiling():  # (under torch.compile each layer looks up its rows itself: see _TableLayer._compiled)
            return
        queue = getattr(module.get_submodule(self.path), "lookup_queue", None)
        if queue is None:
            return
        if self.begin:
            queue.enter(sys._getframe(1))  # (the module call running the forward, on the stack while it runs)
            queue.handling.append(sys.exc_info()[1])  # (an exception being handled around the call, if any)
        else:
            # None: the forward raised, or returned None (a forward that keeps its outputs on the model):
            # it raised when an exception other than the one handled around the call is in flight
            outer = queue.handling.pop() if queue.handling else None
            ok = output is not None or sys.exc_info()[1] is outer
            queue.exit(ok=ok, error=None if ok else sys.exc_info()[1])


class _TableLayer(nn.Module):
    """What both converted layers share: the table they read and their ``state_dict``."""

    def __init__(self, collection: EmbeddingCollection, table: str, layer: nn.Module):
        super().__init__()
        self.__dict__["_collection"] = collection  # not a submodule: the model owns it once
        self.table = table
        cfg = collection.tables[table]
        self.dynamic = cfg.dynamic is not None
        self.num_embeddings = None if self.dynamic else layer.num_embeddings
        self.embedding_dim = layer.embedding_dim
        self.padding_idx = layer.padding_idx
        self.sparse = layer.sparse  # kept for reference; converted tables always get sparse gradients
        self.max_norm = None
        self.norm_type = layer.norm_type
        self.scale_grad_by_freq = False
        self.output_dtype = layer.weight.dtype

    @property
    def collection(self) -> EmbeddingCollection:
        """The collection holding this layer's table."""
        return self._collection

    def __getattr__(self, name: str) -> Any:
        if name == "weight":  # a view of the table, as nn.Embedding.weight (writes under no_grad go through)
            if self.__dict__.get("dynamic"):
                raise AttributeError(
                    f"table {self.table!r} is dynamic and has no fixed weight matrix; read its rows with "
                    f"model.{COLLECTION_ATTR}.dynamic_rows({self.table!r})"
                )
            if getattr(self._collection, "sharded", False):
                raise AttributeError(
                    f"table {self.table!r} is sharded over the job's ranks and has no weight matrix here; "
                    f"gather it with model.{COLLECTION_ATTR}.gather_table({self.table!r}) (a collective)"
                )
            storage = self._collection.storage_of(self.table)
            if getattr(storage, "tiered", False):
                raise AttributeError(
                    f"table {self.table!r} is tiered (its rows on disk); read them with model.{COLLECTION_ATTR}.weight({self.table!r})"
                )
            start = storage.row_offset[self.table]
            # a view of the rows Parameter: a loss term over it (an L2 penalty) reaches the table as a
            # dense gradient, which the optimizer refuses with the fix, instead of being dropped silently
            return storage.weight[start : start + self.num_embeddings]
        return super().__getattr__(name)

    def _lookup(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        shape: tuple[int, ...],
        post: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Rows of bags ``offsets`` (B+1,) of ``ids`` (N,) -> ``post((B, D) rows)`` of ``shape``.

        Queued on the collection's :class:`~hybridembed.modules.grouped.LookupQueue` when the
        model was converted with ``grouped=True`` (one kernel call per group at first use),
        else looked up now."""
        ec, dtype = self._collection, self.output_dtype

        def finish(out: torch.Tensor) -> torch.Tensor:  # (B, D) -> the layer's output
            out = out if out.dtype == dtype else out.to(dtype)
            return out if post is None else post(out)

        queue = ec.lookup_queue
        if queue is not None and queue.active:
            # (no post: the queue's own cast, so a torch.cat of the outputs may be made by the lookup: .joined)
            return queue.request(
                self.table, Jagged(ids, offsets, weights), shape, dtype, None if post is None else finish
            )
        return finish(ec.lookup(self.table, Jagged(ids, offsets, weights)))

    def _rows(self, ids: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """Rows of ``ids`` (N,), one per bag, in the layer's dtype, as ``shape`` (*, D): queued in
        a grouped forward, else one short lookup (:meth:`EmbeddingCollection.lookup_rows`)."""
        ec = self._collection
        queue = ec.lookup_queue
        if queue is not None and queue.active:
            return queue.request_rows(self.table, ids, shape, self.output_dtype)
        if self.dynamic:
            rows = ec.lookup(self.table, Jagged(ids, ec._one_per_bag(ids.shape[0], ids.device)))
        else:
            rows = ec.lookup_rows(self.table, ids)
        return rows.to(self.output_dtype).reshape(shape)

    def _compiled(
        self, ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None, keep: torch.Tensor
    ) -> torch.Tensor:
        """Inside ``torch.compile`` (:mod:`.compiled`): bags ``offsets`` (B+1,) of ``ids`` (N,),
        ``keep`` False at padding -> (B, D) sums in the layer's dtype, no sync, no queue."""
        ec = self._collection
        if getattr(ec, "sharded", False):
            raise ConfigError(
                f"table {self.table!r} is sharded over a job (or on parameter servers), and its exchange does not "
                "run inside torch.compile yet; compile the dense part of the model"
            )
        storage = ec.storage_of(self.table)
        rows = pooled_rows(
            storage, self.table, ec.tables[self.table], storage.row_offset.get(self.table, 0), ids, offsets, keep,
            weights, "sum", ec.training,
        )  # fmt: skip
        return rows.to(self.output_dtype)

    def _check(self, j: Jagged) -> None:
        j.check_structure(self.table)
        if not bool(j.ok(self.num_embeddings, allow_negative=self.dynamic)):
            j.raise_first_error(self.table, self.num_embeddings, allow_negative=self.dynamic)

    # --- state_dict: the table's entries under this layer's path (storage.serial) -------------
    # (a sharded table's shards are written by its ShardedCollection, under its own path)
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        remote = getattr(self._collection, "remote_entry", None)
        if remote is not None:  # (rows on parameter servers: pulled whole, under this layer's key)
            for k, v in remote(self.table).items():
                destination[prefix + k] = v
            return
        if getattr(self._collection, "sharded", False):  # (sharded over a job: the whole table's key, sharded values)
            for k, v in self._collection.table_entry(self.table).items():
                destination[prefix + k] = v
            return
        for k, v in serial.table_entry(self._collection.storage_of(self.table), self.table, keep_vars).items():
            destination[prefix + k] = v

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        if getattr(self._collection, "remote_entry", None) is not None and any(
            k.startswith(prefix) for k in state_dict
        ):
            errors.append(
                f"{prefix}weight: table {self.table!r} lives on the parameter servers and is not loaded from a "
                "state_dict; load it with he.load (a checkpoint, at any world size)"
            )
            return
        if getattr(self._collection, "sharded", False):
            entry = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
            if not entry:
                missing.append(prefix + "weight")
                return
            self._collection.load_table_entry(self.table, entry, prefix, errors)
            return
        storage = self._collection.storage_of(self.table)
        mine = {
            k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix) and "." not in k[len(prefix) :]
        }
        entry = mine
        if self.dynamic and set(mine) == {"weight"}:  # a plain (N, D) matrix from the unconverted model: ids 0..N-1
            w = mine["weight"]
            if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[1] != self.embedding_dim:
                errors.append(f"size mismatch for {prefix}weight: expected (N, {self.embedding_dim}) rows")
                return
            entry = serial.dense_as_dynamic(storage, w)
        lacking, problems = serial.check_entry(storage, self.table, entry, prefix)
        missing.extend(lacking)
        errors.extend(problems)
        if not lacking and not problems:
            serial.load_entry(storage, self.table, entry)
        if strict and not self.dynamic:  # a dynamic table's entry is whatever its storage saves
            unexpected.extend(prefix + k for k in mine if k != "weight")

    def extra_repr(self) -> str:
        size = "dynamic" if self.dynamic else str(self.num_embeddings)
        s = f"{size}, {self.embedding_dim}, table={self.table!r}"
        return s + ("" if self.padding_idx is None else f", padding_idx={self.padding_idx}")


class HybridEmbedding(_TableLayer):
    """A converted ``nn.Embedding``: ``forward(ids (*)) -> (*, D)``, any shape of int ids.

    Attributes as ``nn.Embedding`` (``num_embeddings`` is None when dynamic, ``weight`` a
    view of the table's rows) plus ``table`` and ``collection``.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not isinstance(input, torch.Tensor):
            raise InvalidInputError(
                f"table {self.table!r}: input must be a tensor of ids, got {type(input).__name__}", self.table
            )
        d = self.embedding_dim
        out_shape = (*input.shape, d)
        ids = input.reshape(-1)  # (N,)
        n, dev = ids.numel(), ids.device
        if compiling():
            keep = torch.ones_like(ids, dtype=torch.bool) if self.padding_idx is None else ids != self.padding_idx
            rows = self._compiled(ids, torch.arange(n + 1, device=dev), None, keep)  # (N, D)
            if self.padding_idx is not None:  # (nn.Embedding's padding row there, without gradient; zeros if dynamic)
                pad = (
                    rows.new_zeros(d)
                    if self.dynamic
                    else self._collection.weight(self.table)[self.padding_idx].detach().to(rows.dtype)
                )
                rows = torch.where(keep.unsqueeze(1), rows, pad)
            return rows.reshape(out_shape)
        keep = None if self.padding_idx is None else ids != self.padding_idx  # (N,)
        if keep is None or bool(keep.all()):  # (N, D): bags of one
            return self._rows(ids, out_shape)
        self._check(Jagged(ids, torch.tensor([0, n], device=dev)))
        kept = ids[keep]  # (K,)

        def fill(rows: torch.Tensor) -> torch.Tensor:  # (K, D) -> (*, D) with the padding row
            if self.dynamic:
                pad = rows.new_zeros(d)
            else:
                pad = self._collection.weight(self.table)[self.padding_idx].to(rows.dtype)  # (D,), no gradient
            return pad.expand(n, d).index_put((keep,), rows).reshape(out_shape)  # (N, D)

        return self._lookup(kept, torch.arange(kept.numel() + 1, device=dev), None, out_shape, fill)


class HybridEmbeddingBag(_TableLayer):
    """A converted ``nn.EmbeddingBag``: ``forward(input, offsets=None, per_sample_weights=None) -> (B, D)``.

    ``input`` is (B, L) ids with ``offsets=None``, or (N,) ids with (B,) offsets (B+1 with
    ``include_last_offset``); ``per_sample_weights`` has the shape of ``input`` (mode sum
    only, as torch). Entries equal to ``padding_idx`` leave their bag (and the mean's count).
    An empty bag pools to 0.
    """

    def __init__(self, collection: EmbeddingCollection, table: str, layer: nn.EmbeddingBag):
        super().__init__(collection, table, layer)
        self.mode = layer.mode
        self.include_last_offset = layer.include_last_offset

    def forward(
        self, input: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not isinstance(input, torch.Tensor):
            raise InvalidInputError(
                f"table {self.table!r}: input must be a tensor of ids, got {type(input).__name__}", self.table
            )
        psw = per_sample_weights
        if psw is not None and self.mode != "sum":
            raise InvalidInputError(
                f"table {self.table!r}: per_sample_weights are only supported for mode='sum' (as in torch), "
                f"this layer has mode={self.mode!r}",
                self.table,
            )
        if psw is not None and (not isinstance(psw, torch.Tensor) or psw.shape != input.shape):
            got = tuple(psw.shape) if isinstance(psw, torch.Tensor) else type(psw).__name__
            raise InvalidInputError(
                f"table {self.table!r}: per_sample_weights must have the shape of input {tuple(input.shape)}, got {got}",
                self.table,
            )
        dev = input.device
        if input.dim() == 2:
            if offsets is not None:
                raise InvalidInputError(f"table {self.table!r}: offsets must be None when input is 2-D (B, L)")
            b, length = input.shape
            ids = input.reshape(-1)  # (B*L,)
            if length == 1:  # (the collection's own one-id-per-bag offsets: known well formed, their checks skipped)
                offsets = self._collection._one_per_bag(b, dev)
            else:
                offsets = torch.arange(b + 1, device=dev) * length  # (B+1,)
            psw = None if psw is None else psw.reshape(-1)
        elif input.dim() == 1:
            if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1:
                raise InvalidInputError(
                    f"table {self.table!r}: 1-D input needs 1-D offsets (B,) giving where each bag starts"
                )
            ids = input
            if offsets.dtype not in _INT_DTYPES:  # (torch refuses them too; a cast would truncate 1.5 to 1)
                raise InvalidInputError(
                    f"table {self.table!r}: offsets must be integers, got dtype {offsets.dtype}", self.table
                )
            offsets = offsets.to(torch.int64)
            if not self.include_last_offset:
                offsets = torch.cat([offsets, torch.tensor([ids.numel()], dtype=torch.int64, device=offsets.device)])
        else:
            raise InvalidInputError(
                f"table {self.table!r}: input must be (B, L) or (N,) with offsets, got shape {tuple(input.shape)}"
            )
        if compiling():
            keep = torch.ones_like(ids, dtype=torch.bool) if self.padding_idx is None else ids != self.padding_idx
            pooled = self._compiled(ids, offsets, psw, keep)  # (B, D) sums over the kept ids
            if self.mode != "mean":
                return pooled
            bag = bag_index(offsets, ids.numel())
            counts = torch.zeros(offsets.numel() - 1, device=dev).index_add(0, bag, keep.float()).clamp_min(1)
            return pooled / counts.unsqueeze(1).to(pooled.dtype)
        if self.padding_idx is not None and not bool((ids != self.padding_idx).all()):
            ids, offsets, psw = self._drop_padding(ids, offsets, psw)
        b = offsets.numel() - 1
        if self.mode != "mean":
            return self._lookup(ids, offsets, psw, (b, self.embedding_dim))  # (B, D), summed
        counts = (offsets[1:] - offsets[:-1]).clamp_min(1).unsqueeze(1)  # (B, 1)

        def mean(pooled: torch.Tensor) -> torch.Tensor:  # sum, then divide, as torch: an empty bag stays 0
            return pooled / counts.to(pooled.dtype)

        return self._lookup(ids, offsets, psw, (b, self.embedding_dim), mean)

    def _drop_padding(self, ids: torch.Tensor, offsets: torch.Tensor, psw: torch.Tensor | None):
        """Entries equal to padding_idx leave their bag: (N,), (B+1,), (N,) -> (K,), (B+1,), (K,)."""
        self._check(Jagged(ids, offsets, psw))
        keep = ids != self.padding_idx  # (N,)
        b = offsets.numel() - 1
        kept = torch.bincount(bag_index(offsets, ids.numel())[keep], minlength=b)  # (B,)
        return ids[keep], offsets_from_lengths(kept), None if psw is None else psw[keep]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", mode={self.mode!r}"
