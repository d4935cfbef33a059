"""One rank of the fault tests' elastic job: ``hybridembed train`` with a SIGKILL planted in it.

    hybridembed launch --nproc 2 --max-restarts 2K tests/train/fault_worker.py LOG K SEED TRAIN_FLAGS...

Start ``g`` of the job (``TORCHELASTIC_RESTART_COUNT``) for ``g < 2K`` kills one rank of itself,
at a moment drawn from ``random.Random((SEED, g))``: even starts while training (a timer fired
``0..50`` ms after the n-th step of this start), odd ones while saving (this module patches
``hybridembed.checkpoint.layout``: before the k-th file written, between the rename of the
version and its commit, right after ``os.replace`` of ``LATEST``, or right after the commit
returned). Start ``2K`` runs to the end. LOG gets one line per event, appended and fsynced:
``kill G RANK WHERE`` before each kill and ``commit G STEP`` by rank 0 once a version is
committed (the saves are incremental and written in the background: the save call returns
before its commit).
Test code only: the library has no hook for this.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading

LOG, START, RANK = "", 0, 0  # set by main() (importing this module, as pytest's doctests do, runs nothing)


def note(line: str) -> None:
    fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def die(where: str) -> None:
    note(f"kill {START} {RANK} {where}")
    os.kill(os.getpid(), signal.SIGKILL)


def plant_in_training(job_module, rng: random.Random) -> None:
    victim, n, delay = rng.randrange(2), rng.randint(1, 8), rng.uniform(0.0, 0.05)
    if RANK != victim:
        return
    steps = [0]
    train_epoch = job_module.train_epoch

    def patched(model, optimizer, batches, on_step=None, job=None, **options):
        def counted(rows: int, loss: float) -> None:
            steps[0] += 1
            if steps[0] == n:
                threading.Timer(delay, die, (f"training, {delay * 1000:.0f} ms after step {n}",)).start()
            if on_step is not None:
                on_step(rows, loss)

        return train_epoch(model, optimizer, batches, counted, job, **options)

    job_module.train_epoch = patched


def plant_in_saves(ckpt, rng: random.Random) -> None:
    where = rng.choice(["write", "write", "before commit", "after replace", "after commit"])
    if where == "write":
        victim, k = rng.randrange(2), rng.randint(1, 60)
        if RANK != victim:
            return
        writes = [0]
        write_file = ckpt._write_file

        def patched_write(path, obj):
            writes[0] += 1
            if writes[0] == k:
                die(f"saving, before file {k} of this start ({os.path.basename(path)})")
            write_file(path, obj)

        ckpt._write_file = patched_write
        return
    if RANK != 0:  # rank 0 commits
        return
    s = rng.randint(1, 3)
    commits = [0]
    commit = ckpt._commit

    def patched_commit(root, version):
        commits[0] += 1
        if commits[0] == s and where == "before commit":
            die(f"saving, {version} renamed, not committed")
        if commits[0] == s and where == "after replace":
            replace = ckpt.os.replace

            def replaced(src, dst):
                replace(src, dst)
                die(f"saving, LATEST replaced by {version}, directory not synced")

            ckpt.os.replace = replaced
        commit(root, version)
        if commits[0] == s and where == "after commit":
            die(f"saving, {version} committed, the other ranks not told")

    ckpt._commit = patched_commit


def main() -> int:
    global LOG, START, RANK
    from hybridembed.checkpoint import layout as ck_layout
    from hybridembed.train import cli
    from hybridembed.train import job as train_job

    LOG, kills, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    START, RANK = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    if START < 2 * kills:
        rng = random.Random(f"{seed}-{START}")
        (plant_in_training(train_job, rng) if START % 2 == 0 else plant_in_saves(ck_layout, rng))
    if RANK == 0:  # each commit logged when LATEST names it (saves run in the background)
        commit = ck_layout._commit

        def logged_commit(root, version):
            commit(root, version)
            manifest = json.loads((root / version / "manifest.json").read_text())
            note(f"commit {START} {manifest['extra']['hybridembed_train']['step']}")

        ck_layout._commit = logged_commit
    return cli.main(sys.argv[4:])


if __name__ == "__main__":
    sys.exit(main())
