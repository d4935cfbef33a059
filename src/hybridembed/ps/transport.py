"""Messages between trainers and servers over c10d point-to-point (gloo: host tensors).

Tags keep the four streams apart: request headers (a server receives them from any
trainer), request payloads, reply headers and reply payloads (each from one known peer). A
server's replies and a trainer's requests are sent without blocking (``isend``), and their
buffers are kept until sent. A trainer waits for a reply at most ``timeout`` seconds; a
dead server fails the wait at once (its connection closes).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ..errors import HybridEmbedError
from . import wire
from .wire import Message

__all__ = ["ServerLink", "TrainerLink", "ServerLost"]

REQ_HEAD, REQ_BODY, REP_HEAD, REP_BODY = 4101, 4102, 4103, 4104


class ServerLost(HybridEmbedError):
    """A parameter server did not answer: it died, hung, or the job is being torn down."""


class _Sends:
    """Sends in flight, with the tensors they read (kept alive until sent)."""

    def __init__(self) -> None:
        self.works: list[tuple[object, torch.Tensor]] = []

    def add(self, dst: int, t: torch.Tensor, tag: int, group) -> None:
        self.works.append((dist.isend(t, dst, group=group, tag=tag), t))
        if len(self.works) > 64:
            self.prune()

    def prune(self) -> None:
        self.works = [(w, t) for w, t in self.works if not w.is_completed()]

    def wait(self) -> None:
        for w, _ in self.works:
            w.wait()
        self.works = []


class ServerLink:
    """A server's end: requests from any trainer, replies to one."""

    def __init__(self, group, limit: int):
        self.group, self.limit = group, limit
        self.sends = _Sends()

    def recv(self) -> tuple[int, torch.Tensor, torch.Tensor | None]:
        """The next request: (trainer rank, header, payload or None). A header that fails its
        check comes back without its payload (the sender sends none): the handler answers it."""
        h = torch.empty(wire.HEAD, dtype=torch.int64)
        src = dist.recv(h, src=None, group=self.group, tag=REQ_HEAD)
        try:
            nbytes = wire.check_header(h, self.limit)
        except wire.WireError:
            return src, h, None
        payload = None
        if nbytes:
            payload = torch.empty(nbytes, dtype=torch.uint8)
            dist.recv(payload, src=src, group=self.group, tag=REQ_BODY)
        return src, h, payload

    def reply(self, dst: int, m: Message) -> int:
        h, p = wire.pack(m)
        self.sends.add(dst, h, REP_HEAD, self.group)
        if p is not None:
            self.sends.add(dst, p, REP_BODY, self.group)
        return 8 * wire.HEAD + (0 if p is None else p.numel())


class TrainerLink:
    """A trainer's end of one server: requests out, replies back, each wait bounded."""

    def __init__(self, group, server: int, timeout: float, limit: int):
        self.group, self.server, self.limit = group, server, limit
        self.timeout = datetime.timedelta(seconds=timeout)
        self.seconds = timeout
        self.sends = _Sends()
        self.bytes_out = self.bytes_in = 0

    def send(self, m: Message) -> None:
        h, p = wire.pack(m)
        size = 0 if p is None else p.numel()
        if size > self.limit:
            raise HybridEmbedError(
                f"a {wire.OPS.get(m.op, m.op)} request of {size} bytes is over the servers' limit of {self.limit} "
                "bytes (max_request_bytes): use smaller batches or raise the limit"
            )
        try:
            self.sends.add(self.server, h, REQ_HEAD, self.group)
            if p is not None:
                self.sends.add(self.server, p, REQ_BODY, self.group)
        except RuntimeError as e:
            raise self._lost(e) from None
        self.bytes_out += 8 * wire.HEAD + size

    def recv(self) -> Message:
        """The server's next reply (any request's)."""
        try:
            h = torch.empty(wire.HEAD, dtype=torch.int64)
            dist.irecv(h, self.server, group=self.group, tag=REP_HEAD).wait(self.timeout)
            nbytes = wire.check_header(h, 1 << 62, replies=True)
            payload = None
            if nbytes:
                payload = torch.empty(nbytes, dtype=torch.uint8)
                dist.irecv(payload, self.server, group=self.group, tag=REP_BODY).wait(self.timeout)
        except RuntimeError as e:
            raise self._lost(e) from None
        self.bytes_in += 8 * wire.HEAD + (0 if payload is None else payload.numel())
        return wire.unpack(h, payload, 1 << 62, replies=True)

    def _lost(self, e: BaseException) -> ServerLost:
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        why = "did not answer within the timeout" if "Timed out" in text else "is gone (its connection closed)"
        return ServerLost(
            f"parameter server rank {self.server} {why}: {text[:200]}. Timeout: {self.seconds:g} s "
            "(he.distribute(..., ps_timeout=...)); a restart resumes from the last committed checkpoint"
        )

    def close(self) -> None:
        try:
            self.sends.wait()
        except RuntimeError:
            pass
