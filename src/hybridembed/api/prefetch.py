"""``he.prefetch(model, {layer: next input})``: the next step's lookups of a converted or
distributed model started now, while this step computes (a training pipeline's first stage).

    for batch, following in zip(batches, [*batches[1:], None]):
        loss = loss_fn(model(batch), batch)
        if following is not None:
            he.prefetch(model, {f"embeddings.{i}": ids for i, ids in enumerate(following.sparse)})
        opt.zero_grad(); loss.backward(); opt.step()

Each layer named is called on its input with its lookup recorded, not run (the layer's own
checks and padding apply); each collection then prefetches what its layers recorded: a sharded
one sends the ids to their owners (:meth:`ShardedCollection.prefetch_many`: every rank calls
``he.prefetch`` at the same step, and the next forward must make those lookups), a parameter
server's trainer pulls their rows (name every layer of its tables), a tiered table reads them
from disk, a table in memory has nothing to do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from ..distributed.shard import unwrap
from ..errors import ConfigError
from ..modules.converted import _TableLayer
from ..storage.tiered import prefetch_rows

__all__ = ["prefetch"]


def prefetch(model: nn.Module, inputs: Mapping[str, Any]) -> None:
    """Starts the lookups the next forward of ``model`` (converted by ``he.convert`` or
    ``he.distribute``) will make: ``inputs`` maps each embedding layer's path in the model (as
    ``model.named_modules()`` names it, without DDP's ``module.``) to the input that layer gets
    next: its ids, or a tuple of its arguments (``(input, offsets, per_sample_weights)`` for an
    ``nn.EmbeddingBag``). See the module docstring."""
    if not isinstance(inputs, Mapping):
        raise ConfigError(f"inputs must map layer paths to their next inputs, got {type(inputs).__name__}")
    inner = unwrap(model)
    per_collection: dict[int, tuple[Any, list]] = {}
    for path, x in inputs.items():
        try:
            layer = inner.get_submodule(path)
        except AttributeError:
            raise ConfigError(f"prefetch: the model has no layer {path!r}") from None
        if not isinstance(layer, _TableLayer):
            raise ConfigError(
                f"prefetch: {path!r} is a {type(layer).__name__}, not a converted embedding layer "
                "(he.convert or he.distribute makes them)"
            )
        per_collection.setdefault(id(layer.collection), (layer.collection, []))[1].append((path, layer, x))
    for ec, layers in per_collection.values():
        _prefetch_collection(ec, layers)


def _prefetch_collection(ec, layers: list) -> None:
    queue = ec.lookup_queue
    if queue is None:
        raise ConfigError(f"prefetch: {layers[0][0]!r} was converted with grouped=False; convert with grouped=True")
    requests: list = []
    try:
        for _, layer, x in layers:
            requests.extend(queue.capture(lambda layer=layer, x=x: layer(*x) if isinstance(x, tuple) else layer(x)))
    except Exception as e:
        if hasattr(ec, "prefetch_failed"):  # (a sharded collection: the other ranks wait for this one's ids)
            ec.prefetch_failed(e)
        raise
    if hasattr(ec, "prefetch_many"):
        ec.prefetch_many(requests)
    elif getattr(ec, "sharded", False):  # (a parameter server's trainer: every feature named)
        ec.prefetch(dict(requests))
    else:  # (one process: its tiered tables read the rows; others have nothing to do)
        prefetch_rows(ec._features.values(), ec.storages, dict(requests))
