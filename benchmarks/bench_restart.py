"""How long ``hybridembed train --max-restarts`` takes to start, and to come back after a rank dies.

    python benchmarks/bench_restart.py                        # this checkout's hybridembed
    python benchmarks/bench_restart.py --src OTHER/src        # another checkout's, to compare

Runs ``hybridembed train --nproc 2 --max-restarts 1`` on generated Criteo-format rows (DLRM,
26 dynamic tables, an incremental checkpoint every 20 steps), SIGKILLs one rank once the first
checkpoint is committed, and reports from the command's output: the first start (the command
started -> its first line, printed by rank 0 once the job is up), the restart (the kill -> the
restarted rank 0's ``resumed from`` line), and the whole command. ``--rounds`` repeats it; the
figures are medians. The job's processes are killed at the end whatever happens.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.procs import cmdline, descendants, forked_ranks, kill_tree  # noqa: E402


def _ranks(pid: int) -> list[int]:
    """The job's processes: the children of the command's forkserver, or (a torchrun-based
    command) its ``python -m hybridembed.cli train`` descendants."""
    return forked_ranks(pid) or [d for d in descendants(pid) if " -m hybridembed.cli train " in cmdline(d)]


def one_run(src: str, data: str, workdir: str, timeout: float) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=src)
    ckpt = os.path.join(workdir, "ckpt")
    argv = [sys.executable, "-m", "hybridembed.cli", "train", "--data", data, "--workdir", workdir, "--no-progress",
            "--threads", "1", "--max-rows", "2000", "--batch-size", "8", "--holdout", "0", "--embedding-dim", "4",
            "--mlp", "8", "--bottom-mlp", "4", "--no-export", "--checkpoint", ckpt, "--checkpoint-every", "20",
            "--checkpoint-incremental", "--nproc", "2", "--max-restarts", "1"]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic() - t0, line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    killed = None
    try:
        while proc.poll() is None and time.monotonic() - t0 < timeout:
            if killed is None and os.path.exists(os.path.join(ckpt, "model", "LATEST")):
                ranks = _ranks(proc.pid)
                if len(ranks) == 2:
                    os.kill(ranks[1], signal.SIGKILL)
                    killed = time.monotonic() - t0
            time.sleep(0.02)
        proc.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
    finally:
        kill_tree(proc.pid)
        proc.wait()
        reader.join(timeout=10)
    total = time.monotonic() - t0
    text = "\n".join(line for _, line in lines)
    if proc.returncode != 0 or killed is None:
        raise RuntimeError(f"the job failed (exit {proc.returncode}, killed at {killed}):\n{text[-3000:]}")
    first = lines[0][0]
    resumed = next(t for t, line in lines if re.match(r"resumed from .* after restart 1$", line))
    return {"first_start_s": first, "restart_s": resumed - killed, "total_s": total}


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", default=str(ROOT / "src"), help="the hybridembed source tree to run (PYTHONPATH)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for one run")
    args = p.parse_args(argv)
    sys.path.insert(0, args.src)
    from hybridembed.train.data import generate_criteo

    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        data = generate_criteo(os.path.join(tmp, "gen.tsv"), 3000, seed=1)
        for r in range(args.rounds):
            workdir = os.path.join(tmp, f"run{r}")
            runs.append(one_run(args.src, data, workdir, args.timeout))
            print(" ".join(f"{k} {v:.2f}" for k, v in runs[-1].items()), flush=True)
    med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
    print(f"medians of {len(runs)}: " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()))
    return med


if __name__ == "__main__":
    main()
