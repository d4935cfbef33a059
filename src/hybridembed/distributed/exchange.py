"""The wire of the sharded runtime's exchange (:mod:`hybridembed.distributed.runtime`): the
fixed-size :class:`Header` every rank sends every rank first, the autograd-aware all-to-all of
rows (:class:`RowsExchange`), and the plain one of ids and sizes. Failures of a peer become
:class:`~hybridembed.RankLost` naming it (:mod:`hybridembed.distributed.health`).

On NCCL every tensor sent here lives on the rank's GPU (the runtime makes them on its device);
on gloo, on the CPU or a GPU alike.
"""

from __future__ import annotations

import hashlib
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.distributed as dist

from . import health

__all__ = [
    "SharedRowsJoined",
    "Capacity",
    "Header",
    "INVALID",
    "FAILED",
    "FOLD_ROWS",
    "fold_status",
    "PER_PAIR",
    "Pair",
    "RowsExchange",
    "RowsJoined",
    "SharedRowsExchange",
    "all_to_all",
    "gloo_all_to_all",
    "shared_of",
    "through_shared",
    "exchange",
    "features_digest",
    "headers_and_ints",
    "lost_peer",
    "MERGE_INTS",
]

PER_PAIR = 3  # sizes sent per pair before the ids: bags, ids, one id per bag (then no lengths are sent)


@dataclass
class Pair:
    """One (request, shard) of a lookup: what one rank asks one owner for."""

    rank: int  # the owner
    local: str  # the owner's feature name for it
    width: int


@dataclass(frozen=True)
class Header:
    """What each rank tells each other rank first in an exchange. Its size is fixed, so ranks that
    disagree on the step (one could not make its lookups, or looked up other features) still
    read each other's, and every rank raises instead of waiting or misreading what follows.

    ``failed``: 0, or :data:`INVALID` (this rank's input was refused) or :data:`FAILED` (it failed
    otherwise before the exchange); ``weights``: per-id weights follow the ids; ``digest``: of the
    features looked up, in order; ``nints``: int64s this rank sends the other (the sizes of each
    pair the other owns, then their bag lengths and ids: as many as fit ride after the header, see
    :func:`headers_and_ints`); ``rows``: the row elements this rank will receive in all (every rank
    learns every rank's: when all are at most :data:`FOLD_ROWS`, the owners' status rides in the
    rows' all-to-all, see :func:`fold_status`); ``more``: some of this rank's int64s did not fit
    after its headers (a second all-to-all sends the rest).

        >>> h = Header(0, 1, 12345, 7, 640)
        >>> Header.unpack(torch.tensor([h.pack(), Header(INVALID, 0, 0, 0, 0, 1).pack()]))
        [Header(failed=0, weights=1, digest=12345, nints=7, rows=640, more=0), Header(failed=1, weights=0, digest=0, nints=0, rows=0, more=1)]
    """

    failed: int
    weights: int
    digest: int
    nints: int
    rows: int = 0
    more: int = 0

    SIZE: ClassVar[int] = 6

    def pack(self) -> list[int]:
        return [self.failed, self.weights, self.digest, self.nints, self.rows, self.more]

    @staticmethod
    def unpack(rows: torch.Tensor) -> list[Header]:
        """(W, SIZE) int64 -> one header per rank (one host sync)."""
        return [Header(*row) for row in rows.view(-1, Header.SIZE).tolist()]


INVALID, FAILED = 1, 2  # Header.failed: the rank's input was refused / it failed otherwise

# A pair of ranks' int64s (ids and sizes) ride after the header in one all-to-all up to the
# capacity that pair's last exchange set (what it sent then, an eighth more); a step like the
# last one makes one collective for both, not two. Beyond this many int64s (128 KB) a pair sends
# them in an all-to-all of their own: the collective's latency saved matters in small steps (batch
# 128 a rank: 1,700 int64s an owner), not in large ones (4,096: 53,000), where the merge measured
# no gain within this machine's noise. See docs/benchmarks.md "The sharded step's fixed cost".
MERGE_INTS = 1 << 14


@dataclass
class Capacity:
    """Per rank of a channel's group: how many int64s ride after the header this rank sends it
    (``send``) and after the one it receives from it (``recv``). Both ends of a pair derive their
    figure from the same header, so they agree without a word."""

    send: list[int]
    recv: list[int]

    @staticmethod
    def of(world: int) -> Capacity:
        return Capacity([0] * world, [0] * world)

    @staticmethod
    def after(n: int) -> int:
        """The capacity after an exchange of ``n`` int64s."""
        return 0 if n > MERGE_INTS else n + (n >> 3)


def headers_and_ints(
    heads: list[Header], ints: list[torch.Tensor] | None, cap: Capacity, group, device, meanwhile=None
) -> tuple[list[Header], list[torch.Tensor] | None]:
    """``heads[r]`` and ``ints[r]`` (the int64s that follow it; None: none, a failed rank's
    header) to each rank ``r`` of ``group``; theirs back. As many int64s as ``cap`` holds ride after
    each header in one all-to-all; when some rank's did not fit (its headers say ``more``), a
    second all-to-all sends the rest. ``cap`` is then set from this exchange's sizes, the same on
    both ends of every pair. Returns every rank's header to this one and what it sent after it
    (None when some rank failed: nothing after a failed header is read). ``meanwhile``: a function
    called while the headers cross (see :func:`all_to_all`)."""
    world = len(heads)
    ints = ints if ints is not None else [torch.zeros(0, dtype=torch.int64, device=device)] * world
    more = int(any(x.numel() > c for x, c in zip(ints, cap.send)))
    heads = [replace(h, more=more, nints=int(x.numel())) for h, x in zip(heads, ints)]  # (the count both ends use)
    packed = torch.tensor([h.pack() for h in heads], dtype=torch.int64, device=device)
    pieces = []
    for r, (x, c) in enumerate(zip(ints, cap.send)):
        pieces += [packed[r], x[:c]]
        if x.numel() < c:
            pieces.append(x.new_zeros(c - x.numel()))
    sizes = [Header.SIZE + c for c in cap.recv]
    got = exchange(torch.cat(pieces), [Header.SIZE + c for c in cap.send], sizes, group, meanwhile).split(sizes)
    got_h = Header.unpack(torch.cat([g[: Header.SIZE] for g in got]))
    firsts = [g[Header.SIZE : Header.SIZE + min(h.nints, c)] for g, h, c in zip(got, got_h, cap.recv)]
    rest_in = [max(0, h.nints - c) for h, c in zip(got_h, cap.recv)]
    rest_out = [x[c:] for x, c in zip(ints, cap.send)]
    cap.send, cap.recv = [Capacity.after(x.numel()) for x in ints], [Capacity.after(h.nints) for h in got_h]
    if any(h.failed for h in got_h):
        return got_h, None
    if any(h.more for h in got_h):
        rest = exchange(torch.cat(rest_out), [x.numel() for x in rest_out], rest_in, group).split(rest_in)
        firsts = [torch.cat([a, b]) if b.numel() else a for a, b in zip(firsts, rest)]
    return got_h, firsts


# Rows' all-to-alls where every rank receives at most this many elements carry the owners'
# status in the same all-to-all (one element after each owner's rows: a copy of rows this small
# costs less than a collective's latency); larger ones send it in an all-to-all of its own.
# Measured: world 2, batch 128, 26 one-hot features of dim 64 (0.4 MB a rank): one collective
# fewer a step, see docs/benchmarks.md "The sharded step's fixed cost".
FOLD_ROWS = 1 << 18


def fold_status(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], status: float, group):
    """Rows out (autograd-aware, as :class:`RowsExchange`) with this rank's ``status`` after each
    owner's piece; returns (the rows received, flat, without the statuses; every sender's status)."""
    st = send.new_full((1,), status).detach()
    pieces = send.split(send_splits)
    out = RowsExchange.apply(
        torch.cat([x for p in pieces for x in (p, st)]),
        [n + 1 for n in send_splits],
        [n + 1 for n in recv_splits],
        group,
    )
    parts = out.split([n + 1 for n in recv_splits])
    statuses = torch.stack([p[-1] for p in parts]).tolist()  # (the one host sync)
    return torch.cat([p[:-1] for p in parts]), statuses


# Groups whose every rank is a process of this machine with a shared-memory transport open
# (:func:`through_shared`): their all-to-alls of CPU tensors go through it, not gloo. By the group's
# id, to a weak reference: the transport lives as long as its collection (whose group is its own),
# and neither is kept alive here.
_SHARED: dict[int, weakref.ref] = {}


def through_shared(group, transport) -> None:
    """From now on, :func:`all_to_all` over ``group`` of CPU tensors goes through ``transport`` (a
    :class:`~hybridembed.distributed.shm.Transport` of ``group``, for as long as it lives; None:
    through gloo again). Every rank of ``group`` must make the same call at the same point of its
    sequence of collectives (the transport's :meth:`~hybridembed.distributed.shm.Transport.open` is
    itself collective)."""
    for key in [k for k, ref in _SHARED.items() if ref() is None]:  # (transports gone with their collections)
        del _SHARED[key]
    if transport is None:
        _SHARED.pop(id(group), None)
    else:
        _SHARED[id(group)] = weakref.ref(transport)


def shared_of(group):
    """The shared-memory transport :func:`all_to_all` over ``group`` goes through, or None (gloo)."""
    ref = _SHARED.get(id(group)) if _SHARED else None
    return ref() if ref is not None else None


def all_to_all(out: torch.Tensor, t: torch.Tensor, recv_splits, send_splits, group, meanwhile=None) -> None:
    """``all_to_all_single``; a peer that died, stopped or failed -> :class:`RankLost` naming it.
    ``meanwhile``: a function called while it runs (started, then waited for whatever the function
    did: every rank's sequence of collectives stays whole). Through shared memory where ``group``'s
    ranks have a transport open (:func:`through_shared`) and the tensors are on the CPU."""
    shared = shared_of(group)
    if shared is not None and out.device.type == "cpu":
        shared.all_to_all(out, t, recv_splits, send_splits, meanwhile=meanwhile)
        return
    gloo_all_to_all(out, t, recv_splits, send_splits, group, meanwhile)


def gloo_all_to_all(out: torch.Tensor, t: torch.Tensor, recv_splits, send_splits, group, meanwhile=None) -> None:
    """:func:`all_to_all` through the process group's backend (gloo, NCCL), whatever the group."""
    try:
        if meanwhile is None:
            dist.all_to_all_single(out, t, recv_splits, send_splits, group=group)
            return
        work = dist.all_to_all_single(out, t, recv_splits, send_splits, group=group, async_op=True)
    except RuntimeError as e:
        raise lost_peer(e, group) from None
    try:
        meanwhile()
    finally:
        try:
            work.wait()
        except RuntimeError as e:
            raise lost_peer(e, group) from None


def lost_peer(e: RuntimeError, group) -> health.RankLost:
    """A collective of the exchange's ``group`` failed with ``e``: :class:`RankLost` naming the
    peers that died, stopped or failed (their heartbeats and notes, :func:`health.lost`)."""
    peers = [r for r in range(dist.get_world_size(group)) if r != dist.get_rank(group)]
    return health.lost(f"rank {dist.get_rank()}: the embedding exchange", peers, e, group)


class RowsExchange(torch.autograd.Function):
    """``all_to_all_single`` of a flat tensor whose backward is the reverse exchange: rows go
    out to requesters, gradients come back to owners (summed over requesters; the ``mean``
    reduction's 1/W is applied to the owner's reduced rows at the optimizer step, fewer than
    the pooled rows that cross)."""

    @staticmethod
    def forward(ctx, send, send_splits, recv_splits, group):  # (sum send_splits,) -> (sum recv_splits,)
        recv = send.new_empty(sum(recv_splits))
        all_to_all(recv, send.contiguous(), recv_splits, send_splits, group)
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return recv

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        g = grad.contiguous()
        out = g.new_empty(sum(send_splits))
        all_to_all(out, g, send_splits, recv_splits, ctx.group)
        return out, None, None, None


def _pieces_of(flat: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """``flat``'s consecutive (n, width) pieces, not views for autograd (as ``unsafe_split``'s):
    each run of one width split from one (-1, width) view of it."""
    out: list[torch.Tensor] = []
    at, i = 0, 0
    while i < len(shapes):
        w, j = shapes[i][1], i
        while j < len(shapes) and shapes[j][1] == w:
            j += 1
        run = [n for n, _ in shapes[i:j]]
        size = sum(run) * w
        if w:
            out.extend(torch.unsafe_split_with_sizes(flat[at : at + size].view(-1, w), run))
        else:
            out.extend(flat.new_empty(n, 0) for n in run)
        at, i = at + size, j
    return out


class SharedRowsExchange(torch.autograd.Function):
    """:class:`RowsExchange` through a shared-memory :class:`~hybridembed.distributed.shm.Transport`,
    straight into and out of the requester's matrices: ``shapes[r]`` lists the (bags, width) of
    the pieces source ``r`` sends here, in order. Returns (every rank's ``status``, the meeting's
    payload, as a (W,) tensor; then one (bags, width) matrix per piece, source by source): the
    other ranks' rows copied once, each into its matrix, this rank's own the owner's output as it
    is (not views for autograd, as ``unsafe_split``'s: the owner never reads its output again);
    in the backward each gradient element copied once from the model's (strided) gradients to
    where it goes: no flat buffer is joined."""

    @staticmethod
    def forward(ctx, send, send_splits, recv_splits, shapes, transport, status):
        me = transport.rank
        mats = [[send.new_empty(n, w) for n, w in src] if r != me else None for r, src in enumerate(shapes)]
        statuses = torch.tensor(transport.all_to_all(mats, send, recv_splits, send_splits, status))
        at = sum(send_splits[:me])
        mats[me] = _pieces_of(send.detach()[at : at + send_splits[me]], shapes[me])
        ctx.splits, ctx.transport, ctx.counts = (send_splits, recv_splits), transport, [len(m) for m in mats]
        ctx.like = (send.dtype, send.device)
        ctx.mark_non_differentiable(statuses)
        return (statuses, *[m for src in mats for m in src])

    @staticmethod
    def backward(ctx, _, *grads):
        send_splits, recv_splits = ctx.splits
        per_rank, k = [], 0
        for c in ctx.counts:
            per_rank.append(list(grads[k : k + c]))
            k += c
        out = torch.empty(sum(send_splits), dtype=ctx.like[0], device=ctx.like[1])
        ctx.transport.all_to_all(out, per_rank, send_splits, recv_splits)
        return out, None, None, None, None, None


class SharedRowsJoined(torch.autograd.Function):
    """:class:`SharedRowsExchange` whose requests' rows are written straight into the columns of
    one joined (B, W) tensor (a model's ``torch.cat`` of them, :mod:`hybridembed.modules.joined`):
    ``cols[r]`` the (first, last) columns of each piece source ``r`` sends here, in order (copied a
    run of evenly spaced ones at a time, :func:`_column_runs`); the
    ``dense`` tensors written at ``dense_cols``. Returns (every rank's ``status`` (W,), the joined
    tensor viewed as ``shape``). The backward sends each piece's gradient columns back, as
    :class:`SharedRowsExchange`'s, and gives each dense input its columns."""

    @staticmethod
    def forward(ctx, send, send_splits, recv_splits, transport, status, shape, cols, dense_cols, *dense):
        out, flat = _joined(ctx, send, send_splits, recv_splits, shape, cols, dense_cols, dense)
        dst = [[run.transpose(0, 1) for _, _, run in _column_runs(flat, piece)] for piece in cols]
        statuses = torch.tensor(transport.all_to_all(dst, send, recv_splits, send_splits, status))
        ctx.transport, ctx.like = transport, (send.dtype, send.device)
        ctx.mark_non_differentiable(statuses)
        return statuses, out

    @staticmethod
    def backward(ctx, _, grad):
        send_splits, recv_splits = ctx.splits
        flat, dense = _joined_grad(ctx, grad)
        per_rank = [[run.transpose(0, 1) for _, _, run in _column_runs(flat, piece)] for piece in ctx.cols]
        out = torch.empty(sum(send_splits), dtype=ctx.like[0], device=ctx.like[1])
        ctx.transport.all_to_all(out, per_rank, send_splits, recv_splits)
        return (out, *(None,) * 7, *dense)


def _joined(ctx, send, send_splits, recv_splits, shape, cols, dense_cols, dense) -> tuple[torch.Tensor, torch.Tensor]:
    """A joined exchange's output (``shape``) and its (B, W) view, the ``dense`` inputs written at
    their columns; what its backward needs kept on ``ctx``."""
    out = send.new_empty(shape)
    flat = out.view(shape[0], math.prod(shape[1:]))  # (not -1: a rank's batch may be empty)
    for (lo, hi), x in zip(dense_cols, dense):
        flat[:, lo:hi].copy_(x.reshape(shape[0], hi - lo))
    ctx.splits, ctx.cols, ctx.dense_cols = (send_splits, recv_splits), cols, dense_cols
    ctx.shapes = [x.shape for x in dense]
    return out, flat


def _joined_grad(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The joined output's gradient as (B, W), and each dense input's (its columns)."""
    flat = grad.reshape(grad.shape[0], math.prod(grad.shape[1:]))
    return flat, tuple(flat[:, lo:hi].reshape(shape) for (lo, hi), shape in zip(ctx.dense_cols, ctx.shapes))


def _column_runs(flat: torch.Tensor, piece: list[tuple[int, int]]):
    """(n, width, (B, n, width) view of ``flat``'s columns) of each run of consecutive pieces of
    one width whose first columns are evenly spaced (every other table of a model's cat on one
    rank, or a block of them): one strided copy a run, not one a piece."""
    sb, sc = flat.stride()
    i = 0
    while i < len(piece):
        lo, hi = piece[i]
        w, j = hi - lo, i + 1
        step = piece[j][0] - lo if j < len(piece) and piece[j][1] - piece[j][0] == w else 0
        if step >= w:
            while j < len(piece) and piece[j] == (lo + (j - i) * step, lo + (j - i) * step + w):
                j += 1
        n = j - i
        yield n, w, flat.as_strided((flat.shape[0], n, w), (sb, max(step, w) * sc, sc), flat.storage_offset() + lo * sc)
        i = j


class RowsJoined(torch.autograd.Function):
    """:class:`SharedRowsJoined` in one all-to-all (:func:`all_to_all`: gloo, or the group's
    shared-memory transport), the owners' status folded in (as :func:`fold_status`):
    the rows received written straight into the columns of the joined (B, W) tensor, the gradient
    columns sent back from where they lie. Copies a row twice on its way out (into the padded send
    buffer, then into its columns) and once on its way back; the usual path's views, splits and
    concatenations (and their backwards) are not made. Same arguments (``group`` for
    ``transport``) and returns as :class:`SharedRowsJoined`."""

    @staticmethod
    def forward(ctx, send, send_splits, recv_splits, group, status, shape, cols, dense_cols, *dense):
        st = send.new_full((1,), status)
        padded = torch.cat([x for p in send.detach().split(send_splits) for x in (p, st)])
        recv = send.new_empty(sum(recv_splits) + len(recv_splits))
        all_to_all(recv, padded, [n + 1 for n in recv_splits], [n + 1 for n in send_splits], group)
        out, flat = _joined(ctx, send, send_splits, recv_splits, shape, cols, dense_cols, dense)
        b, at, ends = shape[0], 0, []
        for piece in cols:
            for n, w, cols_of_run in _column_runs(flat, piece):
                cols_of_run.copy_(recv[at : at + n * b * w].view(n, b, w).transpose(0, 1))
                at += n * b * w
            ends.append(at)
            at += 1
        statuses = recv[ends]  # (indexed by a list: a copy)
        ctx.group = group
        ctx.mark_non_differentiable(statuses)
        return statuses, out

    @staticmethod
    def backward(ctx, _, grad):
        send_splits, recv_splits = ctx.splits
        flat, dense = _joined_grad(ctx, grad)
        b, at = flat.shape[0], 0
        back = flat.new_empty(sum(recv_splits))
        for piece in ctx.cols:
            for n, w, cols_of_run in _column_runs(flat, piece):
                back[at : at + n * b * w].view(n, b, w).transpose(0, 1).copy_(cols_of_run)
                at += n * b * w
        out = flat.new_empty(sum(send_splits))
        all_to_all(out, back, send_splits, recv_splits, ctx.group)
        return (out, *(None,) * 7, *dense)


def exchange(t: torch.Tensor, send_splits: list[int], recv_splits: list[int], group, meanwhile=None) -> torch.Tensor:
    """``t`` split by ``send_splits`` to the ranks of ``group``; what they send back, by ``recv_splits``
    (``meanwhile``: see :func:`all_to_all`)."""
    out = t.new_empty(sum(recv_splits))
    all_to_all(out, t, recv_splits, send_splits, group, meanwhile)
    return out


def features_digest(items: Sequence[str]) -> int:
    """A 62-bit digest of a sequence of names (the same on every rank for the same names)."""
    h = hashlib.sha256("\x00".join(items).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 62) - 1)
