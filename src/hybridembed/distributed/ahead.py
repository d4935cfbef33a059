"""A sharded step's ids sent one step ahead: :class:`Pipelined`, a base of
:class:`~hybridembed.distributed.ShardedCollection` (the first stage of a training pipeline,
as TorchRec's ``TrainPipelineSparseDist`` runs it).

``ec.prefetch(next_inputs)`` runs the first half of the next forward's exchange now, in a
background thread on a process group of its own: the ids checked, routed to their owners, the
header and the ids (and per-id weights) sent. The caller goes on with this step (the dense
forward, backward, optimizer step); the next forward finds its ids already at their owners and
only looks them up and sends the rows back. Every rank prefetches at the same step (a
collective, as the forward is), and the next exchange's lookups must be the ones prefetched
(the same features and ids, in any order): a rank whose next lookups differ makes every rank
raise in that step, nothing looked up or changed. A prefetch whose input a rank refuses (an id
out of range, found in the thread) makes every rank raise in the next forward, as that forward
would have; an input that is not ids at all (a wrong type, shape or device) raises in
``prefetch`` too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..errors import HybridEmbedError
from ..input import Jagged
from . import health
from .exchange import Capacity

__all__ = ["Pipelined", "Sent", "Channel"]


@dataclass
class Channel:
    """A process group the exchange's header runs on, its count of headers (the key under which a
    rank tells the others why it failed: the same on every rank) and how many int64s ride after
    them (:class:`~hybridembed.distributed.exchange.Capacity`)."""

    group: Any
    count: int = 0
    cap: Capacity | None = None  # (made at the first exchange, for the group's size)

    def next_step(self) -> str:
        self.count += 1
        return f"step/{self.group.group_name}/{self.count}"


@dataclass
class Sent:
    """Phases 1 to 4 of an exchange done (the ids at their owners): what phases 5 to 8 need."""

    reqs: list  # [(feature, Jagged)]
    tabs: list  # their TableConfigs
    pairs: list  # [Pair]: (request, shard) of every lookup that crosses
    sends: list  # [Sends], one per pair
    back: dict  # per request, what its route needs to put its rows back
    pooled_here: dict  # dedup: per pair, what pools its distinct rows here
    step: str  # the header's key (the owners' lookup failures are told under it)
    by_rank: list = field(default_factory=list)  # per owner, the pairs it serves
    received: tuple = ()  # (sizes, ids and lengths, weights or None, fold) as the owners got them


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether ``b`` holds the values of ``a`` (a prefetch's own copy, or a read-only tensor the
    collection keeps: compared by identity), element by element."""
    if a is None or b is None:
        return a is b
    if a is b:
        return True
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    return bool(torch.equal(a, b))


def _copied(j: Jagged, kept: bool) -> Jagged:
    """``j``'s values and weights copied (what the thread sends and the next forward is compared
    with: a batch changed in place after ``prefetch`` does not change what was sent); its offsets
    too unless ``kept`` (the collection's own read-only ones, whose identity skips their checks)."""
    w = None if j.weights is None else j.weights.detach().clone()
    return Jagged(j.values.clone(), j.offsets if kept else j.offsets.clone(), w)


def _order(prefetched: list, reqs: list) -> list[int] | None:
    """For each request of ``reqs``, the index of the equal request in ``prefetched`` (each
    used once); None when they differ."""
    if len(prefetched) != len(reqs):
        return None
    free: dict[str, list[int]] = {}
    for i, (f, _) in enumerate(prefetched):
        free.setdefault(f, []).append(i)
    order = []
    for f, j in reqs:
        for k, i in enumerate(free.get(f, ())):
            p = prefetched[i][1]
            if _same(p.values, j.values) and _same(p.offsets, j.offsets) and _same(p.weights, j.weights):
                order.append(free[f].pop(k))
                break
        else:
            return None
    return order


class Ahead:
    """One exchange's first half, run by ``work()`` in a background thread."""

    def __init__(self, reqs: list, work: Callable[[], Sent], threaded: bool = True) -> None:
        self.reqs = reqs
        self._sent: Sent | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), daemon=True, name="hybridembed-ahead")
        if threaded:
            self._thread.start()
        else:  # (NCCL: collectives of two communicators issued from two threads may deadlock; here, now)
            self._run(work)

    def _run(self, work: Callable[[], Sent]) -> None:
        try:
            with torch.no_grad():  # (ids, lengths and detached weights only)
                self._sent = work()
        except BaseException as e:  # noqa: BLE001 - raised where the result is taken
            self._error = e

    def result(self) -> Sent:
        """The sent exchange (waits for the thread); what it raised is raised here."""
        if self._thread.ident is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._sent is not None
        return self._sent


class Pipelined:
    """The prefetch of a sharded collection. Reads the collection's group, ranks and features;
    the runtime's ``_send_ids`` (phases 1 to 4) and ``_fail_rows`` (phase 6 with a failure)."""

    _ahead: Ahead | None = None
    _ahead_channel: Channel | None = None

    def prefetch(self, inputs: Mapping[str, Any]) -> None:
        """Sends the ids of the next forward's lookups (``inputs``: as :meth:`forward` takes them,
        the next batch) to their owners now, in a background thread; the next forward, which must
        look up the same ids, then only waits for them (see the module docstring). A collective:
        every rank prefetches at the same step. An input this rank refuses makes every rank raise
        in the next forward (and, when it is not ids at all, here too)."""
        try:
            reqs = self._forward_requests(inputs)  # (checked as the forward checks them)
        except Exception as e:
            self._send_ahead([], e)
            raise
        self._send_ahead(reqs)

    def prefetch_many(self, requests: Sequence[tuple[str, Any]]) -> None:
        """:meth:`prefetch` of the next :meth:`lookup_many` (the same ``(feature, ids)`` pairs)."""
        try:
            reqs = self._many_requests(requests, what="prefetch_many")
        except Exception as e:
            self._send_ahead([], e)
            raise
        self._send_ahead(reqs)

    def prefetch_failed(self, error: BaseException) -> None:
        """This rank cannot make its prefetch (``he.prefetch`` could not record a layer's lookups):
        the other ranks raise in their next forward, as this one does (``error``, raised there)."""
        self._send_ahead([], error)

    @property
    def prefetched(self) -> bool:
        """Whether the next exchange's ids were sent ahead (a prefetch not yet taken by a forward)."""
        return self._ahead is not None

    def _send_ahead(self, reqs: list, error: BaseException | None = None) -> None:
        if self._ahead is not None:  # (a second prefetch: the first is the next forward's)
            raise HybridEmbedError(
                "a prefetch is already waiting for the next forward; prefetch once per step, after its forward"
            )
        channel = self._channel_ahead()
        threaded = dist.get_backend(self._group) != "nccl"
        if error is None:
            reqs = [(f, _copied(j, self._trusted(j))) for f, j in reqs]
            self._ahead = Ahead(reqs, lambda: self._send_ids(reqs, channel), threaded)
        else:
            self._ahead = Ahead(reqs, lambda: self._send_failed(error, channel), threaded)

    def _channel_ahead(self) -> Channel:
        """The prefetches' process group (the same ranks as the exchange's; made by the first
        prefetch, which every rank makes at the same step)."""
        if self._ahead_channel is None:
            ranks = dist.get_process_group_ranks(self._group)
            group = health.new_group(ranks, health.job_timeout(self._group), use_local_synchronization=True)
            self.__dict__["_ahead_channel"] = Channel(group)
        return self._ahead_channel

    def _take_ahead(self) -> Ahead | None:
        ahead, self.__dict__["_ahead"] = self._ahead, None
        return ahead

    def _sent_ahead(self, ahead: Ahead, reqs: list) -> tuple[Sent, list, list[int]]:
        """The prefetched exchange for this forward's ``reqs``, ``reqs`` in the prefetch's order,
        and where each of ``reqs`` is in it; a forward whose lookups differ makes every rank raise (the ranks agree on it before
        any owner looks anything up: one small all-reduce)."""
        sent = ahead.result()  # (a prefetch that failed on any rank raises here, on every rank)
        try:
            order = _order(ahead.reqs, reqs)
            if order is None:
                differ = [f for (f, a), (g, b) in zip(ahead.reqs, reqs) if f != g or not _same(a.values, b.values)]
                raise HybridEmbedError(
                    f"rank {self.rank}: this forward's lookups ({', '.join(f for f, _ in reqs)}) are not the ones "
                    f"prefetched ({', '.join(f for f, _ in ahead.reqs)}; first difference: "
                    f"{differ[0] if differ else 'their number'}): the step after ec.prefetch(inputs) must look up "
                    "those inputs, unchanged; nothing was looked up or changed on any rank"
                )
        except Exception as e:
            self._fail_rows(sent, e)
            raise
        self._agree_ahead(sent, failed=False)
        mine = [None] * len(reqs)
        for q, p in enumerate(order):
            mine[p] = reqs[q]
        return sent, mine, order

    def _agree_ahead(self, sent: Sent, failed: bool, why: str = "") -> None:
        """Before the second half of a prefetched exchange: the ranks agree that every one of them
        takes it (one small all-reduce), so no owner looks anything up for a step some rank
        refused (its forward failed, or looked up other ids)."""
        if failed:
            health.tell(f"{sent.step}/{self.rank}/ahead", why)
        flag = torch.tensor([int(failed) << self.rank], dtype=torch.int64, device=self._device)
        if self.world_size > 1:
            dist.all_reduce(flag, group=self._group)
        bad = [r for r in range(self.world_size) if int(flag) >> r & 1]
        if bad and not failed:
            said = {r: health.told(f"{sent.step}/{r}/ahead") or "its error names it" for r in bad}
            told = "; ".join(w if w.startswith(f"rank {r}:") else f"rank {r}: {w}" for r, w in said.items())
            raise HybridEmbedError(
                f"rank(s) {', '.join(map(str, bad))} did not take this step's prefetched lookups ({told}); nothing "
                "was looked up or changed on any rank"
            )

    def _abandon_ahead(self, error: BaseException) -> bool:
        """This rank's forward failed while a prefetch waits: the others, already in its second
        half, learn it there (and raise). False when nothing was prefetched."""
        ahead = self._take_ahead()
        if ahead is None:
            return False
        try:
            sent = ahead.result()
        except Exception:  # noqa: BLE001 - the prefetch failed on every rank: no one waits for this one
            return True
        self._fail_rows(sent, error)
        return True

    def _send_failed(self, error: BaseException, channel: Channel) -> Sent:
        """A prefetch whose input this rank refused: the header tells every rank (which raise
        when the next forward takes it)."""
        self._send_ids([], channel, error)
        raise AssertionError("unreachable: a failed header raises")  # pragma: no cover
