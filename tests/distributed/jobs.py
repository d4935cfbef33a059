"""Run a script as the ranks of a local gloo job, one process each, as torchrun would (test helper).

Every rank is its own process running the script as ``python`` would (an unhandled exception, a
SIGKILL, a SIGSTOP or ``destroy_process_group()`` behave as in a user's job), forked from a warm
process that imported torch once (:mod:`tests.warm`), and the whole job is bounded: a rank still
running at ``timeout`` is killed and reported as such.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hybridembed.launch import free_port
from tests.warm import Script

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
    with tempfile.TemporaryDirectory(prefix="job-") as tmp:
        start = time.monotonic()
        files = [(Path(tmp) / f"{r}.out", Path(tmp) / f"{r}.err") for r in range(world)]
        procs = [
            Script(ROOT / script, args, {**base, "RANK": str(r), "LOCAL_RANK": str(r)}, *files[r]) for r in range(world)
        ]
        ends: dict[int, float] = {}
        while len(set(ends) | set(linger)) < world and time.monotonic() - start < timeout:
            for r, p in enumerate(procs):
                if r not in ends and p.poll() is not None:
                    ends[r] = time.monotonic() - start
            time.sleep(0.05)
        out = []
        for r, p in enumerate(procs):
            code: int | None = p.poll()
            if r not in ends:  # (the job's timeout: stopped ranks are continued, then killed)
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait(30)
                code = None
            o, e = (f.read_text(errors="replace") if f.exists() else "" for f in files[r])
            out.append(Rank(r, code, ends.get(r, timeout), o, e))
    return out
