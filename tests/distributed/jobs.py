"""Run a script as the ranks of a local gloo job, one process each, as torchrun would (test helper).

Every rank is its own ``python`` process (an unhandled exception, a SIGKILL, a SIGSTOP or
``destroy_process_group()`` behave as in a user's job), and the whole job is bounded: a rank
still running at ``timeout`` is killed and reported as such.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hybridembed.launch import free_port

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Rank:
    rank: int
    code: int | None  # exit code (negative: the signal); None: killed at the job's timeout
    seconds: float  # from the job's start to this rank's exit
    out: str
    err: str

    @property
    def result(self) -> dict | None:
        for line in self.out.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        return None

    @property
    def error(self) -> str:
        """The last line of its traceback (the exception raised), '' if none."""
        lines = [x for x in self.err.splitlines() if x.strip() and not x.startswith(("  ", "[rank"))]
        tb = [x.split("]: ", 1)[-1] for x in self.err.splitlines() if x.startswith("[rank")]
        tail = [x for x in tb if x and not x.startswith(" ")] or lines
        return tail[-1] if tail else ""


def run_job(
    script: str, args: list[str], world: int, timeout: float, env: dict | None = None, linger: set[int] = frozenset()
) -> list[Rank]:
    """``python script args`` on ``world`` ranks of one job; every rank's outcome. Ranks in
    ``linger`` (stopped on purpose) are not waited for: once the others ended, they are killed."""
    port = free_port()
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world)}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), base.get("PYTHONPATH", "")])
    base["OMP_NUM_THREADS"] = "1"
    base.update(env or {})
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / script), *args],
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    ends: dict[int, float] = {}
    while len(set(ends) | set(linger)) < world and time.monotonic() - start < timeout:
        for r, p in enumerate(procs):
            if r not in ends and p.poll() is not None:
                ends[r] = time.monotonic() - start
        time.sleep(0.05)
    out = []
    for r, p in enumerate(procs):
        code: int | None = p.returncode
        if r not in ends:  # (the job's timeout: stopped ranks are continued, then killed)
            p.send_signal(signal.SIGCONT)
            p.kill()
            code = None
        o, e = p.communicate(timeout=30)
        out.append(Rank(r, code, ends.get(r, timeout), o, e))
    return out
