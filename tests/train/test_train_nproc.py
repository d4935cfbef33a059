"""``hybridembed train --nproc N`` (one gloo job, tables sharded, rank 0 prints) and
``hybridembed launch`` (torchrun): world 2 against world 1 on the same data, errors, launching.

    python -m pytest -q tests/train/test_train_nproc.py

Each job spawns processes (several seconds each on a small machine): every test that starts
one checks several things at once.
"""

from __future__ import annotations

import os
import re
import subprocess
import textwrap

import pytest
import torch

pytest.importorskip("pyarrow", reason="the train tests need pyarrow (pip install 'hybridembed[train]')")

from hybridembed import cli as top  # noqa: E402
from hybridembed.launch import SpawnError, spawn  # noqa: E402
from hybridembed.launch import cli as launch  # noqa: E402
from hybridembed.train import cli  # noqa: E402
from hybridembed.train.data import Batch  # noqa: E402
from hybridembed.train.parallel import Job  # noqa: E402
from tests import warm  # noqa: E402

SMALL = ["--embedding-dim", "4", "--mlp", "16", "--bottom-mlp", "8", "--capacity", "20000", "--batch-size", "128"]
EPOCH = re.compile(r"^epoch 1/1  train loss ([\d.]+)  test loss ([\d.]+)  AUC ([\d.]+)  ([\d,]+) samples", re.M)


def _argv(generated, tmp_path, *extra: str) -> list[str]:
    return ["--data", str(generated), "--workdir", str(tmp_path), "--no-progress", "--threads", "1", *SMALL, *extra]


# --- slicing the global batch ---------------------------------------------------------------------------
def test_each_rank_takes_its_slice_of_the_global_batch():
    b = Batch(torch.arange(10.0).reshape(5, 2), torch.arange(5).reshape(5, 1), torch.arange(5.0))
    assert Job().part(b) is b
    parts = [Job(r, 2).part(b) for r in range(2)]
    assert [p.label.tolist() for p in parts] == [[0.0, 1.0], [2.0, 3.0, 4.0]]  # rows [r B/N, (r+1) B/N)
    parts = [Job(r, 3).part(b) for r in range(3)]
    assert torch.cat([p.sparse for p in parts]).equal(b.sparse)  # every row once, in order
    assert torch.cat([p.dense for p in parts]).equal(b.dense)


# --- the command at world 2 -------------------------------------------------------------------------------
def test_nproc_2_trains_like_one_process_and_rank_0_prints_once(generated, tmp_path, capfd):
    assert cli.main(_argv(generated, tmp_path / "w1", "--no-checkpoint", "--no-export")) == 0
    one = EPOCH.findall(capfd.readouterr().out)
    code = cli.main(_argv(generated, tmp_path / "w2", "--nproc", "2", "--checkpoint", str(tmp_path / "ckpt")))
    out, err = capfd.readouterr()  # the ranks write to the process's stdout
    assert code == 0, err
    two = EPOCH.findall(out)
    assert len(one) == 1 and len(two) == 1, out  # rank 0 alone prints
    for head in ("hybridembed train: ", "model dlrm: ", "done in "):
        assert len(re.findall(f"^{head}", out, re.M)) == 1, out
    assert "sharded over 2 processes" in out and "~64 per process" in out
    (loss1, test1, auc1, rows1), (loss2, test2, auc2, rows2) = one[0], two[0]
    assert rows1 == rows2  # global samples
    assert abs(float(auc1) - float(auc2)) < 0.01, (one, two)  # same steps on the same data
    assert abs(float(loss1) - float(loss2)) < 0.01 and abs(float(test1) - float(test2)) < 0.01
    # checkpoint and export at world 2: written, as in one process
    assert re.search(r"^checkpoint: \S+ \(after epoch 1\)$", out, re.M)
    assert re.search(r"^export: \S+ \(pt2", out, re.M)


def test_the_pipelined_job_trains_as_the_unpipelined_one(generated, tmp_path, capfd):
    """``--pipeline``: each batch's ids are sent a step ahead (``ec.prefetch`` after the forward):
    the same steps, the same figures as without."""
    flags = ("--nproc", "2", "--no-checkpoint", "--no-export", "--model", "dcnv2")
    assert cli.main(_argv(generated, tmp_path / "a", *flags, "--pipeline")) == 0
    piped = capfd.readouterr().out
    assert cli.main(_argv(generated, tmp_path / "b", *flags)) == 0
    plain = capfd.readouterr().out
    assert "ids sent a step ahead" in piped and "ids sent a step ahead" not in plain
    assert EPOCH.findall(piped) and [x[:3] for x in EPOCH.findall(piped)] == [x[:3] for x in EPOCH.findall(plain)]


def test_under_torchrun_each_process_joins_the_job(generated, tmp_path):
    argv = ["launch", "--nproc", "2", "-m", "hybridembed.cli", "train"]
    rc, out, err = warm.run_module(
        "hybridembed.cli", [*argv, *_argv(generated, tmp_path, "--no-checkpoint", "--no-export")], dict(os.environ),
        tmp_path, timeout=240,
    )  # fmt: skip
    r = subprocess.CompletedProcess(argv, rc, out, err)
    assert r.returncode == 0, r.stderr
    assert len(EPOCH.findall(r.stdout)) == 1 and r.stdout.count("done in ") == 1, r.stdout  # rank 0 prints
    assert "sharded over 2 processes" in r.stdout


def test_nproc_2_checkpoints_resume_at_world_2_and_at_another_world_size(generated, tmp_path, capfd):
    ckpt = str(tmp_path / "ckpt")
    assert cli.main(_argv(generated, tmp_path, "--checkpoint", ckpt, "--no-export", "--nproc", "2")) == 0
    out = capfd.readouterr().out
    assert "skipped" not in out, out
    code = cli.main(_argv(generated, tmp_path, "--resume", ckpt, "--epochs", "2", "--nproc", "2", "--no-export"))
    out, err = capfd.readouterr()
    assert code == 0 and "resumed from" in out and re.search(r"^epoch 2/2 ", out, re.M), (out, err)
    one = str(tmp_path / "one")  # written by one process: each of 2 ranks reads the rows its shards hold
    assert cli.main(_argv(generated, tmp_path, "--checkpoint", one, "--no-export")) == 0
    capfd.readouterr()
    code = cli.main(_argv(generated, tmp_path, "--resume", one, "--epochs", "2", "--nproc", "2", "--no-export"))
    out, err = capfd.readouterr()
    assert code == 0 and "resumed from" in out and re.search(r"^epoch 2/2 ", out, re.M), (out, err)


def test_bad_flags_exit_2_before_any_process_starts(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit) as e:
        cli.main(["--nproc", "0"])
    assert e.value.code == 2 and "--nproc: expected a int > 0, got '0'" in capsys.readouterr().err
    assert cli.main(["--nproc", "2", "--batch-size", "1", "--workdir", str(tmp_path)]) == 2
    assert "--batch-size 1 is smaller than --nproc 2" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main(["--nproc", "3", "--workdir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--nproc 3 differs from this torchrun job's WORLD_SIZE 2" in err and "(rank 0 of 2)" in err
    assert not any(tmp_path.iterdir())


class _Joined(Exception):
    pass


def test_timeout_is_the_jobs_process_group_timeout(generated, tmp_path, monkeypatch):
    from datetime import timedelta

    import torch.distributed as dist

    import hybridembed.launch as launch_mod

    seen = {}

    def fake_spawn(fn, nprocs, *args, **kwargs):
        seen["spawn"] = kwargs["pg_timeout"]
        return [0] * nprocs

    def fake_init(backend, **kwargs):
        seen["init"] = kwargs.get("timeout")
        raise _Joined  # (no job to join here)

    monkeypatch.setattr(launch_mod, "spawn", fake_spawn)
    monkeypatch.setattr(dist, "init_process_group", fake_init)
    assert cli.main(_argv(generated, tmp_path, "--nproc", "2")) == 0  # spawned ranks
    assert seen["spawn"] == cli.JOB_PG_TIMEOUT == 1800  # torch's default for gloo, unless --timeout
    assert cli.main(_argv(generated, tmp_path, "--nproc", "2", "--timeout", "7.5")) == 0
    assert seen["spawn"] == 7.5
    monkeypatch.setenv("RANK", "0")  # under torchrun: this process joins the job
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(_Joined):
        cli.main(_argv(generated, tmp_path, "--timeout", "12"))
    assert seen["init"] == timedelta(seconds=12)


def test_an_error_in_the_ranks_ends_the_job_with_one_line(generated, tmp_path, capfd):
    lines = generated.read_text().splitlines()
    lines[2000] = lines[2000].replace("\t", "\t7\t", 1)  # 41 columns
    bad = tmp_path / "bad.tsv"
    bad.write_text("\n".join(lines) + "\n")
    code = cli.main(_argv(bad, tmp_path, "--nproc", "2", "--no-checkpoint", "--no-export"))
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and re.match(r"hybridembed train: error: .*bad\.tsv.*line 2001.*\(rank [01] of 2\)$", err[0])


# --- spawn's failures carry the rank and its exception ------------------------------------------------------
def _fail_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise cli.UsageError("rank 1 cannot go on")
    torch.distributed.barrier()  # rank 0 waits on a peer that is gone: stopped, no hang
    return rank


def test_spawn_error_carries_the_failing_rank_and_its_exception():
    with pytest.raises(SpawnError) as e:
        spawn(_fail_on_rank_1, 2, timeout=120, grace=2)
    assert e.value.rank == 1
    assert isinstance(e.value.error, cli.UsageError) and str(e.value.error) == "rank 1 cannot go on"


# --- hybridembed launch -------------------------------------------------------------------------------------
SCRIPT = """
    import sys
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    with open(f"{sys.argv[1]}/rank{rank}", "w") as f:
        f.write(f"{dist.get_world_size()} {t.item():g} {' '.join(sys.argv[2:])}")
    if "--fail" in sys.argv and rank == 1:
        raise RuntimeError("rank 1 fails")
    dist.destroy_process_group()
"""


def _launch(tmp_path, *argv: str, flags=("--nproc", "2")) -> subprocess.CompletedProcess:
    """``python -m hybridembed.cli launch FLAGS job.py TMP ARGV`` as a warm process (tests/warm.py: the
    command's own imports done once; torchrun starts the ranks as new interpreters)."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT))
    cmd = ["launch", *flags, str(script), str(tmp_path), *argv]
    rc, out, err = warm.run_module("hybridembed.cli", cmd, dict(os.environ), tmp_path, timeout=240)
    return subprocess.CompletedProcess(cmd, rc, out, err)


def test_launch_runs_every_rank_of_the_job(tmp_path):
    # torchrun's own flag names, and one of its flags launch does not know (passed to it: its logs appear)
    logs = tmp_path / "logs"
    flags = ("--nproc-per-node", "2", "--log-dir", str(logs), "--redirects", "3")
    r = _launch(tmp_path, "a", "--b", "--nproc", "3", flags=flags)  # the script's flags, whatever torchrun's are named
    assert r.returncode == 0, r.stderr
    assert [(tmp_path / f"rank{i}").read_text() for i in range(2)] == ["2 3 a --b --nproc 3"] * 2  # all_reduce
    assert sorted(p.name for p in logs.rglob("stdout.log")) == ["stdout.log", "stdout.log"]


def test_launch_fails_when_a_rank_fails(tmp_path):
    r = _launch(tmp_path, "--fail")
    assert r.returncode != 0
    assert "rank 1 fails" in r.stderr


@pytest.mark.parametrize(
    "argv, torchrun",
    [
        (["--nproc", "4", "t.py", "--lr", "1"], ["--nproc-per-node", "4", "--standalone", "--local-addr", "127.0.0.1",
                                                 "--max-restarts", "0", "--", "t.py", "--lr", "1"]),
        (
            ["--nproc", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "h0", "--master-port", "29400",
             "--max-restarts", "3", "t.py"],
            ["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "h0", "--master-port",
             "29400", "--max-restarts", "3", "--", "t.py"],
        ),
        (
            ["--nproc", "8", "--nnodes", "1:4", "--rdzv-endpoint", "h0:29400", "--rdzv-id", "job7", "-m", "pkg.train"],
            ["--nproc-per-node", "8", "--nnodes", "1:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h0:29400",
             "--rdzv-id", "job7", "--max-restarts", "0", "--module", "--", "pkg.train"],
        ),
    ],
)  # fmt: skip
def test_launch_flags_become_torchruns(argv, torchrun):
    assert launch.torchrun_argv(launch.build_parser().parse_args(argv)) == torchrun


def test_launch_takes_torchruns_own_flag_names_and_passes_on_the_rest():
    parser = launch.build_parser()
    argv = [
        "--nproc_per_node=2",
        "--max_restarts",
        "1",
        "--monitor-interval",
        "0.5",
        "--tee=3",
        "t.py",
        "--log-dir",
        "x",
    ]
    mine, passed = launch.split_torchrun_flags(argv, parser)
    assert passed == ["--monitor-interval", "0.5", "--tee=3"]  # (the script's own --log-dir stays the script's)
    args = parser.parse_args(mine)
    args.torchrun_flags = passed
    assert launch.torchrun_argv(args) == [
        "--nproc-per-node", "2", "--standalone", "--local-addr", "127.0.0.1", "--max-restarts", "1",
        "--monitor-interval", "0.5", "--tee=3", "--", "t.py", "--log-dir", "x",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--nnodes", "2", "t.py"], "--nnodes 2 needs --master-addr"),
        (["--master-port", "29400", "t.py"], "--master-port goes with --master-addr"),
        (["--rdzv-endpoint", "h:1", "--master-addr", "h", "t.py"], "--rdzv-endpoint replaces --master-addr"),
        (["--nnodes", "two", "--master-addr", "h", "t.py"], "--nnodes: expected N or MIN:MAX"),
        (["missing.py"], "missing.py: no such file (for a module, add -m)"),
        (["--standalone", "--nnodes", "2", "--master-addr", "h", "t.py"], "--standalone is one machine alone"),
    ],
)
def test_launch_bad_flags_are_one_line(argv, needle, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("")
    assert launch.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hybridembed launch: error: ") and needle in err[0]
    with pytest.raises(SystemExit) as e:
        launch.main(["--nproc", "0", "t.py"])
    assert e.value.code == 2 and "--nproc: expected an int >= 1, got '0'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "endpoint", ["::::", "host:", ":29500", "host:99999", "host:port:extra", "h:0", "[zz]:1", "::1"]
)
def test_launch_malformed_rdzv_endpoint_is_one_line(endpoint, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("")
    with pytest.raises(SystemExit) as e:  # (before torchrun starts: it would end in its traceback)
        launch.main(["--nnodes", "2", "--rdzv-endpoint", endpoint, "t.py"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("hybridembed launch: error: argument --rdzv-endpoint: expected HOST or HOST:PORT")
    assert repr(endpoint) in err[0]


@pytest.mark.parametrize(
    "endpoint", ["h0", "h0:29400", "10.0.0.1:29400", "node-1.cluster.local:1", "[::1]:29400", "[::1]"]
)
def test_launch_well_formed_rdzv_endpoints_reach_torchrun(endpoint):
    args = launch.build_parser().parse_args(["--nnodes", "2", "--rdzv-endpoint", endpoint, "t.py"])
    assert launch.torchrun_argv(args)[6:8] == ["--rdzv-endpoint", endpoint]


def test_dispatcher_lists_launch(capsys):
    assert top.main([]) == 2
    assert "launch" in capsys.readouterr().out


# --- on GPUs (skipped without CUDA) -----------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_a_gpu_trainer_with_a_host_server_trains_like_the_cpu_job(generated, tmp_path, capfd):
    """One GPU is enough: the trainer takes cuda:0 (its group over NCCL), the server the host."""
    ps = ["--nproc", "2", "--servers", "1", "--model", "dlrm", "--no-export"]
    assert cli.main(_argv(generated, tmp_path / "cpu", *ps, "--no-checkpoint")) == 0
    host = EPOCH.findall(capfd.readouterr().out)
    ckpt = str(tmp_path / "ckpt")
    assert cli.main(_argv(generated, tmp_path / "gpu", *ps, "--device", "cuda", "--checkpoint", ckpt)) == 0
    out = capfd.readouterr().out
    gpu = EPOCH.findall(out)
    assert len(host) == 1 and len(gpu) == 1, out
    assert "on cuda" in out, out
    (loss1, test1, auc1, rows1), (loss2, test2, auc2, rows2) = host[0], gpu[0]
    assert rows1 == rows2 and abs(float(auc1) - float(auc2)) < 0.01, (host, gpu)
    assert abs(float(loss1) - float(loss2)) < 0.01 and abs(float(test1) - float(test2)) < 0.01
    # the GPU job's checkpoint resumes in one CPU process
    assert cli.main(_argv(generated, tmp_path / "cpu1", "--resume", ckpt, "--epochs", "2", "--no-export")) == 0
    assert "epoch 2/2" in capfd.readouterr().out
    # asynchronous, with the hot-row cache on the GPU and the pulls sent a step ahead
    fast = ["--ps-mode", "async", "--cache-rows", "2000", "--prefetch", "--no-checkpoint"]
    assert cli.main(_argv(generated, tmp_path / "async", *ps, "--device", "cuda", *fast)) == 0
    ((loss3, _, auc3, rows3),) = EPOCH.findall(capfd.readouterr().out)
    assert rows3 == rows1 and abs(float(auc3) - float(auc1)) < 0.03 and abs(float(loss3) - float(loss1)) < 0.03


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_nproc_2_on_two_gpus_trains_like_the_cpu_job(generated, tmp_path, capfd):
    assert cli.main(_argv(generated, tmp_path / "cpu", "--nproc", "2", "--no-checkpoint", "--no-export")) == 0
    host = EPOCH.findall(capfd.readouterr().out)
    assert cli.main(_argv(generated, tmp_path / "gpu", "--nproc", "2", "--device", "cuda", "--no-export")) == 0
    gpu = EPOCH.findall(capfd.readouterr().out)
    assert len(host) == 1 and len(gpu) == 1
    assert abs(float(host[0][2]) - float(gpu[0][2])) < 0.01 and abs(float(host[0][0]) - float(gpu[0][0])) < 0.01
