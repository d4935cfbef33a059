"""The job's health: its timeout, a heartbeat per process, and what a failing rank tells the others.

torch.distributed tells a rank little about its peers: a collective with a peer that died
fails with gloo's "Connection closed by peer [10.0.0.7]:41235" (an address, not a rank), one
with a peer that stopped or hangs waits out the group's timeout, and a peer that closed its
connections cleanly (it exited, or destroyed its process group) is not noticed at all by a
receive from any source. So each process of a job this library runs in keeps a heartbeat in
the job's own store (``torch.distributed``'s rendezvous store, which every rank already
reaches):

- a daemon thread adds 1 to ``hybridembed/health/beat/<rank>`` every :data:`PERIOD` seconds;
- an unhandled exception (``sys.excepthook``) writes ``hybridembed/health/failed/<rank>``:
  the exception's first line;
- :func:`diagnose` reads both for a set of ranks: a rank whose counter does not move over a
  few periods is dead or stopped, one with a ``failed`` entry says why.

The library's own waits use it: the sharded exchange turns a collective's failure into
:class:`RankLost` naming the ranks (``rank 1 died: RuntimeError: boom``), a parameter server
notices trainers that are gone without a goodbye, and a trainer's wait on a server names it.

Every process group the library makes inherits the job's timeout (:func:`job_timeout`:
the timeout ``init_process_group`` was given), not torch's 30-minute default for new groups.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import HybridEmbedError, RankLost
from ..utils import get_logger

__all__ = [
    "RankLost",
    "job_timeout",
    "new_group",
    "as_timeout",
    "heartbeat",
    "diagnose",
    "lost",
    "agree",
    "stop",
    "before_shutdown",
    "Watch",
    "lost_after",
    "tell",
    "told",
    "first_line",
    "failure",
    "note_failure",
    "PERIOD",
]

log = get_logger(__name__)

PERIOD = 1.0  # seconds between two beats of a process's heartbeat
_PREFIX = "hybridembed/health/"
_TEXT = 500  # characters of a failure kept in the store


# --- the job's timeout ---------------------------------------------------------------------------
def job_timeout(group: dist.ProcessGroup | None = None) -> datetime.timedelta:
    """The timeout of ``group``'s collectives (default: the job's, as ``init_process_group`` was
    given it); torch's default where it cannot be read."""
    pg = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            t = pg._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError, ValueError):
            continue
        if isinstance(t, datetime.timedelta) and t.total_seconds() > 0:
            return t
    store = _store()
    if store is not None:
        return store.timeout
    return dist.default_pg_timeout


def new_group(ranks: list[int], timeout: datetime.timedelta | None = None, **kwargs) -> dist.ProcessGroup:
    """``dist.new_group`` with the job's timeout (or ``timeout``) instead of torch's 30 minutes."""
    return dist.new_group(ranks, timeout=timeout if timeout is not None else job_timeout(), **kwargs)


def as_timeout(value: float | datetime.timedelta | None, what: str = "timeout") -> datetime.timedelta | None:
    """A timeout argument (seconds or a timedelta, > 0) -> a timedelta; None stays None."""
    from ..errors import ConfigError

    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise ConfigError(f"{what} must be a number of seconds or a datetime.timedelta, got {value!r}")
    if not seconds > 0 or seconds == float("inf"):
        raise ConfigError(f"{what} must be > 0 seconds and finite, got {value!r}")
    return datetime.timedelta(seconds=seconds)


# --- the heartbeat -------------------------------------------------------------------------------
def _store():
    """The job's rendezvous store (None when there is no process group or it cannot be reached)."""
    try:
        from torch.distributed import distributed_c10d as c10d

        return c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no job, or a torch without it: no health reports
        return None


class _Heartbeat:
    """This process's beat in the store; started once per job (per store).

    Two connections of its own to the store (``Store.clone``): one for the beating thread, one for
    reads. A store whose host is stopped answers nothing and torch's client then waits forever
    whatever its timeout, so every read runs in a thread of its own and is given up after
    :data:`STORE_WAIT` seconds (:meth:`ask`): a caller never waits longer."""

    def __init__(self, store, rank: int):
        self.rank, self.pid = rank, os.getpid()
        self.beat_store = dist.PrefixStore(_PREFIX, _clone(store))
        self.store = dist.PrefixStore(_PREFIX, _clone(store))
        self._stop = threading.Event()
        self._asking: threading.Thread | None = None
        self.beat_store.add(f"beat/{rank}", 1)  # (at once: the rank is known to beat from the start)
        self.thread = threading.Thread(target=self._run, name="hybridembed-heartbeat", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.wait(PERIOD):
            try:
                self.beat_store.add(f"beat/{self.rank}", 1)
            except Exception:  # noqa: BLE001 - the store is gone (the job ended): nothing to tell
                return

    def stop(self) -> None:
        """Stop beating, and wait for a beat in flight: a thread that returns from torch's C++ while
        the interpreter shuts down aborts the process ("terminate called without an active
        exception"), so none may be left in one."""
        self._stop.set()
        if self.thread is not threading.current_thread():
            self.thread.join(STORE_WAIT)
        asking = self._asking  # (a read of the store still in flight: the same holds for it)
        if asking is not None and asking is not threading.current_thread():
            asking.join(STORE_WAIT)

    def ask(self, fn):
        """``fn(store)`` within :data:`STORE_WAIT` seconds; None when the store failed or did not
        answer in time (then later calls return None at once until that answer comes)."""
        if self._asking is not None and self._asking.is_alive():
            return None
        box: list = []

        def run() -> None:
            try:
                box.append(fn(self.store))
            except Exception:  # noqa: BLE001 - unreachable: None
                pass

        t = threading.Thread(target=run, name="hybridembed-health-read", daemon=True)
        t.start()
        t.join(STORE_WAIT)
        if t.is_alive():
            self._asking = t
            return None
        return box[0] if box else None

    def counters(self, ranks: list[int]) -> dict[int, int] | None:
        """Each rank's beat count now; None when the store cannot be reached."""
        return self.ask(lambda st: {r: st.add(f"beat/{r}", 0) for r in ranks})

    def failures(self, ranks: list[int]) -> dict[int, str]:
        def read(st) -> dict[int, str]:
            keys = [f"failed/{r}" for r in ranks]
            return {r: st.get(k).decode(errors="replace") for r, k in zip(ranks, keys) if st.check([k])}

        return self.ask(read) or {}


STORE_WAIT = 5.0  # seconds a read of the store may take (a stopped store host answers nothing)


def _clone(store):
    """A connection of our own to ``store`` (the same one where a store cannot be cloned)."""
    try:
        return store.clone()
    except Exception:  # noqa: BLE001 - (FileStore, HashStore): shared, as is
        return store


def store_host() -> int | None:
    """The rank whose process hosts the job's store: 0, unless torchrun's agent hosts it (None)."""
    return None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true" else 0


def _unreachable(ranks: Iterable[int]) -> dict[int, str]:
    """What a store that does not answer says about ``ranks``: its host (rank 0, when in ``ranks``)
    is gone or stopped; otherwise nothing can be named (-1)."""
    host = store_host()
    if host is not None and host in set(ranks):
        return {host: "is dead or stopped (the job's store, which its process hosts, does not answer)"}
    return {-1: "the job's store does not answer (the process hosting it, rank 0 or torchrun's agent, is gone)"}


_beat: _Heartbeat | None = None
_beat_store: object | None = None
_failure: str | None = None
_lock = threading.Lock()


def heartbeat() -> _Heartbeat | None:
    """This process's heartbeat, started on first use in a job (None outside one)."""
    global _beat, _beat_store
    if not dist.is_available() or not dist.is_initialized():
        return None
    if _beat is not None and _beat.pid != os.getpid():  # (a forked child: the job, its store, are its parent's)
        return None
    store = _store()
    if store is None:
        return None
    old = None
    with _lock:
        if _beat is None or _beat_store is not store:  # (a new job in this process: a new beat)
            old, _beat, _beat_store = _beat, None, None
            try:
                _beat, _beat_store = _Heartbeat(store, dist.get_rank()), store
            except Exception as e:  # noqa: BLE001 - a store that refuses: the job runs without reports
                log.debug("no heartbeat: %s", e)
            else:
                _install_excepthook()
                before_shutdown(stop)
                _destroy_at_exit_once()
        beat = _beat
    if old is not None:  # (the last job's beat, joined outside the lock)
        old.stop()
    return beat


def stop() -> None:
    """Stop this process's heartbeat (its job is ending: the store may go away before the process
    does, and a beat into a closed store makes torch print a warning)."""
    global _beat, _beat_store
    if _beat is not None and _beat.pid != os.getpid():  # (a forked child ending: the beat is its parent's)
        return
    with _lock:
        beat, _beat, _beat_store = _beat, None, None
    if beat is not None:
        beat.stop()


atexit.register(stop)
_exit_hook = False
_exit_pid = 0  # the process whose groups _destroy_at_exit ends (a child forked from it leaves them alone)


def _destroy_at_exit_once() -> None:
    global _exit_hook, _exit_pid
    _exit_pid = os.getpid()
    if not _exit_hook:
        _exit_hook = True
        atexit.register(_destroy_at_exit)


_SETTLE = 0.05  # seconds the exit leaves gloo's worker threads to free their last work


def _destroy_at_exit() -> None:
    """A job's script that ends without ``destroy_process_group()`` (most do): its groups are
    destroyed here, while the interpreter is whole (not after an unhandled exception: a collective
    may still wait for a lost peer). Then the main thread sleeps a moment: a gloo worker thread
    frees each work after its ``wait()`` returned, and a tensor it frees may hold a Python object,
    which takes the GIL. In the interpreter's finalisation that thread is made to exit inside C++
    and the process aborts ("terminate called without an active exception", exit code -6;
    pytorch/pytorch#190489): seen about once in 20 jobs whose last line gathered a table, in a
    core dump a worker destroying an all-gather's work. Groups the model still holds (its own,
    DDP's) keep their threads, so destroying the groups alone did not prevent it."""
    if os.getpid() != _exit_pid:  # (a forked child, a data loader's worker: the groups are its parent's)
        return
    if _failure is None and dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - leaving either way
            pass
    time.sleep(_SETTLE)  # (a script that destroyed its groups itself too: the model may hold some)


_before_shutdown: list = []  # callables run before a process group shuts down
_shutdown = None  # ProcessGroup.shutdown as torch defines it (wrapped once, see before_shutdown)


def before_shutdown(fn) -> None:
    """Run ``fn()`` before any process group of this process shuts down (``destroy_process_group()``
    shuts every group down, the usual last line of a distributed script), and stop the heartbeat
    then. torch has no hook for it, so ``ProcessGroup.shutdown`` is wrapped, once, for the class: a
    script that imported ``destroy_process_group`` by name goes through it too."""
    global _shutdown
    if fn not in _before_shutdown:
        _before_shutdown.append(fn)
    pg = getattr(getattr(torch._C, "_distributed_c10d", None), "ProcessGroup", None)
    if _shutdown is not None or pg is None or not hasattr(pg, "shutdown"):
        return
    _shutdown = pg.shutdown

    def shutdown(self, *args, **kwargs):
        for f in list(_before_shutdown):
            try:
                f()
            except Exception:  # noqa: BLE001 - leaving: the group goes down either way
                pass
        stop()
        return _shutdown(self, *args, **kwargs)

    pg.shutdown = shutdown


def failure() -> str | None:
    """How this process failed (an unhandled exception's first line), None while it has not."""
    return _failure


def note_failure(e: BaseException) -> None:
    """Record that this process is failing with ``e``: its peers' diagnoses show it (called by the
    excepthook, and by launchers that catch a rank's exception themselves)."""
    global _failure
    if isinstance(e, SystemExit) and e.code in (0, None):  # (a normal end)
        return
    text = f"{type(e).__name__}: {e}".splitlines()[0][:_TEXT] if str(e) else type(e).__name__
    _failure = text
    beat = _beat
    if beat is not None and beat.pid == os.getpid() and not isinstance(e, RankLost):  # (a peer's loss is
        beat.ask(lambda st: st.set(f"failed/{beat.rank}", text))  # that peer's to report; a forked child's is its own)


def _install_excepthook() -> None:
    previous = sys.excepthook
    if getattr(previous, "_hybridembed", False):
        return

    def hook(kind, value, tb):
        if value is not None and not isinstance(value, (KeyboardInterrupt, SystemExit)):
            note_failure(value)
        previous(kind, value, tb)

    hook._hybridembed = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def tell(key: str, text: str) -> None:
    """Leave ``text`` under ``key`` in the job's store for the other ranks (best effort: a failure
    report; nothing waits for it)."""
    hb = heartbeat()
    if hb is not None:
        hb.ask(lambda st: st.set(f"told/{key}", text[:_TEXT]))


def told(key: str) -> str | None:
    """What another rank left under ``key`` (None when nothing, or no store)."""
    hb = heartbeat()
    if hb is None:
        return None
    k = f"told/{key}"
    return hb.ask(lambda st: st.get(k).decode(errors="replace") if st.check([k]) else None)


# --- diagnosis -----------------------------------------------------------------------------------
def diagnose(ranks: Iterable[int], wait: float = 2.5 * PERIOD) -> dict[int, str]:
    """``{rank: what is wrong with it}`` for the ranks among ``ranks`` (global ranks) that failed,
    died or stopped: their heartbeats are read twice, ``wait`` seconds apart. Empty when every one
    of them is alive (or nothing can be told: no heartbeat in this job)."""
    hb = heartbeat()
    ranks = [r for r in ranks if hb is None or r != hb.rank]
    if hb is None or not ranks:
        return {}
    before = hb.counters(ranks)
    if before is None:
        return _unreachable(ranks)
    deadline = time.monotonic() + wait
    found: dict[int, str] = {}
    while time.monotonic() < deadline:
        time.sleep(min(PERIOD / 2, max(0.0, deadline - time.monotonic())))
        failed = hb.failures(ranks)
        if failed:
            found.update({r: f"failed: {text}" for r, text in failed.items()})
    after = hb.counters(ranks)
    if after is None:
        return _unreachable(ranks) | found
    for r in ranks:
        if after[r] == before[r] and r not in found:
            found[r] = f"is dead or stopped (no heartbeat for {wait:.1f} s)"
    return found


def lost(what: str, ranks: Iterable[int], error: BaseException | None = None, group=None) -> RankLost:
    """A :class:`RankLost` for a wait on ``ranks`` that failed (``error``: the collective's):
    names the ranks that died, stopped or failed, found by :func:`diagnose`. ``ranks`` are ranks
    of ``group`` (global ranks when None)."""
    ranks = list(ranks)
    glob = ranks if group is None else [dist.get_global_rank(group, r) for r in ranks]
    found = diagnose(glob)
    raw = ""
    if error is not None:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raw = f" [{first[:160]}]"
    restart = "The job cannot go on; a restart resumes from the last committed checkpoint."
    if found:
        named = "; ".join(f"rank {r} {why}" if r >= 0 else why for r, why in sorted(found.items()))
        return RankLost(f"{what} failed: {named}. {restart}{raw}", [r for r in found if r >= 0])
    if "timed out" in raw.lower():
        why = (
            "every peer is alive, so one is stuck elsewhere (a different call, a slow step) for longer than the "
            f"timeout ({job_timeout(group).total_seconds():g} s)"
        )
    else:
        why = "every peer's heartbeat is alive"
    return RankLost(f"{what} failed: {why}. {restart}{raw}", [])


class Watch:
    """Peers watched over time (a parameter server's trainers): :meth:`check` names the ones whose
    heartbeat has not moved for ``lost_after`` seconds, and the ones that reported a failure."""

    def __init__(self, ranks: Iterable[int], lost_after: float):
        self.lost_after = lost_after
        self.seen: dict[int, tuple[int, float]] = {}  # rank -> (its count, when it last moved)
        now = time.monotonic()
        hb = heartbeat()
        counts = hb.counters(list(ranks)) if hb is not None else None
        for r in ranks:
            self.seen[r] = ((counts or {}).get(r, -1), now)

    def check(self, ranks: Iterable[int]) -> dict[int, str]:
        """``{rank: what happened}`` for the ranks among ``ranks`` that failed, died or stopped."""
        ranks = list(ranks)
        hb = heartbeat()
        if hb is None or not ranks:
            return {}
        counts = hb.counters(ranks)
        if counts is None:
            return _unreachable(ranks)
        out = {r: f"failed: {text}" for r, text in hb.failures(ranks).items()}
        now = time.monotonic()
        for r in ranks:
            count, since = self.seen.get(r, (-1, now))
            if counts[r] != count:
                self.seen[r] = (counts[r], now)
            elif now - since > self.lost_after and r not in out:
                out[r] = f"is dead or stopped (no heartbeat for {now - since:.0f} s)"
        return out


def lost_after(timeout: datetime.timedelta) -> float:
    """Seconds without a heartbeat after which a peer is taken for lost: half the job's timeout,
    within 5 to 60 s (a heartbeat thread can be held off by a long call that keeps the GIL)."""
    return min(60.0, max(5.0, timeout.total_seconds() / 2))


# --- setup agreed across ranks --------------------------------------------------------------------
def agree(group, what: str, error: BaseException | None, settings: Any = None, hint: str = "") -> None:
    """Every rank's verdict on a setup step, and its ``settings``, compared across ``group``
    (a collective): one rank's refusal is every rank's (its own error on it, a ConfigError
    naming it and its reason on the others), and the first difference in ``settings`` (JSON-able)
    is named on every rank (followed by ``hint``). Nothing is allocated before it, so no rank waits
    for one that gave up."""
    from ..errors import ConfigError

    mine = json.dumps({"error": first_line(error) if error is not None else None, "settings": settings}, default=str)
    world = dist.get_world_size(group)
    everyone: list[Any] = [None] * world
    try:
        dist.all_gather_object(everyone, mine, group=group)
    except RuntimeError as e:
        others = [r for r in range(world) if r != dist.get_rank(group)]
        raise lost(f"rank {dist.get_rank()}: agreeing on {what}", others, e, group) from None
    reports = [json.loads(x) for x in everyone]
    if error is not None:
        raise error
    failed = [(r, rep["error"]) for r, rep in enumerate(reports) if rep["error"] is not None]
    if failed:
        named = "; ".join(f"rank {r}: {text}" for r, text in failed)
        raise ConfigError(
            f"{what} was refused on rank(s) {', '.join(str(r) for r, _ in failed)} ({named}); "
            "nothing was allocated on any rank"
        )
    ref = reports[0]["settings"]
    for r, rep in enumerate(reports[1:], 1):
        if rep["settings"] != ref:
            why = f"; {hint}" if hint else ""
            raise ConfigError(f"ranks disagree on {what}: {first_difference(ref, rep['settings'], r)}{why}")


def first_line(e: BaseException) -> str:
    """``e``'s message, first line (with its type unless it is one of ours), for another rank's error."""
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}"[:_TEXT] if not isinstance(e, HybridEmbedError) else text[:_TEXT]


def first_difference(a: Any, b: Any, rank: int, path: str = "") -> str:
    """Where ``b`` (rank ``rank``'s) first differs from ``a`` (rank 0's), as ``path: a on rank 0, b on rank r``."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in [*a, *(k for k in b if k not in a)]:
            if k not in b:
                return f"rank 0 has {path}{k}, rank {rank} does not"
            if k not in a:
                return f"rank {rank} has {path}{k}, rank 0 does not"
            if a[k] != b[k]:
                return first_difference(a[k], b[k], rank, f"{path}{k}.")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return first_difference(x, y, rank, f"{path}{i}.")
    return f"{path.rstrip('.')}: {a!r} on rank 0, {b!r} on rank {rank}"
