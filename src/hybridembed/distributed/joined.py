"""A sharded collection's joined lookups: a converted model's ``torch.cat`` of its embedding
outputs made by the kernel call (:mod:`hybridembed.modules.joined`) when every table it reads is
replicated (data-parallel): the rows are this rank's own, so the replicas' collection makes the
joined tensor while the step's header crosses, as it makes their lookups (``runtime._run``).
Any other cat (a sharded table's rows come from their owners) takes the usual path."""

from __future__ import annotations

from typing import Any

from ..input import Jagged
from ..modules import joined


class ShardedJoined:
    """The :class:`~hybridembed.distributed.ShardedCollection` side of a joined lookup."""

    def _lookup_joined(self, requests, outs, pieces: list[Any], train: bool, others=()) -> tuple | None:
        """``torch.cat`` of queued lookups of replicated tables and 2-D tensors, made by one kernel
        call of the replicas' collection, or None (nothing exchanged, nothing looked up)."""
        if self._ahead is not None or not all(self._routes[self.features[f]].replicated for f, _ in requests):
            return None  # (a prefetched step's lookups come from its exchange)
        rep = self.replicated
        if not all(self._trusted(j) and j.weights is None for _, j in requests):
            return None
        # (one id a bag: the same ids with the replicas' own offsets, which it takes on trust as these)
        mine = [(f, Jagged(j.values, rep._one_per_bag(j.values.shape[0], j.values.device))) for f, j in requests]
        ready = joined.prepare(rep, mine, outs, pieces, others)
        if ready is None:
            return None
        try:  # (a refusal here reaches every rank: see step_failed)
            reqs = self._many_requests(requests, checked=True)
        except Exception as e:
            self.step_failed(e)
            raise
        made: list = []
        self._send_ids(reqs, self._main, meanwhile=lambda tabs: made.append(ready.run(train)))
        if not made:  # pragma: no cover - the header raises on every rank when one failed
            raise RuntimeError("a joined lookup of replicated tables was not made")
        return made[0]


__all__ = ["ShardedJoined"]
