"""The parameter servers' messages: a fixed header, then one byte payload.

A message is a header of ``HEAD`` int64 (``MAGIC``, op or status, request id, step, then the
payload's three parts in elements: int64s, floats, JSON bytes, and the floats' dtype code) and,
when not empty, a payload: one uint8 tensor holding the three parts back to back.

A request travels as one c10d message, its **frame** (:func:`frame`): a random nonce (int64),
the header, the payload, the nonce again. A server receives every request into one buffer of
``NONCE + 8 * HEAD + limit + NONCE`` bytes (gloo aborts a process that receives a message
longer than its buffer, and fills a longer buffer with a shorter message without a word), so
:func:`unframe` checks, before anything is parsed: the header (magic, op, sizes within the
limit, a known dtype), then that the nonce closes the frame exactly where the header says the
payload ends. A frame shorter than its header declares (the tail would be an older request's
bytes), longer (a payload longer than declared, a header longer than ``HEAD``) or cut short
(no whole header) is refused, naming what is wrong; nothing a trainer sends within the
buffer's size can crash the server or be misread. A reply is two messages (header, then
payload): a trainer trusts its servers.

    >>> import torch
    >>> m = Message(PULL, 7, 3, torch.tensor([1, 2, 3]), None, {"train": True})
    >>> h, p = pack(m)
    >>> unpack(h, p, limit=1 << 20) == m
    True
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import HybridEmbedError

__all__ = [
    "Message",
    "WireError",
    "pack",
    "unpack",
    "check_header",
    "frame",
    "unframe",
    "frame_bytes",
    "HEAD",
    "MAGIC",
    "OPS",
]

MAGIC = 0x48_45_50_53_31  # "HEPS1"
HEAD = 8
NONCE = 8  # bytes of the nonce at each end of a request's frame
# requests (trainer -> server)
ATTACH, PULL, PUSH, CHECKPOINT, READ, STATS, BYE = 1, 2, 3, 4, 5, 6, 7
OPS = {ATTACH: "attach", PULL: "pull", PUSH: "push", CHECKPOINT: "checkpoint", READ: "read", STATS: "stats", BYE: "bye"}
# replies (server -> trainer): the op field is the status
OK, ERROR = 0, 1
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_NONE = -1  # dtype code of a payload without floats


class WireError(HybridEmbedError):
    """A message that does not follow the protocol (answered with an error; nothing changes).
    ``header``: the header as received, where there was one."""

    header: torch.Tensor | None = None


@dataclass
class Message:
    """One request or reply: ``op`` (a request's op, or a reply's status), ``req`` (the
    request's id, echoed by its reply), ``step`` (the trainer's optimizer step), ``ints`` (K,)
    int64, ``floats`` (F,) of one float dtype or None, ``meta`` a JSON-able dict."""

    op: int
    req: int
    step: int
    ints: torch.Tensor
    floats: torch.Tensor | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Message):
            return NotImplemented
        same_f = (self.floats is None and other.floats is None) or (
            self.floats is not None and other.floats is not None and torch.equal(self.floats, other.floats)
        )
        return (
            (self.op, self.req, self.step, self.meta) == (other.op, other.req, other.step, other.meta)
            and torch.equal(self.ints, other.ints)
            and same_f
        )


def pack(m: Message) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``m`` -> (header (HEAD,) int64, payload (B,) uint8 or None when empty)."""
    ints = m.ints.detach().to(torch.int64).reshape(-1).contiguous()
    floats = None if m.floats is None else m.floats.detach().reshape(-1).contiguous()
    if floats is not None and floats.dtype not in DTYPES:
        raise WireError(f"floats of dtype {floats.dtype} cannot be sent; one of {DTYPES}")
    meta = json.dumps(m.meta, separators=(",", ":")).encode() if m.meta else b""
    code = _NONE if floats is None else DTYPES.index(floats.dtype)
    nf = 0 if floats is None else floats.numel()
    header = torch.tensor([MAGIC, m.op, m.req, m.step, ints.numel(), nf, len(meta), code], dtype=torch.int64)
    parts = [ints.view(torch.uint8)]
    if floats is not None:
        parts.append(floats.view(torch.uint8))
    if meta:
        parts.append(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
    parts = [p for p in parts if p.numel()]
    if not parts:
        return header, None
    return header, parts[0] if len(parts) == 1 else torch.cat(parts)


def check_header(h: torch.Tensor, limit: int, replies: bool = False) -> int:
    """Checks a received header; returns the payload's bytes. Raises :class:`WireError`."""
    if h.dtype != torch.int64 or h.numel() != HEAD:
        raise WireError(f"a header is {HEAD} int64, got {h.numel()} {h.dtype}")
    magic, op, _, step, ni, nf, nj, code = h.tolist()
    if magic != MAGIC:
        raise WireError(f"bad magic {magic:#x} (not a hybridembed parameter-server message)")
    if replies:
        if op not in (OK, ERROR):
            raise WireError(f"bad reply status {op}")
    elif op not in OPS:
        raise WireError(f"unknown op {op}; ops: {', '.join(f'{k} ({v})' for k, v in OPS.items())}")
    if step < 0:
        raise WireError(f"negative step {step}")
    if min(ni, nf, nj) < 0:
        raise WireError(f"negative payload sizes ({ni} ints, {nf} floats, {nj} meta bytes)")
    if code != _NONE and not 0 <= code < len(DTYPES):
        raise WireError(f"unknown float dtype code {code}")
    if nf and code == _NONE:
        raise WireError(f"{nf} floats without a dtype")
    itemsize = DTYPES[code].itemsize if code != _NONE else 0
    if max(ni, nf, nj) > limit:  # (before multiplying: no overflow)
        raise WireError(f"payload of {max(ni, nf, nj)} elements is over the limit of {limit} bytes")
    nbytes = 8 * ni + itemsize * nf + nj
    if nbytes > limit:
        raise WireError(f"payload of {nbytes} bytes is over the limit of {limit} bytes")
    return nbytes


def unpack(h: torch.Tensor, payload: torch.Tensor | None, limit: int, replies: bool = False) -> Message:
    """(header, payload) -> :class:`Message`; every size and the JSON are checked."""
    nbytes = check_header(h, limit, replies)
    _, op, req, step, ni, nf, nj, code = h.tolist()
    got = 0 if payload is None else payload.numel()
    if got != nbytes:
        raise WireError(f"payload of {got} bytes, the header says {nbytes}")
    if payload is not None and (payload.dtype != torch.uint8 or payload.dim() != 1):
        raise WireError(f"payload must be uint8 of one dimension, got {payload.dtype} of shape {tuple(payload.shape)}")
    buf = payload if payload is not None else torch.zeros(0, dtype=torch.uint8)
    ints = buf[: 8 * ni].clone().view(torch.int64)
    floats = None
    if code != _NONE:
        dt = DTYPES[code]
        floats = buf[8 * ni : 8 * ni + dt.itemsize * nf].clone().view(dt)
    meta: dict[str, Any] = {}
    if nj:
        try:
            meta = json.loads(bytes(buf[nbytes - nj :].numpy()).decode())
        except (UnicodeDecodeError, ValueError) as e:
            raise WireError(f"meta is not JSON: {e}") from None
        if not isinstance(meta, dict):
            raise WireError(f"meta must be a JSON object, got {type(meta).__name__}")
    return Message(op, req, step, ints, floats, meta)


def frame_bytes(limit: int) -> int:
    """The largest frame of a request within ``limit`` bytes of payload (a server's buffer)."""
    return NONCE + 8 * HEAD + limit + NONCE


def frame(m: Message) -> torch.Tensor:
    """``m`` -> its frame: (B,) uint8 = nonce, header, payload, nonce (see the module docstring).

    >>> f = frame(Message(PUSH, 1, 0, torch.tensor([5]), torch.ones(2)))
    >>> f.numel() == NONCE + 8 * HEAD + 8 + 8 + NONCE
    True
    >>> buf = torch.zeros(frame_bytes(1024), dtype=torch.uint8)
    >>> buf[: f.numel()] = f
    >>> h, p = unframe(buf, 1024)
    >>> unpack(h, p, 1024) == Message(PUSH, 1, 0, torch.tensor([5]), torch.ones(2))
    True
    """
    h, p = pack(m)
    nonce = torch.randint(1, 1 << 62, (1,), dtype=torch.int64).view(torch.uint8)
    parts = [nonce, h.view(torch.uint8)] + ([p] if p is not None else []) + [nonce]
    return torch.cat(parts)


def unframe(buf: torch.Tensor, limit: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A received frame in ``buf`` (a server's buffer, whose first ``NONCE + 8 * HEAD`` bytes were
    zeroed before the receive) -> (header (HEAD,) int64, payload (a view into ``buf``) or None).
    Raises :class:`WireError` for a frame whose header fails :func:`check_header` (``err.header``
    holds the header as received) or whose end is not where its header says."""
    start = NONCE + 8 * HEAD
    nonce = buf[:NONCE].view(torch.int64)
    h = buf[NONCE:start].view(torch.int64).clone()
    if int(nonce) == 0:
        raise WireError("a request frame starts with a nonce of 0: it is not a frame, or it was cut short")
    try:
        nbytes = check_header(h, limit)
    except WireError as e:
        e.header = h
        raise
    end = start + nbytes
    if not torch.equal(buf[end : end + NONCE], buf[:NONCE]):
        e = WireError(
            f"a request frame does not end where its header says (a payload of {nbytes} bytes): the message is "
            "shorter or longer than its header declares"
        )
        e.header = h
        raise e
    return h, (buf[start:end] if nbytes else None)
