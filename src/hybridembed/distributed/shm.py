"""The all-to-alls of ranks of one machine on gloo, through shared memory.

Gloo moves an all-to-all between processes of one machine through loopback sockets: the sender's
bytes are copied into the kernel and out again, by gloo's threads, on the cores the ranks compute
on, and a collective costs 0.5-1.0 ms after its last rank comes (p90 ~4 ms on the 2-core machine
of ``docs/benchmarks.md``). Here each rank writes what it sends into a file of ``/dev/shm`` it
owns, the ranks meet, and each copies what is its own straight out of the others' files: one copy
each way, no socket. World 2: a 27 MB all-to-all 17.6-18.7 ms through gloo, 9.0-12.2 ms so.

The meeting (which also carries each rank's status): where every rank can wait on a futex (Linux,
x86-64) and sees every peer's process, through the ranks' control files (:meth:`Transport._ring`:
0.1 ms after the last rank comes); else a one-element gloo all-gather.

Used by the sharded runtime's exchanges when every rank of its group is a process of this machine
(same boot, each maps the others' files: checked once, at the first exchange), its tensors are
on the CPU and its backend is gloo: the rows' exchange (forward rows, backward gradients) where it
is large (more than :data:`~hybridembed.distributed.exchange.FOLD_ROWS` row elements for some
rank), the sum of replicated tables' row gradients (:meth:`Transport.all_gather`: every rank's
touched rows, read where they lie), and, where the meetings go through the control files, every
other all-to-all of the group (headers, ids, small rows: :func:`~.exchange.through_shared`).
``HYBRIDEMBED_SHM=0`` turns it off, ``HYBRIDEMBED_SHM_FUTEX=0`` keeps the meetings and the small
exchanges on gloo. Every rank takes the same path for every exchange: the choice is made from what
every rank knows (the transport's agreement when it opens, the headers' row counts).

Files: two per rank (one for each parity of the calls: a rank writes call n + 1 while a slower
peer may still read call n), grown when a call needs more, their pages reserved when made (a full
``/dev/shm``, as a container's small default, fails there and not with SIGBUS at a write: every
rank then sends through gloo from that exchange on, told by the meeting, with one warning), named
``hybridembed-<pid>-<start>-<job>-<rank>-<parity>-<generation>``; a file's name is removed as soon as every
peer has mapped it (the call after it first carried data), so a killed job leaves at most the files
of its last growth, and those of processes that no longer run are removed (a minute on) when a
transport opens. A peer that died or hangs fails the meeting as it would fail gloo's all-to-all
(:class:`~hybridembed.RankLost` naming it: a peer whose process ended at once, one that stopped
when the group's timeout has passed).
"""

from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os
import platform
import re
import secrets
import socket
import sys
import time
import weakref

import numpy as np
import torch
import torch.distributed as dist

from .. import _env
from ..errors import HybridEmbedError
from ..utils import get_logger
from . import health
from .exchange import gloo_all_to_all, lost_peer

__all__ = ["Transport", "ENV"]

_log = get_logger(__name__)

ENV = _env.PREFIX + "SHM"  # "0": never (every exchange through gloo)
DIR = "/dev/shm"
_CONTROL = 4  # int64s per (parity, peer) in a rank's control file: generation, offset, bytes, call
_BELL = 5  # int64s after them: the rank's count of meetings (its low 32 bits a futex word), per parity (status, failed)
_WAIT_SLICE = 0.02  # seconds a meeting's wait sleeps at most before it looks whether the peer's process runs
_NAME = re.compile(r"hybridembed-(\d+)-\d+-[0-9a-f]+-\d+-(?:[01]-\d+|c)")
_CLOSE_WAIT = 10.0  # seconds a closing rank waits for its peers to map its last call's files
_STALE = 60.0  # seconds: a file younger than this is never swept (a process of another PID namespace may run)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _sweep() -> None:
    """Removes the files of processes that no longer run (a job killed mid-growth)."""
    try:
        names = os.listdir(DIR)
    except OSError:
        return
    uid = os.getuid()
    for name in names:
        m = _NAME.fullmatch(name)
        if m is None:
            continue
        path = os.path.join(DIR, name)
        try:
            st = os.stat(path)
            if st.st_uid != uid or time.time() - st.st_mtime < _STALE:
                continue
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
            except OSError:
                pass
        except OSError:
            continue


def _stat(pid: int) -> tuple[bytes, int] | None:
    """Process ``pid``'s state letter and start time (clock ticks after boot), from ``/proc``; None where unread."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _runs(prefix: str) -> bool:
    """Whether the process that made files named ``prefix`` (``hybridembed-PID-START-TOKEN``) still runs:
    a zombie, ended but not yet collected by its parent, has not; nor has a process that holds its PID
    but started at another time (the PID taken again, or a process of another PID namespace)."""
    try:
        parts = prefix.split("-")
        pid, start = int(parts[1]), (int(parts[2]) or None) if len(parts) > 3 else None  # (0: not known)
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError, IndexError):
        return True
    got = _stat(pid)
    return got is None or (got[0] != b"Z" and (start is None or got[1] == start))


def _unlink(names: list[str]) -> None:
    for name in names:
        try:
            os.unlink(name)
        except OSError:
            pass


def _control_bytes(world: int) -> int:
    return (2 * world * _CONTROL + _BELL + 1) * 8  # (and last, the call whose peers' files this rank has mapped)


class _Futex:
    """Linux's futex on a word of shared memory: a meeting's wait sleeps in the kernel until the
    peer's count changes (FUTEX_WAIT) and the peer wakes it (FUTEX_WAKE); x86-64 only (stores seen
    in program order, so a peer that reads the count reads the status written before it)."""

    _SYS = 202  # SYS_futex on x86-64
    _WAIT, _WAKE = 0, 1  # (shared, not FUTEX_PRIVATE_FLAG: the word is in a file mapped by other processes)

    def __init__(self) -> None:
        self._call = None
        if (
            sys.platform == "linux"
            and platform.machine() in ("x86_64", "AMD64")
            and ctypes.sizeof(ctypes.c_void_p) == 8
        ):
            try:
                fn = ctypes.CDLL(None, use_errno=True).syscall
            except (OSError, AttributeError):
                return
            fn.restype = ctypes.c_long
            word = ctypes.c_int32(0)  # (the calls tried once: a sandbox may refuse them)
            addr = ctypes.addressof(word)
            woke = fn(self._SYS, ctypes.c_void_p(addr), self._WAKE, ctypes.c_int(1), None, None, 0)
            waited = fn(self._SYS, ctypes.c_void_p(addr), self._WAIT, ctypes.c_int(1), None, None, 0)
            if woke == 0 and waited == -1 and ctypes.get_errno() == errno.EAGAIN:  # (the word is not 1)
                self._call = fn

    @property
    def works(self) -> bool:
        return self._call is not None

    def wait(self, addr: int, value: int, seconds: float) -> None:
        """Sleeps while the int32 at ``addr`` holds ``value``, at most ``seconds`` (or a signal)."""
        whole = int(seconds)
        ts = (ctypes.c_long * 2)(whole, int((seconds - whole) * 1e9))
        self._call(self._SYS, ctypes.c_void_p(addr), self._WAIT, ctypes.c_int(value), ts, None, 0)

    def wake(self, addr: int) -> None:
        self._call(self._SYS, ctypes.c_void_p(addr), self._WAKE, ctypes.c_int(2**31 - 1), None, None, 0)


_FUTEX = _Futex()


def _map(path: str, nbytes: int, create: bool) -> torch.Tensor:
    """A (nbytes,) uint8 tensor over the file at ``path`` (made, of that size, when ``create``)."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:  # (its pages reserved now: a full /dev/shm fails here, not with SIGBUS at a write)
            os.posix_fallocate(fd, 0, nbytes)
        elif os.fstat(fd).st_size < nbytes:
            raise OSError(f"{path}: {os.fstat(fd).st_size} bytes, expected {nbytes}")
        buf = mmap.mmap(fd, nbytes)
    except OSError:
        if create:
            os.unlink(path)
        raise
    finally:
        os.close(fd)
    return torch.frombuffer(buf, dtype=torch.uint8)


def _copy_pieces(src: list[torch.Tensor], dst: list[torch.Tensor]) -> None:
    """The elements of ``src``'s pieces, in order, into ``dst``'s pieces, in order (one side is one
    flat piece, or both are the same pieces)."""
    if len(src) == 1 and src[0].dim() == 1:
        k, flat = 0, src[0]
        for d in dst:
            d.copy_(flat[k : k + d.numel()].view(d.shape))
            k += d.numel()
    elif len(dst) == 1 and dst[0].dim() == 1:
        k, flat = 0, dst[0]
        for x in src:
            flat[k : k + x.numel()].view(x.shape).copy_(x)
            k += x.numel()
    else:
        for x, d in zip(src, dst, strict=True):
            d.copy_(x)


def _spans(pieces: list[torch.Tensor], shapes: list[tuple[int, ...]]) -> list[int]:
    """Where each piece of a gather starts in its rank's bytes (after the pieces' first dimensions
    as int64s; each piece at a multiple of 64 bytes), and their end: (P + 1,). ``shapes``: the
    pieces' shapes on the rank that wrote them (``pieces``: this rank's, for their dtypes)."""
    at, out = 8 * len(pieces), []
    for p, shape in zip(pieces, shapes):
        at = -(-at // 64) * 64
        out.append(at)
        at += math.prod(shape) * p.element_size()
    return [*out, at]


def _pack(data: torch.Tensor, pieces: list[torch.Tensor]) -> None:
    """``pieces`` (any strides) into the bytes ``data`` as a gather lays them out (:func:`_spans`)."""
    data[: 8 * len(pieces)].view(torch.int64).copy_(torch.tensor([p.shape[0] for p in pieces], dtype=torch.int64))
    for p, at in zip(pieces, _spans(pieces, [tuple(p.shape) for p in pieces])):
        data[at : at + p.numel() * p.element_size()].view(p.dtype).view(p.shape).copy_(p)


def _unpack(raw: torch.Tensor, pieces: list[torch.Tensor], rank: int, q: int) -> list[torch.Tensor]:
    """Rank ``q``'s pieces, views of its bytes ``raw`` (checked: as many bytes as ``pieces``, this
    rank's, of the same dtypes and other dimensions, taken with ``q``'s first dimensions)."""
    if raw.numel() < 8 * len(pieces):
        raise HybridEmbedError(f"rank {rank}: rank {q}'s gather holds {raw.numel()} bytes, too few for its counts")
    counts = raw[: 8 * len(pieces)].view(torch.int64).tolist()
    shapes = [(n, *p.shape[1:]) for n, p in zip(counts, pieces)]
    where = _spans(pieces, shapes)
    if where[-1] != raw.numel():
        raise HybridEmbedError(
            f"rank {rank}: rank {q}'s pieces in the shared-memory gather are not this rank's ({raw.numel()} bytes "
            f"for counts {counts}; this rank's pieces: {[(p.dtype, tuple(p.shape[1:])) for p in pieces]})"
        )
    return [
        raw[at : at + math.prod(shape) * p.element_size()].view(p.dtype).view(shape)
        for p, at, shape in zip(pieces, where, shapes)
    ]


class Transport:
    """Shared-memory all-to-all over the ranks of ``group`` (all on this machine): see the module.

    Make it with :meth:`open` (collective: every rank of ``group`` calls it); ``None`` where the
    ranks cannot share memory. :meth:`all_to_all` is collective too, and every rank must choose it
    for the same calls."""

    def __init__(
        self, group, rank: int, world: int, prefixes: list[str], control: list[torch.Tensor], bell: bool = False
    ) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.prefixes, self.control = prefixes, control  # every rank's names; its control file, mapped
        self.calls = 0
        # the meetings: through the control files, a futex a rank (bell), or gloo's all-gather
        at = 2 * world * _CONTROL
        self._bells = [c[at : at + _BELL].numpy() for c in control] if bell else None
        self._meets = 0
        self._mine: list[tuple[int, torch.Tensor | None]] = [(0, None), (0, None)]  # per parity: (gen, data)
        self._theirs: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}  # (peer, parity) -> (gen, data)
        self._unlink: list[str] = []  # names every peer will have mapped once the next meeting is passed
        self._fresh: list[str] = []
        self.broken = False  # some rank's shared memory failed (every rank knows): gloo from then on
        self._why: OSError | None = None
        self._pid = os.getpid()  # (a forked child, a data loader's worker, never removes this rank's files)
        self._lent: list[weakref.WeakMethod] = []  # see lend

    @classmethod
    def open(cls, group, device: torch.device) -> Transport | None:
        """Collective over ``group``: a transport when every rank is a process of this machine on
        gloo with CPU tensors and sees the others' files; ``None`` otherwise (exchanges stay on gloo)."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        ok = (
            world > 1
            and _env.flag("SHM", True)
            and torch.device(device).type == "cpu"
            and dist.get_backend(group) == "gloo"
            and os.path.isdir(DIR)
            and os.access(DIR, os.W_OK)
        )
        me = _stat(os.getpid())  # (its start time tells this process from a later one given its PID)
        prefix = f"hybridembed-{os.getpid()}-{me[1] if me else 0}-{secrets.token_hex(6)}"
        own, control = None, None
        if ok:
            _sweep()
            try:
                own = os.path.join(DIR, f"{prefix}-{rank}-c")
                control = _map(own, _control_bytes(world), True)
                control.view(torch.int64).fill_(-1)
                control.view(torch.int64)[2 * world * _CONTROL :][:_BELL] = 0  # (no meeting yet)
            except OSError:
                ok, own = False, None
        key = (socket.gethostname(), _boot_id(), prefix if ok else None)
        everyone: list = [None] * world
        dist.all_gather_object(everyone, key, group=group)
        ok = all(k[2] is not None and k[:2] == key[:2] for k in everyone)
        seen, maps = True, []
        if ok:
            try:  # each peer's control file, by the name its owner made
                maps = [
                    control.view(torch.int64)
                    if r == rank
                    else _map(os.path.join(DIR, f"{everyone[r][2]}-{r}-c"), _control_bytes(world), False).view(
                        torch.int64
                    )
                    for r in range(world)
                ]
            except OSError:
                seen = False
        # (the meetings through the control files where every rank can wait on a futex and sees every
        # peer's process: a wait notices a peer that is gone by its process)
        bell = ok and seen and _FUTEX.works and _env.flag("SHM_FUTEX", True) and all(_runs(k[2]) for k in everyone)
        verdict: list = [None] * world
        dist.all_gather_object(verdict, (ok and seen, bell), group=group)
        if own is not None:  # (every peer has mapped it, or will not use it)
            os.unlink(own)
        if not all(v[0] for v in verdict):
            return None
        bell = all(v[1] for v in verdict)
        return cls(group, rank, world, [k[2] for k in everyone], maps, bell)

    def close(self, wait: float = _CLOSE_WAIT) -> None:
        """Removes this rank's files that still have names (mappings end with their last tensor), once
        every peer has mapped them: the files of the last call may not be yet when this rank is done
        with it (a rank that ends its job while a peer still reads: waited for up to ``wait`` seconds,
        less for a peer whose process is gone). In a forked child of the rank, nothing."""
        if os.getpid() == self._pid and self._unlink:
            deadline = time.monotonic() + wait
            peers = [q for q in range(self.world) if q != self.rank]
            while peers and time.monotonic() < deadline:
                peers = [q for q in peers if int(self.control[q][-1]) < self.calls and _runs(self.prefixes[q])]
                if peers:
                    time.sleep(0.001)
            _unlink(self._unlink)
        self._unlink = []

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - (at interpreter exit, what close needs may be gone)
            pass

    def _segment(self, parity: int, nbytes: int) -> torch.Tensor:
        gen, data = self._mine[parity]
        if data is None or data.numel() < nbytes:
            gen += 1
            path = os.path.join(DIR, f"{self.prefixes[self.rank]}-{self.rank}-{parity}-{gen}")
            data = _map(path, max(nbytes + (nbytes >> 3), 1 << 20), True)
            self._mine[parity] = (gen, data)
            self._fresh.append(path)
        return data

    def lend(self, copy) -> None:
        """``copy`` (a bound method, held weakly) is called before this rank's next call on the transport,
        if its object still lives then: views of the peers' files kept past this call (a replicated
        table's rows, read by the update where they lie) are copied before a peer may write there again."""
        self._lent.append(weakref.WeakMethod(copy))

    def _call_back(self) -> None:
        lent, self._lent = self._lent, []
        for ref in lent:
            if (fn := ref()) is not None:
                fn()

    def all_to_all(self, out, t, recv_splits, send_splits, status: float = 1.0, meanwhile=None) -> list[float]:
        """``all_to_all_single(out, t, recv_splits, send_splits)`` through shared memory; returns every
        rank's ``status`` (the meeting's payload). ``t`` may also be, per rank, a list of tensors
        (any shapes and strides) that are its piece in order, and ``out``, per rank, a list of
        tensors to fill in order (not both): each element is then copied once, straight where it goes
        (``out[rank]`` None: this rank's own part is not copied). ``meanwhile``: a function called
        once this rank's pieces are written, before the meeting (it meets whatever the function did)."""
        self._call_back()
        parity, self.calls = self.calls & 1, self.calls + 1
        self._fresh = []
        sends = t.split(list(send_splits)) if isinstance(t, torch.Tensor) else None
        recvs = out.split(list(recv_splits)) if isinstance(out, torch.Tensor) else None
        src = [[x] for x in sends] if sends is not None else t
        dst = [[x] for x in recvs] if recvs is not None else out
        dtype = t.dtype if sends is not None else out.dtype  # (one side is flat)
        item = t.element_size() if sends is not None else out.element_size()
        need = sum(n for r, n in enumerate(send_splits) if r != self.rank) * item
        data = None
        if not self.broken:
            try:
                data = self._segment(parity, need)
            except OSError as e:  # (/dev/shm full: every rank goes through gloo from now on, below)
                self._why = e
        if data is not None:
            gen = self._mine[parity][0]
            ctl = self._table(self.rank)[parity]
            at = 0
            for r in range(self.world):
                if r == self.rank:
                    if dst[r] is not None:  # (None: the caller takes its own part itself)
                        _copy_pieces(src[r], dst[r])
                    continue
                start = at
                for x in src[r]:
                    n = x.numel() * item
                    data[at : at + n].view(x.dtype).view(x.shape).copy_(x)
                    at += n
                if at - start != send_splits[r] * item:
                    raise ValueError(
                        f"rank {self.rank}: {(at - start) // item} elements for rank {r}, split {send_splits[r]}"
                    )
                ctl[r] = torch.tensor([gen, start, at - start, self.calls])
        failure = None
        if meanwhile is not None:
            try:
                meanwhile()
            except BaseException as e:  # noqa: BLE001 - (raised once this call is done here as on every rank)
                failure = e
        statuses, broken = self._meet(status, data is None)
        _unlink(self._unlink)  # (every peer has read the call that first used them: mapped)
        self._unlink = self._fresh
        if broken:
            self._give_up(broken)
            self._gloo(out, t, src, dst, recv_splits, send_splits)
        else:
            for q in range(self.world):
                if q != self.rank and recv_splits[q]:
                    _copy_pieces([self._peer(q, parity, recv_splits[q] * item).view(dtype)], dst[q])
                elif q != self.rank:
                    self._peer(q, parity, 0)  # (checked: in step, nothing for this rank)
            self.control[self.rank][-1] = self.calls  # (this call's files mapped: see close)
        if failure is not None:
            raise failure
        return statuses

    def all_gather(self, pieces: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Every rank's ``pieces`` (tensors of at least one dimension; the first may differ between
        ranks; every rank gives as many, of the same dtypes and other dimensions, in the same order):
        per rank, its pieces. This rank's are the tensors given; a peer's are views of its file,
        valid until this rank's next call on the transport (the peer's next write to that file waits
        for a meeting this rank joins; :meth:`lend` keeps them longer). Each rank writes its pieces once,
        whatever the world size."""
        self._call_back()
        if self.broken:
            return self._gather_through_gloo(pieces)
        parity, self.calls = self.calls & 1, self.calls + 1
        self._fresh = []
        nbytes = _spans(pieces, [tuple(p.shape) for p in pieces])[-1]
        data = None
        try:
            data = self._segment(parity, nbytes)
        except OSError as e:
            self._why = e
        if data is not None:
            _pack(data, pieces)
            ctl = self._table(self.rank)[parity]
            ctl[:] = torch.tensor([self._mine[parity][0], 0, nbytes, self.calls])
        _, broken = self._meet(1.0, data is None)
        _unlink(self._unlink)
        self._unlink = self._fresh
        if broken:
            self._give_up(broken)
            return self._gather_through_gloo(pieces)
        raw = [None if q == self.rank else self._peer(q, parity, None) for q in range(self.world)]
        self.control[self.rank][-1] = self.calls  # (this call's files mapped: see close)
        return [list(pieces) if q == self.rank else _unpack(raw[q], pieces, self.rank, q) for q in range(self.world)]

    def _gather_through_gloo(self, pieces: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """:meth:`all_gather` through gloo (the shared memory given up): the pieces' bytes, padded to
        the largest rank's."""
        mine = torch.zeros(_spans(pieces, [tuple(p.shape) for p in pieces])[-1], dtype=torch.uint8)
        _pack(mine, pieces)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        try:
            dist.all_gather(sizes, torch.tensor([mine.numel()]), group=self.group)
            most = max(int(x) for x in sizes)
            every = torch.zeros(self.world * most, dtype=torch.uint8)
            dist.all_gather_into_tensor(every, torch.cat([mine, mine.new_zeros(most - mine.numel())]), group=self.group)
        except RuntimeError as e:
            raise lost_peer(e, self.group) from None
        return [
            list(pieces)
            if q == self.rank
            else _unpack(every[q * most : q * most + int(sizes[q])], pieces, self.rank, q)
            for q in range(self.world)
        ]

    def _peer(self, q: int, parity: int, want: int | None) -> torch.Tensor:
        """The bytes rank ``q`` wrote for this rank in this call (checked against ``want``: a number
        of bytes, or None for any)."""
        g, off, n, call = self._table(q)[parity][self.rank].tolist()
        if call != self.calls or (want is not None and n != want):
            raise HybridEmbedError(
                f"rank {self.rank}: the shared-memory exchange with rank {q} is out of step (call {call} "
                f"sending {n} bytes, expected call {self.calls} of {want} bytes)"
            )
        have = self._theirs.get((q, parity))
        if have is None or have[0] != g:
            path = os.path.join(DIR, f"{self.prefixes[q]}-{q}-{parity}-{g}")
            have = (g, _map(path, os.stat(path).st_size, False))
            self._theirs[(q, parity)] = have
        return have[1][off : off + n]

    def _give_up(self, broken: list[int]) -> None:
        """Some rank's shared memory failed (every rank learnt it in the meeting): gloo from now on."""
        if not self.broken:
            self.broken = True
            _log.warning(
                "the embedding exchange's shared memory failed on rank(s) %s (this rank: %s); the rows go "
                "through gloo from now on (a container's /dev/shm may be small: docker --shm-size)",
                ", ".join(map(str, broken)),
                self._why or "fine",
            )
        self.close(wait=0)  # (no peer reads this rank's files any more)
        self._mine, self._theirs = [(0, None), (0, None)], {}

    @property
    def rings(self) -> bool:
        """Whether the meetings go through the control files (:meth:`_ring`), not gloo."""
        return self._bells is not None

    def _table(self, r: int) -> torch.Tensor:
        """Rank ``r``'s control table: (parity, peer, (generation, offset, bytes, call))."""
        return self.control[r][: 2 * self.world * _CONTROL].view(2, self.world, _CONTROL)

    def _meet(self, status: float, failed: bool) -> tuple[list[float], list[int]]:
        """The ranks' meeting: after it every rank's writes of this call are done (and each peer has
        read the call before it); its payload is every rank's ``status`` and whether its shared
        memory failed. Returns (the statuses, the ranks whose shared memory failed).

        Through the control files where every rank can (:meth:`_ring`), else gloo's all-gather."""
        if self._bells is not None:
            return self._ring(status, failed)
        mine = torch.tensor([status, float(failed or self.broken)], dtype=torch.float32)
        got = [torch.empty(2, dtype=torch.float32) for _ in range(self.world)]
        try:
            dist.all_gather(got, mine, group=self.group)
        except RuntimeError as e:
            raise lost_peer(e, self.group) from None
        rows = torch.stack(got).tolist()
        return [s for s, _ in rows], [r for r, (_, f) in enumerate(rows) if f]

    def _ring(self, status: float, failed: bool) -> tuple[list[float], list[int]]:
        """:meth:`_meet` through the control files: this rank writes its payload for this meeting
        (beside the last one's, which a slow peer may still read), then its count of meetings, and
        wakes whoever waits on it; then waits for every peer's count to reach this meeting (it is
        at most one ahead), asleep on the peer's count (a futex). Gloo's all-gather of a few bytes
        took 0.6-1.0 ms (p90 ~4 ms) after the last rank came, here 0.07 ms (docs/benchmarks.md,
        "Meetings through the control files"). A peer whose process ends, or that has not come
        within the group's timeout, fails the wait as it fails gloo's (:class:`~hybridembed.RankLost`)."""
        self._meets += 1
        count, par = self._meets & 0x7FFFFFFF, self._meets & 1
        mine = self._bells[self.rank]
        mine[1 + 2 * par : 3 + 2 * par] = (
            np.array([status], np.float64).view(np.int64)[0],
            int(failed or self.broken),
        )
        mine[:1].view(np.int32)[0] = count  # (after the payload: x86-64 stores are seen in order)
        _FUTEX.wake(mine.ctypes.data)
        for q in range(self.world):
            if q != self.rank:
                self._await(q, count)
        rows = [self._bells[q][1 + 2 * par : 3 + 2 * par] for q in range(self.world)]
        return [float(r[:1].view(np.float64)[0]) for r in rows], [q for q, r in enumerate(rows) if r[1]]

    def _await(self, q: int, count: int) -> None:
        """Until peer ``q``'s count of meetings reaches ``count`` (or one past it)."""
        word = self._bells[q][:1].view(np.int32)
        addr, deadline = word.ctypes.data, None
        while True:
            seen = int(word[0])
            if seen == count or seen == (count + 1) & 0x7FFFFFFF:
                return
            if deadline is not None:  # (woken without its count, or the slice passed)
                if not _runs(self.prefixes[q]):
                    raise lost_peer(RuntimeError(f"rank {q}'s process ended"), self.group)
                if time.monotonic() > deadline:
                    raise lost_peer(RuntimeError(f"timed out waiting for rank {q} in a meeting"), self.group)
            else:
                deadline = time.monotonic() + health.job_timeout(self.group).total_seconds()
            _FUTEX.wait(addr, seen, _WAIT_SLICE)

    def _gloo(self, out, t, src, dst, recv_splits, send_splits) -> None:
        """This call through gloo's all-to-all (every rank's shared memory given up)."""
        flat_t = t.contiguous() if isinstance(t, torch.Tensor) else torch.cat([x.reshape(-1) for p in src for x in p])
        flat_out = out if isinstance(out, torch.Tensor) else flat_t.new_empty(sum(recv_splits))
        gloo_all_to_all(flat_out, flat_t, list(recv_splits), list(send_splits), self.group)
        if not isinstance(out, torch.Tensor):
            for piece, d in zip(flat_out.split(list(recv_splits)), dst):
                if d is not None:
                    _copy_pieces([piece], d)
