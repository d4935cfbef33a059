"""``hybridembed train --max-restarts K``: the job under torch's elastic agent (torchrun's).

    hybridembed train --nproc 2 --max-restarts 3 --checkpoint runs/ckpt --checkpoint-every 500
    python -m pytest -q tests/train/test_faults.py

The command runs the agent in its own process, configured as torchrun would be by
``torchrun --nproc-per-node N --standalone --local-addr 127.0.0.1 --max-restarts K -m
hybridembed.cli train <the same flags>`` (those flags built by ``hybridembed launch``'s
:func:`~hybridembed.launch.cli.torchrun_command`; the rendezvous port comes from the OS; the
job listens on loopback only, as ``hybridembed launch``'s on one machine: see
:mod:`hybridembed.launch.local_run`), with one difference: each process is forked from a
forkserver that imported torch and hybridembed once (as :func:`hybridembed.launch.spawn`'s
ranks are), not started as a new ``python``, so a start of the job, and a restart, takes a
fraction of a second instead of the seconds of an interpreter importing torch. A process is
otherwise ``python -u -m hybridembed.cli train <the same flags>``: this command's output,
environment and working directory, an unhandled exception given to ``sys.excepthook``, the
threads joined and the ``atexit`` handlers run at its end.

When a process fails or dies, the agent stops the others and starts all N again, at most K
times; each start of ``train`` under the agent resumes from the last committed checkpoint in
``--checkpoint DIR`` (see :func:`checkpoint_to_resume`).

The agent's own output (its log records, its failure table) is not shown: each restart is one
line on stderr, and the end of the restarts is one or two (which rank died and how; where the
last committed checkpoint is). The processes' output passes through.
"""

from __future__ import annotations

import io
import logging
import os
import re
import runpy
import signal
import sys
import uuid
from collections.abc import Sequence

from ..utils import get_logger

__all__ = ["restart_count", "checkpoint_to_resume", "torchrun_command", "launch_config", "run_elastic"]

log = get_logger("hybridembed.train")

POINTER = "LATEST"  # he.save's commit: a checkpoint directory holding it has a committed version
# the agent's record of a failed start: "failed (exitcode: -9) local_rank: 1 (pid: 4242) of fn: _rank (...)"
_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
_AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher")
# what the agent sets in a process's environment (over the forkserver's), kept when the caller's is put back
_AGENT_ENV = re.compile(
    r"RANK|LOCAL_RANK|GROUP_RANK|ROLE_RANK|ROLE_NAME|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_WORLD_SIZE|ROLE_WORLD_SIZE"
    r"|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_\w+|TORCH_NCCL_ASYNC_ERROR_HANDLING"
)


def restart_count() -> int | None:
    """Which start of the job this process belongs to under torchrun's elastic agent (0: the first;
    ``TORCHELASTIC_RESTART_COUNT``), None outside the agent."""
    v = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def checkpoint_to_resume(directory: str | None, model_dir: str) -> str | None:
    """``directory`` when it holds a committed checkpoint (``directory/model_dir/LATEST``), else None.

    A save that died before its commit left no ``LATEST`` (a first save) or the previous one
    (a later save): what this names is always complete and loadable.
    """
    if directory and os.path.isfile(os.path.join(directory, model_dir, POINTER)):
        return directory
    return None


def torchrun_command(nproc: int, max_restarts: int, train_argv: Sequence[str]) -> list[str]:
    """torchrun ``... -m hybridembed.cli train <train_argv>`` on this machine (its stores on 127.0.0.1)."""
    from ..launch.cli import build_parser, torchrun_command

    launch = build_parser().parse_args(
        ["--nproc", str(nproc), "--max-restarts", str(max_restarts), "-m", "hybridembed.cli", "train", *train_argv]
    )
    return torchrun_command(launch)


def _failure(exitcode: int, rank: int, pid: int) -> str:
    if exitcode < 0:
        try:
            how = f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"was killed by signal {-exitcode}"
    else:
        how = f"exited with code {exitcode}"
    return f"rank {rank} (pid {pid}) {how}"


def launch_config(nproc: int, max_restarts: int):
    """torch's ``LaunchConfig`` of the job, as torchrun makes it from :func:`torchrun_command`'s flags
    (``--standalone``: a c10d rendezvous of a new id on a port the OS picks), its processes
    forked from the forkserver."""
    from torch.distributed.run import config_from_args, get_args_parser

    args = get_args_parser().parse_args(torchrun_command(nproc, max_restarts, [])[3:])
    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())  # (torchrun's run())
    args.start_method = "forkserver"
    config, _, _ = config_from_args(args)
    return config


class _Summary(logging.Handler):
    """Takes the agent's log records: a failed start becomes one line on stderr while restarts
    are left; every other record goes to this library's debug log."""

    def __init__(self, prog: str, nproc: int, max_restarts: int) -> None:
        super().__init__(logging.DEBUG)
        self.prog, self.nproc, self.max_restarts = prog, nproc, max_restarts
        self.failures: list[tuple[int, int, int]] = []  # (exit code, rank, pid) of each start that failed

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a record that does not format is not a failure
            return
        f = _FAILED.search(message)
        if f is None or len(self.failures) > self.max_restarts:
            log.debug("elastic agent: %s", message.strip())
            return
        self.failures.append((int(f.group(1)), int(f.group(2)), int(f.group(3))))
        if len(self.failures) <= self.max_restarts:
            print(
                f"{self.prog}: {_failure(*self.failures[-1])}; restarting all {self.nproc} "
                f"process{'es' if self.nproc > 1 else ''} (restart {len(self.failures)} of {self.max_restarts})",
                file=sys.stderr,
                flush=True,
            )


class _AgentLogs:
    """Within: the agent's loggers' records go to ``handler`` alone (not to torch's stderr handler)."""

    def __init__(self, handler: logging.Handler) -> None:
        self.handler, self.kept = handler, []

    def __enter__(self) -> _AgentLogs:
        for name in _AGENT_LOGGERS:
            lg = logging.getLogger(name)
            self.kept.append((lg, lg.handlers[:], lg.propagate))
            lg.handlers, lg.propagate = [self.handler], False
        return self

    def __exit__(self, *exc) -> None:
        for lg, handlers, propagate in self.kept:
            lg.handlers, lg.propagate = handlers, propagate


def _interrupt_once(signum, frame) -> None:  # pragma: no cover (in a process the agent forked)
    """A process's first SIGINT is a KeyboardInterrupt, the next ones are ignored: Ctrl-C reaches it
    from the terminal and again from the agent, which forwards it, and a second interrupt in the
    middle of the first one's cleanup (a checkpoint's) only printed tracebacks. The agent ends a
    process that does not stop with SIGKILL."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _rank(here, argv: list[str]) -> None:  # pragma: no cover (in a process the agent forked)
    """One process of the job, forked from the forkserver: ``python -u -m hybridembed.cli train ARGV``
    with the caller's output, environment and working directory (the agent's variables over it)."""
    from ..launch import _run_as_main

    agent = {k: v for k, v in os.environ.items() if _AGENT_ENV.fullmatch(k)}
    here.apply()
    signal.signal(signal.SIGINT, _interrupt_once)
    os.environ.update(agent)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)  # (-u: a kill loses nothing)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
    sys.argv = ["-m", "train", *argv]  # (runpy puts the module's path first, as python -m does)
    code = _run_as_main(lambda: runpy.run_module("hybridembed.cli", run_name="__main__", alter_sys=True))
    if code:
        raise SystemExit(code)  # (the agent's failure; 0: the return value it waits for)


def run_elastic(
    train_argv: Sequence[str], *, prog: str, nproc: int, max_restarts: int, checkpoint: str, threads: int,
    model_dir: str,
) -> int:  # fmt: skip
    """Runs ``hybridembed train <train_argv>`` as ``nproc`` processes under the elastic agent, in this
    process, summarising the agent's output (the processes' passes through).

    Returns 0 when the job finished; when the restarts ran out, 2 if the last failure was the
    command's own error exit (bad flags or data: exit code 2), else 1.
    """
    import multiprocessing

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from ..launch import _Here
    from ..launch.cli import restart_env
    from ..launch.local_run import patch_agent_stores

    env = restart_env(max_restarts, one_machine=True)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    summary, agent_error = _Summary(prog, nproc, max_restarts), None
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)  # (what the agent reads, and the processes are given)
    try:
        with _AgentLogs(summary):
            if not patch_agent_stores():
                log.warning("this torch's elastic agent makes its stores listen on every interface")
            multiprocessing.get_context("forkserver").set_forkserver_preload(["hybridembed.launch._preload"])
            elastic_launch(launch_config(nproc, max_restarts), _rank)(_Here(), list(train_argv))
        return 0
    except ChildFailedError:
        pass
    except SignalException as e:  # (the agent stopped the processes)
        if e.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        print(f"{prog}: stopped by {e.sigval.name}", file=sys.stderr)
        return 128 + int(e.sigval)
    except Exception as e:  # noqa: BLE001 - the agent itself failed (rendezvous, ...)
        agent_error = e
    finally:
        os.environ.clear()
        os.environ.update(saved)
    sys.stdout.flush()
    failures = summary.failures
    if failures:
        what = _failure(*failures[-1])
        used = len(failures) - 1
        print(
            f"{prog}: error: {what}; no restart left ({used} of --max-restarts {max_restarts} used)",
            file=sys.stderr,
        )
    else:
        why = str(agent_error).strip().splitlines()[0] if agent_error is not None and str(agent_error).strip() else ""
        print(f"{prog}: error: the elastic agent failed: {type(agent_error).__name__}: {why}", file=sys.stderr)
    if checkpoint_to_resume(checkpoint, model_dir):
        print(
            f"{prog}: the last committed checkpoint is in {checkpoint}; the same command continues from it",
            file=sys.stderr,
        )
    return 2 if failures and failures[-1][0] == 2 else 1
