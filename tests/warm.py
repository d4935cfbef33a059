"""``python script args`` as a process forked from one warm process (test helper).

A fresh ``python`` imports torch and hybridembed in 4-6 s on a 2-core machine, every rank of every
job of a fault test. Here each script's process is forked from the forkserver of
:func:`hybridembed.launch.spawn` (which imported them once) and runs the script as the interpreter
would: ``__main__``, ``sys.argv``, its environment, output and working directory its own, an
unhandled exception kept in ``sys.last_value`` and given to ``sys.excepthook`` (which the library
may have wrapped) with exit code 1, ``sys.exit``'s code, then the threads joined and the ``atexit``
handlers run, a signal's death as such (exit code ``-signal``). It is its own process: SIGKILL,
SIGSTOP and a process group of its own act on it alone. What differs from a fresh interpreter:
the modules the forkserver imported read the environment when it started, and their import-time
output went to its stderr (a test of those starts ``python`` itself).
"""

from __future__ import annotations

import atexit
import io
import multiprocessing as mp
import os
import runpy
import signal
import sys
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path

from hybridembed.launch import _run_as_main
from tests.procs import kill_tree

PRELOAD = ["hybridembed.launch._preload"]  # (as hybridembed.launch.spawn's: one forkserver a process)
_LIVE: weakref.WeakSet = weakref.WeakSet()  # started here, perhaps still running


@atexit.register
def _kill_the_rest() -> None:
    """A script still running when this process ends is killed (multiprocessing would wait for it:
    this runs first, registered after multiprocessing's own exit handler)."""
    for p in list(_LIVE):
        p.kill()


class Script:
    """A started script: ``pid``, ``poll()``, ``wait(timeout)``, ``returncode``, ``send_signal``,
    ``kill`` as :class:`subprocess.Popen`'s; its output in the files given."""

    def __init__(
        self,
        script: str | Path,
        argv: list[str],
        env: dict[str, str],
        stdout: str | Path,
        stderr: str | Path | None = None,
        cwd: str | Path | None = None,
        new_session: bool = False,
    ) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        where = (str(stdout), None if stderr is None else str(stderr), None if cwd is None else str(cwd))
        self._proc = ctx.Process(target=_run, args=(str(script), list(argv), dict(env), *where, new_session))
        self._proc.start()
        self.pid = self._proc.pid
        _LIVE.add(self)

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int | None:
        self._proc.join(timeout)
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _stream(fd: int, unbuffered: bool, err: bool) -> io.TextIOWrapper:
    """A new ``sys.stdout``/``sys.stderr`` on ``fd`` as the interpreter opens them (the forkserver's
    own buffers are not written twice)."""
    if unbuffered:
        return io.TextIOWrapper(
            io.FileIO(fd, "w", closefd=False), write_through=True, errors="backslashreplace" if err else None
        )
    return open(fd, "w", buffering=1 if err else -1, closefd=False, errors="backslashreplace" if err else None)


def _run(script, argv, env, out, err, cwd, new_session) -> None:  # pragma: no cover (in the forked process)
    if new_session:
        os.setsid()
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.close(fd)
    if err is None:
        os.dup2(1, 2)
    else:
        fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdout, sys.stderr = _stream(1, unbuffered, False), _stream(2, unbuffered, True)
    if cwd is not None:
        os.chdir(cwd)
    if env.get("OMP_NUM_THREADS", "").isdigit():  # (libgomp read the forkserver's environment when it loaded)
        import torch

        torch.set_num_threads(max(1, int(env["OMP_NUM_THREADS"])))
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[0:0] = [os.path.dirname(os.path.abspath(script)), *extra]
    sys.argv = [script, *argv]
    code = 1
    try:  # (as python runs a script: its exit status, sys.excepthook, threads joined, atexit)
        code = _run_as_main(lambda: runpy.run_path(script, run_name="__main__"))
    finally:
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except Exception:
                pass
        os._exit(code)


def run(
    script: str | Path, argv: list[str], env: dict[str, str], cwd: str | Path, timeout: float
) -> tuple[int, str, str]:
    """``subprocess.run([python, script, *argv], ...)`` as a warm process: (exit code, stdout, stderr);
    one still running at ``timeout`` is killed with every process it started (exit code -9)."""
    with tempfile.TemporaryDirectory(prefix="warm-") as tmp:
        files = [Path(tmp) / "out", Path(tmp) / "err"]
        p = Script(script, argv, env, *files, cwd=cwd)
        if p.wait(timeout) is None:
            kill_tree(p.pid)  # (a launcher's ranks too: none outlives the test)
            p.wait(30)
        return p.returncode, *(f.read_text(errors="replace") if f.exists() else "" for f in files)


def run_code(
    code: str, env: dict[str, str], cwd: str | Path, timeout: float, argv: Sequence[str] = ()
) -> tuple[int, str, str]:
    """``python -c code *argv`` as a warm process (see :func:`run`)."""
    with tempfile.TemporaryDirectory(prefix="warm-") as tmp:
        script = Path(tmp) / "code.py"
        script.write_text(code)
        return run(script, list(argv), env, cwd, timeout)


_MODULE = (
    "import runpy, sys\nsys.argv = sys.argv[1:]\nrunpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n"
)


def run_module(
    module: str, argv: list[str], env: dict[str, str], cwd: str | Path, timeout: float
) -> tuple[int, str, str]:
    """``python -m module *argv`` as a warm process (see :func:`run`)."""
    return run_code(_MODULE, env, cwd, timeout, [module, *argv])
