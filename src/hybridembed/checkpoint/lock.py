"""One writer per checkpoint directory: the writer lock (``path/.lock``), held from choosing a version's name through its commit and cleanup."""

from __future__ import annotations

import errno
import os
import socket
import weakref
from pathlib import Path

from ..errors import CheckpointError

try:
    import fcntl
except ImportError:  # (not POSIX: the lock file itself is the lock)
    fcntl = None
from .layout import (
    LOCK,
    _pid_alive,
)


# --- one writer per directory ------------------------------------------------------------------
class _WriterLock:
    """The writer lock of one checkpoint directory, held; :meth:`release` (once or more) removes
    ``path/.lock`` and unlocks."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path, self.fd = path, fd  # fd: the flock'ed file (None: the O_EXCL file is the lock)
        _HELD.add(self)

    def release(self) -> None:
        if self.path is None:
            return
        path, fd = self.path, self.fd
        self.path = self.fd = None  # (first: a second release, after an interrupt below, finds nothing to do)
        _HELD.discard(self)
        # removed while held: a writer that opened it before sees a file no longer there and retries
        path.unlink(missing_ok=True)
        if fd is not None:
            os.close(fd)

    def _forget(self) -> None:
        """In a forked child: close the inherited file, which would hold the lock after the parent
        died (e.g. a data loader's worker), and never remove it."""
        if self.fd is not None:
            os.close(self.fd)
        self.path = self.fd = None


_HELD: weakref.WeakSet = weakref.WeakSet()  # the writer locks this process holds

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: [lock._forget() for lock in list(_HELD)])


def _lock(root: Path) -> _WriterLock:
    """Take the writer lock of the checkpoint directory ``root``, or raise a CheckpointError naming
    its holder (never waits). An exclusive ``flock`` on ``root/.lock``: the OS drops it when its
    holder dies, however it dies. Where flock is missing (not POSIX, a filesystem without locks)
    the file, made with O_EXCL, is the lock; one left by a dead process of this host is taken over."""
    path = root / LOCK
    while True:
        try:
            fd, made = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            try:
                fd, made = os.open(path, os.O_RDWR), False
            except FileNotFoundError:  # released meanwhile
                continue
        try:
            got = _try_flock(fd)
            if got and _still_there(fd, path):
                os.ftruncate(fd, 0)
                _write_at_0(fd, _me())
                return _WriterLock(path, fd)
            if got is None and made:  # no flock here: the file made is the lock
                _write_at_0(fd, _me())
                os.close(fd)
                return _WriterLock(path, None)
            holder = _read_at_0(fd) if not got else b""
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        if got:
            continue  # its holder released it (and removed the file) after we opened it
        pid, host = _holder(holder)
        if got is None and pid is not None and host == socket.gethostname() and not _pid_alive(pid):
            path.unlink(missing_ok=True)  # no flock, and the file's process died without removing it
            continue
        raise _held(root, holder, stale_hint=got is None)


_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _try_flock(fd: int) -> bool | None:
    """Exclusive flock of ``fd`` without waiting: True got, False held elsewhere, None no flock here."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in _NO_FLOCK:
            return None
        raise
    return True


def _still_there(fd: int, path: Path) -> bool:
    """Whether ``path`` is still the file open as ``fd`` (a released lock file is removed)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _read_at_0(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 256)


def _write_at_0(fd: int, data: bytes) -> None:
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, data)


def _me() -> bytes:
    return f"{os.getpid()} {socket.gethostname()}\n".encode()


def _holder(text: bytes) -> tuple[int | None, str | None]:
    """(pid, host) written in a lock file; None where it does not say."""
    parts = text.decode("utf-8", "replace").split()
    pid = int(parts[0]) if parts and parts[0].isdigit() else None
    return pid, parts[1] if len(parts) > 1 else None


def _held(root: Path, holder: bytes, stale_hint: bool = False) -> CheckpointError:
    pid, host = _holder(holder)
    me = pid == os.getpid() and host == socket.gethostname()
    who = f"{'this' if me else 'another'} process (pid {pid}, host {host})" if pid is not None else "another process"
    also = " (a save of another model, or a background save not yet committed)" if me else ""
    stale = f"; if no save is running there, remove {root / LOCK}" if stale_hint else ""
    return CheckpointError(
        f"{who} is writing the checkpoint {root}{also}; a checkpoint directory has one writer at a time: "
        f"wait for that save to finish, or save to another directory (loads need no lock){stale}"
    )
