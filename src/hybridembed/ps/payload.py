"""What a pull and a push carry: typed payloads with one :meth:`pack` (the trainer's side) and
one :meth:`unpack` (the server's side) each, so both ends read the format from one place.

Shape legend: ``U`` ids of one item (a shard's local ids), ``D`` the shard's width.

A pull's ints are ``[flags, n, (shard, count) * n, ids of each item..., times seen of each item
of a dynamic shard...]`` (``flags``: 1 when the lookup trains; the ids of item ``k`` and its times
seen, where it has them, follow in item order); a pull has no floats. A push's ints are the same
without times seen (``flags`` 0) and its floats are the items' gradient rows back to back
(``count * width`` values each, row after row).

The ints do not say which items carry times seen, nor how wide a shard's rows are: the receiver
knows its shards. So :meth:`PullRequest.unpack` asks ``dynamic(shard)`` and
:meth:`PushRequest.unpack` asks ``width(shard)``, once per item in order; either may raise
:class:`~hybridembed.ps.wire.WireError` to refuse a shard (the server's: "not held here").
Everything else about the structure is checked by ``unpack``, which raises ``WireError``
naming what is wrong (a server answers it with an error reply).

    >>> import torch
    >>> pull = PullRequest(True, [PullItem(0, torch.tensor([3, 5])), PullItem(2, torch.tensor([9]), torch.tensor([4]))])
    >>> ints, floats = pull.pack()
    >>> ints.tolist(), floats
    ([1, 2, 0, 2, 2, 1, 3, 5, 9, 4], None)
    >>> PullRequest.unpack(ints, floats, dynamic=lambda shard: shard == 2) == pull
    True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .wire import WireError

__all__ = ["PullItem", "PullRequest", "PushItem", "PushRequest"]

_TRAIN = 1  # a pull's flag: the ids are looked up to train (a dynamic table admits and counts them)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and torch.equal(a, b)


@dataclass(frozen=True, eq=False)
class PullItem:
    """The ids a pull asks of one shard: ``ids`` (U,) int64 in the shard's local id space,
    ``seen`` (U,) int64 how often the batch holds each (a dynamic shard's; None for a dense one)."""

    shard: int
    ids: torch.Tensor
    seen: torch.Tensor | None = None

    def __post_init__(self):
        if self.ids.dim() != 1:
            raise WireError(f"shard {self.shard}: ids must be of one dimension, got shape {tuple(self.ids.shape)}")
        if self.seen is not None and self.seen.shape != self.ids.shape:
            raise WireError(f"shard {self.shard}: {self.seen.numel()} times seen for {self.ids.numel()} ids")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PullItem):
            return NotImplemented
        return self.shard == other.shard and _same(self.ids, other.ids) and _same(self.seen, other.seen)


@dataclass(frozen=True, eq=False)
class PushItem:
    """A push's gradient of one shard: ``ids`` (U,) int64 local ids, ``rows`` (U, D) their gradients."""

    shard: int
    ids: torch.Tensor
    rows: torch.Tensor

    def __post_init__(self):
        if self.ids.dim() != 1 or self.rows.dim() != 2 or self.rows.shape[0] != self.ids.numel():
            raise WireError(
                f"shard {self.shard}: a push item needs ids (U,) and rows (U, D), got ids of shape "
                f"{tuple(self.ids.shape)} and rows of shape {tuple(self.rows.shape)}"
            )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PushItem):
            return NotImplemented
        return self.shard == other.shard and _same(self.ids, other.ids) and _same(self.rows, other.rows)


@dataclass
class PullRequest:
    """A pull: ``train`` (the lookup trains: a dynamic shard admits and counts the ids) and its
    items, one per shard asked (a shard may appear more than once)."""

    train: bool
    items: list[PullItem]

    def pack(self) -> tuple[torch.Tensor, None]:
        """-> (ints (K,) int64, no floats): the payload of a ``PULL`` message."""
        seen = [it.seen for it in self.items if it.seen is not None]
        return torch.cat([*_pack_head(_TRAIN if self.train else 0, self.items), *seen]), None

    @classmethod
    def unpack(cls, ints: torch.Tensor, floats: torch.Tensor | None, *, dynamic: Callable[[int], bool]) -> PullRequest:
        """A ``PULL`` message's (ints, floats) -> the pull, every size checked. ``dynamic(shard)``:
        whether the ids of ``shard`` come with times seen (it may raise to refuse the shard).

        >>> ints = torch.tensor([1, 1, 4, 2, 7, 8])  # train, one item: shard 4, ids [7, 8]
        >>> PullRequest.unpack(ints, None, dynamic=lambda shard: True)
        Traceback (most recent call last):
        ...
        hybridembed.ps.wire.WireError: shard 4: a dynamic table's pull needs a count per id (2 ids, 0 ints left)
        """
        if floats is not None and floats.numel():
            raise WireError(f"a pull carries no floats, got {floats.numel()}")
        flags, heads, pos = _unpack_head(ints, "pull", dynamic, _TRAIN)
        items = []
        for shard, ids, has_seen in heads:
            seen = None
            if has_seen:
                count, left = ids.numel(), ints.numel() - pos
                if count > left:
                    raise WireError(
                        f"shard {shard}: a dynamic table's pull needs a count per id ({count} ids, {left} ints left)"
                    )
                seen = ints[pos : pos + count]
                pos += count
                if count and int(seen.min()) < 1:
                    raise WireError(f"shard {shard}: times seen must be >= 1, got {int(seen.min())}")
            items.append(PullItem(shard, ids, seen))
        _check_end(ints, pos, len(heads))
        return cls(bool(flags & _TRAIN), items)


@dataclass
class PushRequest:
    """A push: one step's gradient rows, an item per shard (their floats of one dtype).

    >>> push = PushRequest([PushItem(1, torch.tensor([2, 7]), torch.ones(2, 4))])
    >>> ints, floats = push.pack()
    >>> ints.tolist(), floats.shape
    ([0, 1, 1, 2, 2, 7], torch.Size([8]))
    >>> PushRequest.unpack(ints, floats, width=lambda shard: 4) == push
    True
    >>> PushRequest.unpack(ints, floats[:6], width=lambda shard: 4)
    Traceback (most recent call last):
    ...
    hybridembed.ps.wire.WireError: a push of these ids needs 8 gradient values, got 6
    """

    items: list[PushItem]

    def pack(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (ints (K,) int64, floats (F,) or None when there are no items): a ``PUSH`` payload."""
        floats = torch.cat([it.rows.reshape(-1) for it in self.items]) if self.items else None
        return torch.cat(_pack_head(0, self.items)), floats

    @classmethod
    def unpack(cls, ints: torch.Tensor, floats: torch.Tensor | None, *, width: Callable[[int], int]) -> PushRequest:
        """A ``PUSH`` message's (ints, floats) -> the push, every size checked. ``width(shard)``:
        the width of the rows of ``shard`` (it may raise to refuse the shard)."""
        _, heads, pos = _unpack_head(ints, "push", width, 0)
        _check_end(ints, pos, len(heads))
        sizes = [ids.numel() * w for _, ids, w in heads]
        got = 0 if floats is None else floats.numel()
        if got != sum(sizes):
            raise WireError(f"a push of these ids needs {sum(sizes)} gradient values, got {got}")
        if floats is None:  # (no values at all: every item has no ids)
            floats = torch.zeros(0)
        parts = floats.split(sizes)
        return cls([PushItem(shard, ids, part.view(ids.numel(), w)) for (shard, ids, w), part in zip(heads, parts)])


def _pack_head(flags: int, items: list) -> list[torch.Tensor]:
    """``[flags, n, (shard, count) * n]`` then the ids of each item."""
    head = [flags, len(items)]
    for it in items:
        head += [it.shard, it.ids.numel()]
    return [torch.tensor(head, dtype=torch.int64), *(it.ids for it in items)]


def _unpack_head(ints: torch.Tensor, op: str, about: Callable[[int], object], known: int) -> tuple[int, list, int]:
    """``[flags, n, (shard, count) * n, ids...]`` -> (flags, ``[(shard, ids, about(shard))]``, the
    position in ``ints`` after the ids). ``about`` is asked before the shard's count is checked;
    ``known``: the flag bits this request may set."""
    if ints.dtype != torch.int64 or ints.dim() != 1:
        raise WireError(f"a {op}'s ints must be int64 of one dimension, got {ints.dtype} of shape {tuple(ints.shape)}")
    if ints.numel() < 2:
        raise WireError(f"a {op} needs ints [flags, n, (shard, count) * n, ids...], got {ints.numel()} int(s)")
    flags, n = int(ints[0]), int(ints[1])
    if flags & ~known:
        raise WireError(f"a {op}'s flags {flags} set bits it does not know (known: {known})")
    if n < 0 or 2 + 2 * n > ints.numel():
        raise WireError(f"{n} pairs do not fit in the {ints.numel()} ints of a {op}")
    pos = 2 + 2 * n
    out = []
    for shard, count in ints[2:pos].view(n, 2).tolist():
        known = about(shard)
        if count < 0 or pos + count > ints.numel():
            raise WireError(f"shard {shard}: {count} ids do not fit in the request ({ints.numel() - pos} ints left)")
        out.append((shard, ints[pos : pos + count], known))
        pos += count
    return flags, out, pos


def _check_end(ints: torch.Tensor, pos: int, n: int) -> None:
    if pos != ints.numel():
        raise WireError(f"{ints.numel() - pos} ints left over after {n} pairs")
