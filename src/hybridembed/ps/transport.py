"""Messages between trainers and servers over c10d point-to-point (gloo: host tensors).

Tags keep the three streams apart: requests (one frame each, :func:`~hybridembed.ps.wire.frame`;
a server receives them from any trainer), reply headers and reply payloads (each from one known
peer). A server's replies and a trainer's requests are sent without blocking (``isend``), and
their buffers are kept until sent (at most ``_Sends.KEEP`` of them: older sends are waited for).

Timeouts and failures:

- A trainer waits for each reply at most ``timeout`` seconds (``he.distribute(...,
  ps_timeout=...)``, by default the job's timeout). A server that died fails the wait at once
  (its connection closes); one that stopped or hangs fails it after ``timeout``. Either way the
  trainer raises :class:`ServerLost` naming the server rank (and whether its heartbeat still
  beats); gloo then marks the whole group broken, so the job ends and a restart resumes from
  the last committed checkpoint (``he.load``).
- A server's receive is not bounded by a timeout (gloo closes a connection whose receive timed
  out): trainers may spend long between requests (evaluation, a slow input pipeline, a
  checkpoint). :func:`hybridembed.ps.serve` receives in a thread of its own and watches the
  trainers' heartbeats (:mod:`hybridembed.distributed.health`) meanwhile: a trainer that died,
  stopped or left without a goodbye (it destroyed its process group, or its process ended) is
  noticed within seconds, and the server tells the other trainers and exits.

Malformed requests: a server receives each request whole into a buffer of the largest frame
``max_request_bytes`` allows and checks it (:func:`~hybridembed.ps.wire.unframe`: the header's
magic, op, sizes and dtype, then that the frame ends exactly where its header says) before it
parses a byte of payload; a frame that fails is answered with an error reply. A request whose
frame passes but whose content is wrong (its payload does not parse, unknown shards or tables,
ids out of range, gradients that do not match the ids or are not finite, a push of another step
than the trainer's next, a pull more than one step ahead, hyper-parameters its optimizer
refuses, a sender that is not a trainer) is answered with an error reply (meta ``{"error":
text}``, naming the server rank and the fault) and changes nothing: no row, optimizer state or
step counter. A trainer raises the error at the wait for that reply; a refused push (which has
no reply otherwise) at its next wait. The trainers' and servers' ``max_request_bytes`` are
agreed at setup, so :class:`TrainerLink` never sends a frame a server cannot receive; a
message longer than a server's buffer (only a process outside this library could send one)
cannot be framed by gloo and aborts the server: see docs/distributed.md, "Trust model".
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ..distributed.health import RankLost, diagnose
from ..errors import HybridEmbedError
from ..utils import get_logger
from . import wire
from .wire import Message

__all__ = ["ServerLink", "TrainerLink", "ServerLost"]

log = get_logger(__name__)

REQ, REP_HEAD, REP_BODY = 4101, 4103, 4104  # a request's frame; a reply's header, payload
SERVER_WAIT = datetime.timedelta(days=7)  # a server's wait for requests (see ServerLink)


class ServerLost(RankLost):
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
    """A server's end: requests from any trainer (one frame each), replies to one."""

    def __init__(self, group, limit: int):
        self.group, self.limit = group, limit
        self.sends = _Sends()
        self._buf: torch.Tensor | None = None

    def recv(self) -> tuple[int, torch.Tensor, torch.Tensor | None]:
        """The next request: (trainer rank, header, payload or None: a copy, the buffer is reused).
        A frame that fails its checks comes back as (trainer, the header as received or zeros,
        :class:`~hybridembed.ps.wire.WireError`): the handler answers it. Raises RuntimeError when
        the group fails (a trainer's connection closed)."""
        if self._buf is None:  # (one buffer for every request: its pages are touched only as far as they are used)
            self._buf = torch.empty(wire.frame_bytes(self.limit), dtype=torch.uint8)
        buf = self._buf
        buf[: wire.NONCE + 8 * wire.HEAD].zero_()
        work = dist.irecv(buf, src=None, group=self.group, tag=REQ)
        work.wait(SERVER_WAIT)  # (liveness is watched by serve(), with the trainers' heartbeats)
        src = work._source_rank()
        try:
            h, payload = wire.unframe(buf, self.limit)
        except wire.WireError as e:
            log.warning("parameter server: a malformed request from trainer %d: %s", src, e)
            header = e.header if e.header is not None else torch.zeros(wire.HEAD, dtype=torch.int64)
            return src, header, e
        return src, h, None if payload is None else payload.clone()

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
        f = wire.frame(m)
        size = f.numel() - wire.frame_bytes(0)
        if size > self.limit:
            raise HybridEmbedError(
                f"a {wire.OPS.get(m.op, m.op)} request of {size} bytes is over the servers' limit of {self.limit} "
                "bytes (max_request_bytes): use smaller batches or raise the limit"
            )
        try:
            self.sends.add(self.server, f, REQ, self.group)
        except RuntimeError as e:
            raise self._lost(e) from None
        self.bytes_out += f.numel()

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
        state = {}
        if "Timed out" in text:  # (the server, or a trainer a synchronous step waits for: the job's ranks)
            me = dist.get_rank(self.group)
            state = diagnose(
                dist.get_global_rank(self.group, r) for r in range(dist.get_world_size(self.group)) if r != me
            )
        seen = (
            f" ({'; '.join(f'rank {r} {why}' if r >= 0 else why for r, why in sorted(state.items()))})" if state else ""
        )
        return ServerLost(
            f"parameter server rank {self.server} {why}{seen}: {text[:200]}. Timeout: {self.seconds:g} s "
            "(he.distribute(..., ps_timeout=...)); a restart resumes from the last committed checkpoint",
            [self.server, *(r for r in state if r >= 0)],
        )

    def close(self) -> None:
        try:
            self.sends.wait()
        except RuntimeError:
            pass
