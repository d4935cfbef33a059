"""``spawn``: run a function on N local processes of a fresh gloo (or NCCL) job, and return
what each rank returned, or raise the first rank's error; it always finishes.

What ``hybridembed train --nproc N`` uses when launched bare (no torchrun), and what the
multi-process tests use. A rank that raises reports its traceback; the others are stopped
after ``grace`` seconds instead of waiting in a collective for a peer that is gone; a job
that outlives ``timeout`` is stopped and reported.

The job listens on loopback only (docs/distributed.md, Trust model): rank 0 makes the rendezvous
store (a ``TCPStore``) on a socket bound to 127.0.0.1 (torch's own binds every interface,
whatever address it is given), and gloo's connections are pinned to the loopback interface
(``GLOO_SOCKET_IFNAME``, unless set).

    >>> from hybridembed.launch import spawn
    >>> import operator
    >>> spawn(operator.add, 2, 10)   # fn(rank, world_size, *args) on each rank  # doctest: +SKIP
    [10, 11]
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

from ..errors import HybridEmbedError

__all__ = ["spawn", "free_port", "loopback_interface", "loopback_store", "SpawnError"]

LOOPBACK = "127.0.0.1"
_IFF_LOOPBACK = 0x8  # <linux/if.h>


class SpawnError(HybridEmbedError):
    """A rank of a spawned job failed (its traceback is in the message) or the job timed out.

    ``rank``: the failing rank (-1: the job as a whole, e.g. a timeout); ``error``: the
    exception that rank raised, when it could be pickled back (None otherwise).
    """

    def __init__(self, message: str, rank: int = -1, error: BaseException | None = None):
        super().__init__(message)
        self.rank, self.error = rank, error


def free_port() -> int:
    """A TCP port the OS says is free now (for the job's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_interface() -> str | None:
    """The name of this machine's loopback network interface (``lo`` on Linux, ``lo0`` on macOS),
    for ``GLOO_SOCKET_IFNAME``; None when there is none to be found."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):  # (no if_nameindex on this platform)
        return None
    for name in names:  # Linux: the interface flagged IFF_LOOPBACK, whatever its name
        try:
            with open(f"/sys/class/net/{name}/flags") as f:
                if int(f.read().strip(), 16) & _IFF_LOOPBACK:
                    return name
        except (OSError, ValueError):
            break
    return next((n for n in ("lo", "lo0") if n in names), None)


def loopback_store(port: int, world: int, is_master: bool, timeout: timedelta, listening: int | None = None):
    """The job's ``TCPStore`` at 127.0.0.1:``port``; the master's listens on 127.0.0.1 alone
    (``listening``: a socket's descriptor already listening there, which the store takes: see
    :func:`_listen`).

    ``TCPStore(host_name="127.0.0.1", is_master=True)`` listens on every interface (``[::]``, both
    of torch's backends: the host name is only where clients connect), so the master's listening
    socket is made here, bound to 127.0.0.1, and handed over as ``master_listen_fd`` (which the
    libuv backend, torch's default, serves).
    """
    import torch.distributed as dist

    if not is_master:
        return dist.TCPStore(LOOPBACK, port, world, False, timeout=timeout)
    fd = _listen(port, world).detach() if listening is None else listening  # (the store owns it now: it closes it)
    try:
        return dist.TCPStore(LOOPBACK, port, world, True, timeout=timeout, master_listen_fd=fd, use_libuv=True)
    except BaseException:
        os.close(fd)
        raise


def _listen(port: int, world: int) -> socket.socket:
    """A socket listening on 127.0.0.1:``port`` (0: a port the OS picks) for a job of ``world`` ranks.

    ``spawn`` makes the job's before the ranks start and hands it to rank 0 (:class:`_Fd`): the port
    is held from the moment it is chosen, where a port found free and bound later by rank 0 could be
    taken in between (by another job's connection: "Address already in use")."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, port))
        sock.listen(max(world, 128))
    except BaseException:
        sock.close()
        raise
    return sock


class _Fd:
    """A file descriptor given to a rank: duplicated into it when ``Process.start`` pickles it
    (``multiprocessing.reduction.DupFd``); ``fd`` there is the rank's own."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return (_Fd._rebuilt, (reduction.DupFd(self.fd),))

    @staticmethod
    def _rebuilt(dup) -> _Fd:
        return _Fd(dup.detach())


class _Here:
    """The caller's stdout, stderr (file descriptors 1 and 2), environment and working directory, given to a rank
    forked from the forkserver (whose own are those of when it started): pickled by
    ``Process.start``, the descriptors travel with the rank (``multiprocessing.reduction.DupFd``).
    A descriptor closed in the caller (checked when made, before anything reuses its number) is
    not sent: the rank keeps the forkserver's."""

    def __init__(self) -> None:
        self.open = tuple(_is_open(fd) for fd in (1, 2))

    def __reduce__(self):
        from multiprocessing import reduction

        fds = tuple(reduction.DupFd(fd) if ok else None for fd, ok in zip((1, 2), self.open))
        return (_Here._rebuilt, (*fds, dict(os.environ), os.getcwd()))

    @staticmethod
    def _rebuilt(out, err, env: dict, cwd: str) -> _Here:
        here = _Here.__new__(_Here)
        here.fds, here.env = tuple(None if d is None else d.detach() for d in (out, err)), env
        here.cwd = cwd
        return here

    def apply(self) -> None:
        import sys

        for stream, fd, target in ((sys.stdout, self.fds[0], 1), (sys.stderr, self.fds[1], 2)):
            if fd is None or fd == target:
                continue
            if stream is not None:
                stream.flush()
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(self.env)
        try:
            os.chdir(self.cwd)
        except OSError:  # (the caller's directory is gone: the forkserver's stays)
            pass


def _exit_code(code: object) -> int:
    """``sys.exit(code)``'s exit status, as the interpreter makes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _run_as_main(fn: Callable[[], Any]) -> int:
    """``fn()`` run as the interpreter runs ``__main__``, in a process forked to be a script's or a
    command's own: an unhandled exception kept in ``sys.last_*`` and given to ``sys.excepthook``
    (status 1; the library's health hook reports it to the other ranks), ``sys.exit``'s status,
    then the interpreter's end: non-daemon threads joined and the ``atexit`` handlers run. Returns
    the exit status; the caller ends the process."""
    import atexit
    import threading

    code = 0
    try:
        fn()
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:  # (kept in sys.last_* until the end: what it references lives as long as it would)
        sys.last_type, sys.last_value, sys.last_traceback = sys.exc_info()
        sys.excepthook(sys.last_type, sys.last_value, sys.last_traceback)
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    return code


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _worker(rank, world, port, backend, pg_timeout, fn, args, results, threads, ifname, here=None, listening=None):
    if here is not None:  # (forked from the forkserver: this process's output and environment are the caller's)
        here.apply()
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    if ifname:  # gloo's pair connections on loopback (the caller's own value, when it set one)
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
        if "nccl" in backend:  # (NCCL's bootstrap sockets; its data stays on the node's own links)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", ifname)
    if threads:
        torch.set_num_threads(threads)
    try:
        timeout = timedelta(seconds=pg_timeout)
        store = loopback_store(port, world, rank == 0, timeout, None if listening is None else listening.fd)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        store.add("spawn/joined", 1)  # (see _all_joined)
        out = fn(rank, world, *args)
        # pickled to bytes here: a tensor put on a torch queue as is travels through shared memory
        # that dies with this process before the parent has read it
        results.put((rank, True, pickle.dumps(out)))
    except BaseException as e:  # reported, then this rank leaves (the others stop)
        from ..distributed.health import note_failure

        note_failure(e)  # (the other ranks' errors name this one and why; its servers hear it failed)
        try:  # the exception itself, for callers that tell usage errors from bugs
            exc = pickle.dumps(e)
        except Exception:
            exc = None
        results.put((rank, False, (f"{type(e).__name__}: {e}\n{traceback.format_exc()}", exc)))
    finally:
        if dist.is_initialized():
            if world > 1:
                _all_joined(store, world, min(pg_timeout, _STORE_WAIT_S))
            try:  # trainers of parameter servers leave first (the servers wait for them)
                from ..ps.collection import close_all

                close_all()
            except Exception:
                pass
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        if "store" in locals() and world > 1:
            _leave(store, rank, world, min(pg_timeout, _STORE_WAIT_S))


_STORE_WAIT_S = 30.0  # the most the store's host waits for the other ranks to finish


def _all_joined(store, world: int, wait_s: float) -> None:
    """Waits (at most ``wait_s`` seconds) until every rank has joined the process group: a rank
    whose ``fn`` returns at once would otherwise close its gloo connections while a slower rank is
    still connecting to it ("connectFullMesh failed ... Connection closed by peer")."""
    try:
        deadline = time.monotonic() + wait_s
        while store.add("spawn/joined", 0) < world and time.monotonic() < deadline:
            time.sleep(0.01)
    except Exception:  # noqa: BLE001 - leaving either way
        pass


def _leave(store, rank: int, world: int, wait_s: float) -> None:
    """This rank is done. Rank 0, whose process hosts the job's store, stays until every rank is
    (a parameter server that still serves a slower trainer would otherwise find the store gone
    and fail the job), or ``wait_s`` seconds; a rank that died is the parent's to report."""
    try:
        store.add("spawn/done", 1)
        deadline = time.monotonic() + wait_s
        while rank == 0 and store.add("spawn/done", 0) < world and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:  # noqa: BLE001 - leaving either way
        pass


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 300.0,
    pg_timeout: float = 60.0,
    grace: float = 10.0,
    threads: int | None = 1,
    start_method: str = "forkserver",
) -> list[Any]:
    """``fn(rank, nprocs, *args)`` on ``nprocs`` new processes (see ``start_method``) that
    share a ``torch.distributed`` job; returns their results by rank.

    ``fn`` and its arguments must be picklable (a module-level function). ``pg_timeout``
    bounds every collective; ``timeout`` the whole job; ``threads``: intra-op threads per
    rank (1 by default: N ranks on N cores). Raises :class:`SpawnError` with the first
    failing rank's traceback. ``start_method``: ``"forkserver"`` (default: each rank forks from
    one process that imported once what every rank needs: torch, hybridembed, ``torch._dynamo``
    that ``DistributedDataParallel`` imports and the fused CPU step's Numba kernels; it stays for the
    next jobs of this process, whose ranks then start in a fraction of a second; the ranks get this process's
    current stdout, stderr and environment, though modules the forkserver imported keep what they
    read of the environment when it started) or ``"spawn"`` (each rank imports afresh).
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise HybridEmbedError(f"nprocs must be a positive int, got {nprocs!r}")
    for name, v in (("timeout", timeout), ("pg_timeout", pg_timeout), ("grace", grace)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= (0 if name == "grace" else 1e-9):
            raise HybridEmbedError(f"spawn: {name} must be a number of seconds > 0 (inf allowed), got {v!r}")
    if pg_timeout == float("inf"):  # (a process group's timeout is a timedelta: finite)
        raise HybridEmbedError(f"spawn: pg_timeout must be a finite number of seconds > 0, got {pg_timeout!r}")
    if start_method not in ("forkserver", "spawn"):
        raise HybridEmbedError(f"spawn: start_method must be 'forkserver' or 'spawn', got {start_method!r}")
    ctx = mp.get_context(start_method)
    here = None
    if start_method == "forkserver":  # (ranks fork from one process that imported torch once)
        ctx.set_forkserver_preload(["hybridembed.launch._preload"])
        here = _Here()
    results = ctx.Queue()
    listener = _listen(0, nprocs)
    port = listener.getsockname()[1]
    ifname = os.environ.get("GLOO_SOCKET_IFNAME") or loopback_interface()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, nprocs, port, backend, pg_timeout, fn, args, results, threads, ifname, here),
            kwargs={"listening": _Fd(listener.fileno())} if r == 0 else {},
            daemon=True,
        )
        for r in range(nprocs)
    ]
    try:
        for p in procs:
            p.start()
    finally:
        listener.close()  # (rank 0 holds its own copy)
    out: dict[int, Any] = {}
    failure: tuple[int, str, bytes | None] | None = None
    deadline = time.monotonic() + timeout
    stop_at = None
    reported: set[int] = set()
    try:
        while len(reported) < nprocs:
            now = time.monotonic()
            if now > deadline:
                failure = failure or (-1, f"the job did not finish within {timeout:.0f} s", None)
                break
            if stop_at is not None and now > stop_at:
                break
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in reported]
                if dead and failure is None:
                    failure = (dead[0], f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode})", None)
                    stop_at = time.monotonic() + grace
                continue
            reported.add(rank)
            if ok:
                out[rank] = pickle.loads(value)
            elif failure is None:
                failure = (rank, *value)
                stop_at = time.monotonic() + grace  # the others may fail too (and say why) or wait on it
    finally:
        for p in procs:
            p.join(timeout=0.5 if failure else 5.0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
    if failure is not None:
        rank, text, exc = failure
        where = f"rank {rank}" if rank >= 0 else "the job"
        error = None
        if exc is not None:
            try:
                error = pickle.loads(exc)
            except Exception:  # an exception class whose arguments do not round-trip
                error = None
        raise SpawnError(f"{where} failed: {text}", rank, error)
    return [out[r] for r in range(nprocs)]
