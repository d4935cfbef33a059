"""``hybridembed train --max-restarts K``: a job whose ranks are SIGKILLed resumes from its last
committed checkpoint and ends with the weights of a job never killed.

    python -m pytest -q tests/train/test_faults.py
    HYBRIDEMBED_FAULT_KILLS=10 python -m pytest -q tests/train/test_faults.py   # 10 + 10 kills

Every start of a job costs seconds of process start-up here, so one elastic job takes all the
kills: ``HYBRIDEMBED_FAULT_KILLS`` (default 1) while training and as many while saving, one per
start of the job (tests/train/fault_worker.py plants them). Processes started here are killed
at the end whatever happens (their whole process tree), and every wait has a timeout.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("pyarrow", reason="the train tests need pyarrow (pip install 'hybridembed[train]')")

import hybridembed  # noqa: E402
from hybridembed.checkpoint import compact, read_manifest  # noqa: E402
from hybridembed.errors import CheckpointError  # noqa: E402
from hybridembed.launch import cli as launch  # noqa: E402
from hybridembed.train import cli, elastic  # noqa: E402
from tests import warm  # noqa: E402
from tests.procs import descendants, forked_ranks, kill_tree  # noqa: E402

KILLS = int(os.environ.get("HYBRIDEMBED_FAULT_KILLS", "1"))  # (more for a longer stress run)
WORKER = Path(__file__).with_name("fault_worker.py")
STEPS_PER_EPOCH = 15 * KILLS + 20  # a start takes at most ~12 steps before its kill: the job outlasts them
FLAGS = [
    "--nproc", "2", "--no-progress", "--threads", "1", "--embedding-dim", "4", "--mlp", "16", "--bottom-mlp", "8",
    "--capacity", "20000", "--batch-size", "8", "--max-rows", str(8 * STEPS_PER_EPOCH), "--epochs", "2",
    "--holdout", "0", "--no-export",
]  # fmt: skip
# the killed jobs' saves (the reference saves at its end only): chains of incremental versions
# written in the background, so a kill lands in a delta's write or commit too, training goes on
# while a save writes, and every resume loads a chain
EVERY = ["--checkpoint-every", "4", "--checkpoint-incremental", "--checkpoint-background"]
RESUMED = re.compile(
    r"^resumed from (\S+) \(epoch (\d+), step (\d+)\)(?: after restart (\d+)| \(its last committed)", re.M
)
TIMEOUT = 120 + 40 * KILLS  # seconds for one job


def _env() -> dict[str, str]:
    """This environment, with the hybridembed under test first on the children's path."""
    env = dict(os.environ)
    src = str(Path(hybridembed.__file__).resolve().parents[1])
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _kill_tree(proc: subprocess.Popen) -> None:
    kill_tree(proc.pid)
    proc.wait(timeout=30)


def _run(argv: list[str], timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """``python -m hybridembed.cli ARGV`` as a warm process (tests/warm.py: the command's own imports
    done once); past ``timeout`` its whole process tree is killed (exit code -9)."""
    rc, out, err = warm.run_module("hybridembed.cli", argv, _env(), os.getcwd(), timeout)
    return subprocess.CompletedProcess(argv, rc, out, err)


def _in_process(argv: list[str], timeout: float = TIMEOUT) -> int:
    """``cli.main(argv)`` in this process (its ranks forked from this process's warm forkserver), bounded:
    past ``timeout`` its ranks are SIGKILLed, so the job fails naming them instead of holding the suite."""
    from multiprocessing import forkserver

    def stop() -> None:  # (the ranks: the forkserver's children; it stays, as does multiprocessing's tracker)
        server = getattr(forkserver._forkserver, "_forkserver_pid", None)
        for pid in descendants(server) if server else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    timer = threading.Timer(timeout, stop)
    timer.daemon = True
    timer.start()
    try:
        return cli.main(argv)
    finally:
        timer.cancel()


def _train(*argv: str) -> list[str]:
    return [sys.executable, "-m", "hybridembed.cli", "train", *argv]


def _final(ckpt: Path) -> dict[str, object]:
    """Every file of the checkpoint's committed version but its manifest, loaded (rows, optimizer state, dense);
    a chain of incremental versions is first written again as one full version (``compact``)."""
    root = ckpt / cli.MODEL_DIR
    version = Path(compact(root))
    files = sorted(p for p in version.rglob("*.pt"))
    return {str(p.relative_to(version)): torch.load(p, weights_only=False) for p in files}


def _differences(a, b, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(set(a) ^ set(b))} differ"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.shape == b.shape and a.dtype == b.dtype
        if same and a.is_floating_point():
            same = torch.allclose(a, b, rtol=0, atol=1e-6)
        elif same:
            same = torch.equal(a, b)
        return [] if same else [f"{where}: tensors differ ({tuple(a.shape)} vs {tuple(b.shape)})"]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


@pytest.fixture(scope="module")
def data(generated) -> Path:
    return generated


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> dict[str, object]:
    """The final checkpoint of the same job never killed (spawned, no agent, one save at its end; run
    in this process, bounded: :func:`_in_process`)."""
    tmp = tmp_path_factory.mktemp("reference")
    assert _in_process(["--data", str(data), "--workdir", str(tmp), *FLAGS, "--checkpoint", str(tmp / "ckpt")]) == 0
    return _final(tmp / "ckpt")


def _log(path: Path) -> tuple[list[tuple[int, int]], list[tuple[int, int, str]]]:
    """(commits as (start, step), kills as (start, rank, where)) in the order they happened."""
    commits, kills = [], []
    for line in path.read_text().splitlines() if path.exists() else []:
        kind, start, rest = line.split(" ", 2)
        if kind == "commit":
            commits.append((int(start), int(rest)))
        else:
            rank, where = rest.split(" ", 1)
            kills.append((int(start), int(rank), where))
    return commits, kills


def test_killed_ranks_resume_their_last_commit_and_end_like_a_job_never_killed(data, reference, tmp_path):
    log, ckpt = tmp_path / "events.log", tmp_path / "ckpt"
    restarts = 2 * KILLS
    launch = ["launch", "--nproc", "2", "--max-restarts", str(restarts)]
    train_flags = [*FLAGS, *EVERY, "--data", str(data), "--workdir", str(tmp_path), "--checkpoint", str(ckpt)]
    t0 = time.perf_counter()
    r = _run([*launch, str(WORKER), str(log), str(KILLS), "7", *train_flags, "--max-restarts", str(restarts)])
    seconds = time.perf_counter() - t0
    commits, kills = _log(log)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    # one kill per start but the last: KILLS while training, KILLS while saving
    assert [k[0] for k in kills] == list(range(restarts)), kills
    assert sum(k[2].startswith("training") for k in kills) == KILLS, kills
    assert sum(k[2].startswith("saving") for k in kills) == KILLS, kills
    # nothing committed is lost: each start resumes at (or after) the last commit logged before it
    resumed = {int(m[3]): int(m[2]) for m in RESUMED.findall(r.stdout) if m[3]}
    for start in range(1, restarts + 1):
        before = [step for g, step in commits if g < start]
        if before:
            assert start in resumed and resumed[start] >= max(before), (start, resumed, commits)
    assert r.stdout.count("done in ") == 1 and "epoch 2/2" in r.stdout
    # and the job ends with the weights and optimizer state of the job never killed
    assert _differences(_final(ckpt), reference) == []
    print(f"\n{KILLS} + {KILLS} kills, {len(commits)} commits logged: {seconds:.1f} s", file=sys.stderr)


def _committed_step(ckpt: Path) -> int | None:
    """The step of the checkpoint committed now, None before the first commit."""
    for _ in range(20):  # a save may commit and drop the version between reading LATEST and its manifest
        try:
            return read_manifest(ckpt / cli.MODEL_DIR)["extra"][cli.STATE_KEY]["step"]
        except CheckpointError:
            if not (ckpt / cli.MODEL_DIR / "LATEST").exists():
                return None
            time.sleep(0.01)
    raise AssertionError(f"cannot read the committed checkpoint of {ckpt}")


def _kill_a_rank_after_a_commit(proc: subprocess.Popen, ckpt: Path, rng: random.Random) -> int:
    """SIGKILLs one of the two ranks once ``ckpt`` holds a commit; the step committed just before."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline and proc.poll() is None:
        ranks = forked_ranks(proc.pid)
        if (ckpt / cli.MODEL_DIR / "LATEST").exists() and len(ranks) == 2:
            time.sleep(rng.uniform(0.0, 0.3))
            step = _committed_step(ckpt)
            os.kill(rng.choice(ranks), signal.SIGKILL)
            return step
        time.sleep(0.05)
    raise AssertionError(f"no commit in {ckpt}; the job ended with {proc.poll()}")


def test_train_max_restarts_restarts_a_killed_rank_and_ends_like_a_job_never_killed(data, reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = _train("--data", str(data), "--workdir", str(tmp_path), *FLAGS, *EVERY, "--checkpoint", str(ckpt))
    proc = subprocess.Popen([*argv, "--max-restarts", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env())  # fmt: skip
    try:
        committed = _kill_a_rank_after_a_commit(proc, ckpt, random.Random(3))
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
    assert proc.returncode == 0, (out, err)
    assert re.search(r"^hybridembed train: rank [01] \(pid \d+\) was killed by SIGKILL; restarting all 2 processes "
                     r"\(restart 1 of 1\)$", err, re.M), err  # fmt: skip
    assert "Traceback" not in err and "torch.distributed.elastic" not in err, err  # the agent's output summarised
    (where, _, step, restart), *_ = RESUMED.findall(out)
    assert where == str(ckpt) and restart == "1" and int(step) >= committed > 0, (out, committed)
    assert _differences(_final(ckpt), reference) == []


def test_when_no_restart_is_left_the_command_says_so_in_two_lines(generated, tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = _train("--data", str(generated), "--workdir", str(tmp_path), "--no-progress", "--threads", "1",
                  "--max-rows", "400", "--batch-size", "8", "--holdout", "0", "--embedding-dim", "4", "--mlp", "8",
                  "--bottom-mlp", "4", "--no-export", "--checkpoint", str(ckpt), "--checkpoint-every", "2",
                  "--nproc", "1", "--max-restarts", "0")  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        pointer = ckpt / cli.MODEL_DIR / "LATEST"
        deadline = time.monotonic() + TIMEOUT
        while not pointer.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        (rank,) = forked_ranks(proc.pid)  # --nproc 1: one process under the agent
        os.kill(rank, signal.SIGKILL)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
    assert proc.returncode == 1, (out, err)
    assert err.strip().splitlines() == [
        f"hybridembed train: error: rank 0 (pid {rank}) was killed by SIGKILL; no restart left (0 of --max-restarts 0 "
        "used)",
        f"hybridembed train: the last committed checkpoint is in {ckpt}; the same command continues from it",
    ]


# --- flags ----------------------------------------------------------------------------------------------------
def test_max_restarts_is_an_int_of_at_least_0_and_needs_checkpoints(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--max-restarts", "-1"])
    assert e.value.code == 2 and "--max-restarts: expected a int >= 0, got '-1'" in capsys.readouterr().err
    assert cli.main(["--max-restarts", "2", "--no-checkpoint", "--workdir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--max-restarts 2 restarts from checkpoints" in err[0] and "--no-checkpoint" in err[0]
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_the_agent_is_configured_as_torchrun_with_train_s_own_flags():
    cmd = elastic.torchrun_command(1, 4, ["--nproc", "1", "--max-restarts", "4"])
    assert cmd[:3] == [sys.executable, "-m", "hybridembed.launch.local_run"]  # (torchrun, stores on loopback)
    assert cmd[3:] == ["--nproc-per-node", "1", "--standalone", "--local-addr", "127.0.0.1", "--max-restarts", "4",
                       "--module", "--", "hybridembed.cli", "train", "--nproc", "1", "--max-restarts", "4"]  # fmt: skip
    config = elastic.launch_config(2, 4)  # (torchrun's config of those flags, the processes forked from the forkserver)
    assert (config.nproc_per_node, config.max_restarts, config.min_nodes, config.max_nodes) == (2, 4, 1, 1)
    assert (config.start_method, config.local_addr, config.rdzv_backend) == ("forkserver", "127.0.0.1", "c10d")
    assert config.rdzv_endpoint == "localhost:0" and config.run_id != elastic.launch_config(2, 4).run_id


def test_a_start_under_the_agent_resumes_only_a_committed_checkpoint(tmp_path, monkeypatch):
    (tmp_path / "ckpt" / cli.MODEL_DIR / "v-000001").mkdir(parents=True)  # a save that died before its commit
    assert elastic.checkpoint_to_resume(str(tmp_path / "ckpt"), cli.MODEL_DIR) is None
    assert elastic.checkpoint_to_resume(None, cli.MODEL_DIR) is None
    (tmp_path / "ckpt" / cli.MODEL_DIR / "LATEST").write_text("v-000001\n")
    assert elastic.checkpoint_to_resume(str(tmp_path / "ckpt"), cli.MODEL_DIR) == str(tmp_path / "ckpt")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert elastic.restart_count() is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    assert elastic.restart_count() == 3


def test_torchrun_may_restart_only_with_a_rendezvous_store_of_each_start(monkeypatch):
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    # the store shared across starts keeps the previous start's keys: restarted ranks fail to connect
    assert launch.restart_env(3)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in launch.restart_env(0)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")  # the user's choice stands
    assert launch.restart_env(3)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "0"


def test_a_restarted_rank_of_a_complete_run_has_nothing_to_train(generated, tmp_path, capsys, monkeypatch):
    ckpt = tmp_path / "ckpt"
    flags = ["--data", str(generated), "--workdir", str(tmp_path), "--no-progress", "--threads", "1", "--max-rows",
             "200", "--holdout", "0", "--embedding-dim", "4", "--mlp", "8", "--bottom-mlp", "4", "--batch-size", "64",
             "--no-export", "--checkpoint", str(ckpt)]  # fmt: skip
    assert cli.main(flags) == 0  # one process, to the end
    capsys.readouterr()
    # a start of a one-process elastic job (--nproc 1 under the agent) whose previous start died after the last save
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "2"}.items():
        monkeypatch.setenv(k, v)
    assert cli.main([*flags, "--max-restarts", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"^resumed from {re.escape(str(ckpt))} \(epoch 1, step 4\) after restart 2$", out, re.M), out
    assert "nothing to train: the checkpoint has done 1 of --epochs 1" in out
    assert f"checkpoint: {ckpt} (unchanged: nothing was left to train)" in out
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # the first start: the same command run again
    assert cli.main([*flags, "--max-restarts", "2"]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {ckpt} (epoch 1, step 4) (its last committed checkpoint)" in out, out


def test_the_agent_s_output_is_summarised_and_the_command_s_own_errors_exit_2(capfd, monkeypatch):
    import logging

    def agent(starts):  # the agent's records of each failed start, as it logs them
        failed = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
        for start in range(starts):
            logging.getLogger("torch.distributed.elastic.agent.server.api").warning("Closing process 1 via SIGTERM")
            failed.error("failed (exitcode: 2) local_rank: 1 (pid: %s) of fn: _rank (start_method: forkserver)",
                         4242 + start, exc_info=(ValueError, ValueError("bad row 7"), None))  # fmt: skip
        print("hybridembed train: error: bad row 7 (rank 1 of 2)", file=sys.stderr)  # (the processes' own lines)
        raise ChildFailedError("_rank", {})

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    monkeypatch.setattr("torch.distributed.launcher.api.elastic_launch", lambda config, fn: lambda *a: agent(2))
    code = elastic.run_elastic([], prog="hybridembed train", nproc=2, max_restarts=1, checkpoint=None, threads=1,
                               model_dir=cli.MODEL_DIR)  # fmt: skip
    assert code == 2  # the last start failed as bad data does: a restart would not mend it
    assert capfd.readouterr().err.splitlines() == [
        "hybridembed train: rank 1 (pid 4242) exited with code 2; restarting all 2 processes (restart 1 of 1)",
        "hybridembed train: error: bad row 7 (rank 1 of 2)",
        "hybridembed train: error: rank 1 (pid 4243) exited with code 2; no restart left (1 of --max-restarts 1 used)",
    ]
    monkeypatch.setattr("torch.distributed.launcher.api.elastic_launch", lambda config, fn: lambda *a: None)
    assert elastic.run_elastic([], prog="p", nproc=2, max_restarts=1, checkpoint=None, threads=1,
                               model_dir=cli.MODEL_DIR) == 0  # fmt: skip
    assert capfd.readouterr().err == ""
    assert not logging.getLogger("torch.distributed.elastic").handlers  # (the agent's loggers as they were)
