"""``hybridembed train --max-restarts K``: the job under torchrun's elastic agent.

    hybridembed train --nproc 2 --max-restarts 3 --checkpoint runs/ckpt --checkpoint-every 500
    python -m pytest -q tests/train/test_faults.py

The command runs torchrun, ``python -m hybridembed.launch.local_run --nproc-per-node N
--standalone --local-addr 127.0.0.1 --max-restarts K -m hybridembed.cli train <the same flags>``
(built by ``hybridembed launch``'s :func:`~hybridembed.launch.cli.torchrun_command`;
the rendezvous port comes from the OS; the job listens on loopback only, as ``hybridembed
launch``'s on one machine). When a process fails or dies, the agent stops the others and starts all N again, at
most K times; each start of ``train`` under the agent resumes from the last committed
checkpoint in ``--checkpoint DIR`` (see :func:`checkpoint_to_resume`).

The agent's own output (its log lines, its traceback and failure table) is not shown: each
restart is one line on stderr, and the end of the restarts is one or two (which rank died
and how; where the last committed checkpoint is). The processes' output passes through.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Sequence

from ..utils import get_logger

__all__ = ["restart_count", "checkpoint_to_resume", "torchrun_command", "run_elastic"]

log = get_logger("hybridembed.train")

POINTER = "LATEST"  # he.save's commit: a checkpoint directory holding it has a committed version
# the agent's log lines: "E1122 22:26:43.769000 13627 torch/distributed/elastic/...py:1002] message"
_AGENT_LINE = re.compile(r"^[IWEF]\d{4} [\d:.]+ +\d+ \S*torch/distributed/elastic/\S+\] ?(.*)$")
_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
_BANNER = ("*****", "Setting OMP_NUM_THREADS environment variable")  # torchrun's, when OMP_NUM_THREADS is unset


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


def run_elastic(
    cmd: Sequence[str], *, prog: str, nproc: int, max_restarts: int, checkpoint: str, threads: int, model_dir: str
) -> int:
    """Runs ``cmd`` (torchrun), passing the processes' output through and summarising the agent's.

    Returns 0 when the job finished; when the restarts ran out, 2 if the last failure was the
    command's own error exit (bad flags or data: exit code 2), else 1.
    """
    from ..launch.cli import restart_env

    env = restart_env(max_restarts, one_machine=True)
    env.setdefault("OMP_NUM_THREADS", str(threads))  # (torchrun prints a banner when it sets it itself)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, env=env, text=True, errors="replace", bufsize=1)
    failures: list[tuple[int, int, int]] = []  # (exit code, rank, pid) of each start that failed
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if len(failures) > max_restarts:  # the agent gives up: the rest is its traceback and failure table
                continue
            m = _AGENT_LINE.match(line)
            if m is None:
                if not line.startswith(_BANNER):
                    sys.stderr.write(line)
                    sys.stderr.flush()
                continue
            f = _FAILED.search(m.group(1))
            if f is None:
                log.debug("torchrun: %s", m.group(1))
                continue
            failures.append((int(f.group(1)), int(f.group(2)), int(f.group(3))))
            if len(failures) <= max_restarts:
                print(
                    f"{prog}: {_failure(*failures[-1])}; restarting all {nproc} process{'es' if nproc > 1 else ''} "
                    f"(restart {len(failures)} of {max_restarts})",
                    file=sys.stderr,
                    flush=True,
                )
        code = proc.wait()
    except KeyboardInterrupt:  # torchrun got the signal too: it stops the processes
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    if code == 0:
        return 0
    sys.stdout.flush()
    if failures:
        what = _failure(*failures[-1])
        used = len(failures) - 1
        print(
            f"{prog}: error: {what}; no restart left ({used} of --max-restarts {max_restarts} used)",
            file=sys.stderr,
        )
    else:  # the agent itself failed (rendezvous, ...): its output went through, above
        print(f"{prog}: error: torchrun failed (exit code {code})", file=sys.stderr)
    if checkpoint_to_resume(checkpoint, model_dir):
        print(
            f"{prog}: the last committed checkpoint is in {checkpoint}; the same command continues from it",
            file=sys.stderr,
        )
    return 2 if failures and failures[-1][0] == 2 else 1
