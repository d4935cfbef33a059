"""Messages between trainers and servers over c10d point-to-point (gloo: host tensors).

Tags keep the four streams apart: request headers (a server receives them from any
trainer), request payloads, reply headers and reply payloads (each from one known peer). A
server's replies and a trainer's requests are sent without blocking (``isend``), and their
buffers are kept until sent (at most ``_Sends.KEEP`` of them: older sends are waited for).

Timeouts and failures:

- A trainer waits for each reply at most ``timeout`` seconds (``he.distribute(...,
  ps_timeout=300.0)``, also the dedicated group's timeout). A server that died fails the
  wait at once (its connection closes); one that hangs fails it after ``timeout``. Either
  way the trainer raises :class:`ServerLost` naming the server rank; gloo then marks the
  whole group broken, so the job ends and a restart resumes from the last committed
  checkpoint (``he.load``).
- A server waits for the next request up to ``SERVER_WAIT`` (7 days), not ``timeout``:
  trainers may spend longer than ``ps_timeout`` between requests (evaluation, a slow input
  pipeline, a checkpoint). A trainer that dies fails the server's wait (its connection
  closes): the server raises (it cannot complete the steps that trainer owes).

Malformed requests: a server checks each header (:func:`~hybridembed.ps.wire.check_header`:
magic, op, sizes within ``max_request_bytes``, dtype) before it reads any payload; a header
that fails is answered with an error reply at once, and its sender sends no payload (the
trainer's :meth:`TrainerLink.send` refuses a request over the limit before sending
anything). A request whose header passes but whose content is wrong (its payload does not
parse, unknown shards or tables, ids out of range, gradients that do not match the ids or
are not finite, a push of another step than the trainer's next, a pull more than one step
ahead, hyper-parameters its optimizer refuses, a sender that is not a trainer) is answered
with an error reply (meta ``{"error": text}``, naming the server rank and the fault) and
changes nothing: no row, optimizer state or step counter. A trainer raises the error at the
wait for that reply; a refused push (which has no reply otherwise) at its next wait. A
payload shorter than its header declares is detected (a canary at the buffer's end) and
answered with an error; a longer one cannot be framed over gloo (it aborts the server's
process); :class:`TrainerLink` never sends either.
"""

from __future__ import annotations

import datetime
import random

import torch
import torch.distributed as dist

from ..errors import HybridEmbedError
from ..utils import get_logger
from . import wire
from .wire import Message

__all__ = ["ServerLink", "TrainerLink", "ServerLost"]

log = get_logger(__name__)

REQ_HEAD, REQ_BODY, REP_HEAD, REP_BODY = 4101, 4102, 4103, 4104
SERVER_WAIT = datetime.timedelta(days=7)  # a server's wait for requests (see ServerLink)


class ServerLost(HybridEmbedError):
    """A parameter server did not answer: it died, hung, or the job is being torn down."""


class _Sends:
    """Sends in flight, with the tensors they read (kept alive until sent).

    A gloo send's work reports completion only once waited for, so beyond ``KEEP`` sends to
    one peer the oldest are waited for (that peer has read them long since: a trainer reads
    every reply, a server every request, in order) and dropped: memory stays bounded, and a
    peer that is slow to read holds up only its own sends."""

    KEEP = 64

    def __init__(self) -> None:
        self.works: dict[int, list[tuple[object, torch.Tensor]]] = {}

    def add(self, dst: int, t: torch.Tensor, tag: int, group) -> None:
        mine = self.works.setdefault(dst, [])
        mine.append((dist.isend(t, dst, group=group, tag=tag), t))
        if len(mine) > self.KEEP:
            old, self.works[dst] = mine[: -self.KEEP // 2], mine[-self.KEEP // 2 :]
            for w, _ in old:
                w.wait()

    def __len__(self) -> int:
        return sum(len(v) for v in self.works.values())

    def wait(self) -> None:
        for mine in self.works.values():
            for w, _ in mine:
                w.wait()
        self.works = {}


class ServerLink:
    """A server's end: requests from any trainer, replies to one."""

    def __init__(self, group, limit: int):
        self.group, self.limit = group, limit
        self.sends = _Sends()

    def recv(self) -> tuple[int, torch.Tensor, torch.Tensor | None]:
        """The next request: (trainer rank, header, payload or None). A header that fails its
        check comes back without its payload (the sender sends none): the handler answers it."""
        h = torch.empty(wire.HEAD, dtype=torch.int64)
        # (waits bounded by SERVER_WAIT, not by the group's timeout, which is the trainers' ps_timeout:
        # a trainer may spend longer than that between requests; a dead one fails the wait at once)
        work = dist.irecv(h, src=None, group=self.group, tag=REQ_HEAD)
        work.wait(SERVER_WAIT)
        src = work._source_rank()
        try:
            nbytes = wire.check_header(h, self.limit)
        except wire.WireError:
            return src, h, None
        payload = None
        if nbytes:
            # gloo fills a buffer with a shorter message and says nothing: the tail would be old
            # memory. A random canary in the last 8 bytes that is still there after the receive
            # (odds 2**-64 for a full payload) shows the payload was short.
            payload = torch.zeros(nbytes, dtype=torch.uint8)
            canary = None
            if nbytes >= 8:
                canary = torch.tensor([random.getrandbits(63)], dtype=torch.int64).view(torch.uint8)
                payload[-8:] = canary
            dist.irecv(payload, src=src, group=self.group, tag=REQ_BODY).wait(SERVER_WAIT)
            if canary is not None and torch.equal(payload[-8:], canary):
                log.warning(
                    "parameter server: trainer %d sent a payload shorter than its header's %d bytes", src, nbytes
                )
                return src, h, torch.zeros(0, dtype=torch.uint8)  # (answered: "payload of 0 bytes, the header says")
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
