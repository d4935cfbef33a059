"""``hybridembed train --tiered DIR``: the main job with its tables on disk (dense tables of
--capacity rows, ids hashed into them, a cache in memory; with --capacity 0 its dynamic tables,
rows beyond the cache spilled to disk): it trains, checkpoints, resumes as a run never stopped,
exports; what it cannot do yet is refused before anything starts.

    python -m pytest -q tests/train/test_tiered_train.py
"""

from __future__ import annotations

import re

import pytest

from hybridembed.train import cli

SMALL = ["--embedding-dim", "4", "--mlp", "16", "--bottom-mlp", "8", "--capacity", "5000", "--batch-size", "128"]


def _run(argv, capsys) -> str:
    assert cli.main(argv) == 0
    return capsys.readouterr().out


def _epoch(out: str, n: int) -> str:
    return re.search(rf"^epoch {n}/\d+  (train loss [\d.]+  test loss [\d.]+  AUC [\d.]+)", out, re.M).group(1)


def test_tiered_tables_train_checkpoint_resume_like_one_run_and_export(generated, tmp_path, capsys):
    base = ["--data", str(generated), "--no-progress", "--threads", "1", *SMALL, "--tiered-cache", "9000"]
    straight = _run(  # (--prefetch: the next batch's rows on disk read in a thread during the step; not mapped)
        [*base, "--workdir", str(tmp_path / "a"), "--tiered", str(tmp_path / "a/tiers"), "--epochs", "2", "--prefetch"]
        + ["--tiered-mapped", "no"],
        capsys,
    )
    assert "26 tiered tables (dim 4, 5,000 rows each, ids hashed into them" in straight
    hit = re.search(
        r"cache hit rate ([\d.]+) so far \(([\d,]+) rows read from disk in the step, ([\d,]+) ahead", straight
    )
    assert hit and 0 < float(hit.group(1)) < 1, straight
    assert int(hit.group(3).replace(",", "")) > 0, straight  # (evicted rows read back, the next batch's ahead of it)
    b = ["--workdir", str(tmp_path / "b"), "--tiered", str(tmp_path / "b/tiers")]
    first = _run([*base, *b, "--epochs", "1"], capsys)
    assert _epoch(first, 1) == _epoch(straight, 1)  # (without --prefetch, the files mapped: the same)
    assert re.search(r"rows read from disk in the step, 0 ahead of it", first), first
    assert not (tmp_path / "a/model.pt2").exists()  # (no export unless asked: it holds every table in memory)
    resumed = _run(
        [*base, *b, "--resume", str(tmp_path / "b/checkpoint"), "--epochs", "2", "--export", str(tmp_path / "m.pt2")],
        capsys,
    )
    assert _epoch(resumed, 2) == _epoch(straight, 2)  # (rows and Adagrad state came back through the tiers)
    assert (tmp_path / "m.pt2").is_file()


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--min-count", "2"], "drop --min-count"),
        (["--tiered-cache", "100"], "--tiered-cache 100 rows cannot hold a batch's rows"),
        (["--nproc", "2", "--prefetch"], "--prefetch applies to parameter servers"),  # (or one process)
    ],
)
def test_what_tiered_tables_cannot_do_is_refused_before_training(extra, needle, generated, tmp_path, capsys):
    argv = ["--data", str(generated), "--no-progress", "--workdir", str(tmp_path), *SMALL]
    assert cli.main([*argv, "--tiered", str(tmp_path / "tiers"), *extra]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "checkpoint").exists()


def test_tiered_cache_alone_and_a_tiered_checkpoint_without_tiered_are_refused(generated, tmp_path, capsys):
    argv = ["--data", str(generated), "--no-progress", "--workdir", str(tmp_path), *SMALL, "--epochs", "1"]
    assert cli.main([*argv, "--tiered-cache", "9000"]) == 2
    assert "--tiered-cache applies to --tiered DIR only" in capsys.readouterr().err
    assert cli.main([*argv, "--tiered-mapped", "yes"]) == 2
    assert "--tiered-mapped applies to --tiered DIR only" in capsys.readouterr().err
    assert cli.main([*argv, "--tiered", " ", "--tiered-cache", "9000"]) == 2
    assert "--tiered needs a directory (DIR), got an empty one" in capsys.readouterr().err
    _run([*argv, "--tiered", str(tmp_path / "tiers"), "--tiered-cache", "9000"], capsys)
    assert cli.main([*argv, "--resume", str(tmp_path / "checkpoint"), "--epochs", "2"]) == 2
    assert "give --tiered DIR to resume" in capsys.readouterr().err
    _run([*argv, "--workdir", str(tmp_path / "dyn"), "--no-export"], capsys)  # dynamic tables in memory
    again = [*argv, "--resume", str(tmp_path / "dyn/checkpoint"), "--tiered", str(tmp_path / "t2"), "--epochs", "2"]
    assert cli.main(again) == 2
    assert "the checkpoint's tables are dynamic tables, not hashed ones: drop --capacity" in capsys.readouterr().err
    assert cli.main([a for a in again if a not in ("--capacity", "5000")]) == 2  # (its tables evict past 5,000 rows)
    assert "with dynamic tables keeps every row (the checkpoint's --capacity 5000" in capsys.readouterr().err


def test_dynamic_tables_on_disk_train_as_in_memory_and_resume_from_either(generated, tmp_path, capsys):
    """--tiered DIR --capacity 0: the job's own dynamic tables (every id its row), rows beyond the
    cache on disk; every epoch's figures equal the same job in memory, and a checkpoint of either
    resumes in the other."""
    small = [a if a != "5000" else "0" for a in SMALL]  # (--capacity 0: unbounded)
    base = ["--data", str(generated), "--no-progress", "--threads", "1", *small, "--no-export"]
    memory = _run([*base, "--workdir", str(tmp_path / "m"), "--epochs", "2"], capsys)
    disk = ["--tiered", str(tmp_path / "tiers"), "--tiered-cache", "9000"]
    tiered = _run(
        [*base, "--workdir", str(tmp_path / "t"), *disk, "--epochs", "2", "--prefetch", "--tiered-mapped", "no"], capsys
    )
    assert "dynamic tables (26 features, dim 4, unbounded; rows beyond 9,000 in memory spilled" in tiered
    on_disk = re.search(
        r"table rows ([\d,]+) \(([\d,]+) on disk, ([\d,]+) read back so far, ([\d,]+) of them ahead", tiered
    )
    assert on_disk and int(on_disk.group(2).replace(",", "")) > 0 and int(on_disk.group(3).replace(",", "")) > 0
    assert int(on_disk.group(4).replace(",", "")) > 0, tiered  # (one process: the next batch's rows read ahead)
    assert re.search(r"table rows ([\d,]+)", memory).group(1) == on_disk.group(1)
    for n in (1, 2):
        assert _epoch(tiered, n) == _epoch(memory, n)
    one = _run([*base, "--workdir", str(tmp_path / "a"), "--epochs", "1"], capsys)  # in memory, resumed on disk
    back = [*base, "--workdir", str(tmp_path / "a"), "--resume", str(tmp_path / "a/checkpoint"), "--epochs", "2"]
    resumed = _run([a for a in back if a not in ("--capacity", "0")] + ["--tiered", str(tmp_path / "t2")], capsys)
    assert _epoch(one, 1) == _epoch(memory, 1) and _epoch(resumed, 2) == _epoch(memory, 2)
    tiered_one = [*base, "--workdir", str(tmp_path / "b"), *disk, "--epochs", "1"]  # on disk, resumed in memory
    _run([a if a != str(tmp_path / "tiers") else str(tmp_path / "t3") for a in tiered_one], capsys)
    again = _run(
        [*base, "--workdir", str(tmp_path / "b"), "--resume", str(tmp_path / "b/checkpoint"), "--epochs", "2"], capsys
    )
    assert _epoch(again, 2) == _epoch(memory, 2)


def test_a_job_of_2_processes_keeps_each_shard_on_its_disk_and_trains_as_in_memory(generated, tmp_path, capfd):
    """--nproc 2 --tiered DIR: each process's shards (their files under DIR, a cache each); the
    dynamic tables' figures equal the same job in memory, and its checkpoint resumes in one process;
    with a parameter server (--nproc 3 --servers 1) the server's disk holds them, the same figures;
    the hashed tables' equal one process's, and on a server's disk the collective job's."""

    def run(*argv: str) -> str:
        code = cli.main([*base, *argv])
        out, err = capfd.readouterr()
        assert code == 0, err
        return out

    small = [a if a != "5000" else "0" for a in SMALL]
    base = ["--data", str(generated), "--no-progress", "--threads", "1", "--no-export", "--holdout", "0.05", *small]
    disk = ["--tiered", str(tmp_path / "tiers"), "--tiered-cache", "5000"]  # (each shard holds ~8,700 rows)
    memory = run("--nproc", "2", "--workdir", str(tmp_path / "m"), "--epochs", "2", "--no-checkpoint")
    tiered = run("--nproc", "2", "--workdir", str(tmp_path / "t"), *disk, "--epochs", "1")
    assert "rows of each process's shards in memory; sharded over 2 processes" in tiered
    on_disk = re.search(r"table rows ([\d,]+) \(([\d,]+) on disk, ([\d,]+) read back so far", tiered)
    assert on_disk and int(on_disk.group(2).replace(",", "")) > 0, tiered  # (both ranks' shards counted)
    assert re.search(r"table rows ([\d,]+)", memory).group(1) == on_disk.group(1)
    assert _epoch(tiered, 1) == _epoch(memory, 1)
    assert sorted(p.name for p in (tmp_path / "tiers").glob("*.rows")) == ["C1@0.25.rows", "C1@1.25.rows"]
    servers = ["--nproc", "3", "--servers", "1", "--tiered", str(tmp_path / "ps"), "--tiered-cache", "5000"]
    served = run(*servers, "--workdir", str(tmp_path / "s"), "--epochs", "1", "--no-checkpoint")
    assert "rows beyond 5,000 a server in memory spilled to files under" in served
    assert _epoch(served, 1) == _epoch(memory, 1)  # (sync servers: as the collective job)
    assert [p.name for p in (tmp_path / "ps").glob("*.rows")] == ["C1@0.25.rows"]  # (on the server's disk)
    ck = str(tmp_path / "t/checkpoint")
    one = [a for a in base if a not in ("--capacity", "0")] + ["--tiered", str(tmp_path / "t1"), "--resume", ck]
    code = cli.main([*one, "--workdir", str(tmp_path / "t"), "--epochs", "2"])
    resumed = capfd.readouterr().out
    assert code == 0 and "resumed from" in resumed
    want, got = (
        re.search(r"^epoch 2/2  train loss ([\d.]+)  test loss ([\d.]+)  AUC ([\d.]+)", o, re.M)
        for o in (memory, resumed)
    )
    assert all(abs(float(a) - float(b)) < 0.01 for a, b in zip(want.groups(), got.groups())), (want, got)
    hashed = ["--capacity", "5000", "--tiered-cache", "5000", "--epochs", "1"]
    two = run("--nproc", "2", "--workdir", str(tmp_path / "h2"), "--tiered", str(tmp_path / "h2/tiers"), *hashed)
    alone = run("--workdir", str(tmp_path / "h1"), "--tiered", str(tmp_path / "h1/tiers"), *hashed)
    assert "26 tiered tables (26 features, dim 4, 5,000 rows each" in two
    a, b = (
        re.search(r"^epoch 1/1  train loss ([\d.]+)  test loss ([\d.]+)  AUC ([\d.]+)", o, re.M) for o in (two, alone)
    )
    assert all(abs(float(x) - float(y)) < 0.01 for x, y in zip(a.groups(), b.groups())), (a, b)
    where = tmp_path / "hs/tiers"  # the hashed tables on a parameter server's disk: as the collective job
    served = run(
        "--nproc",
        "3",
        "--servers",
        "1",
        "--workdir",
        str(tmp_path / "hs"),
        "--tiered",
        str(where),
        *hashed,
        "--prefetch",
    )
    assert (
        "26 tiered tables (dim 4, 5,000 rows each, ids hashed into them" in served and "on 1 parameter server" in served
    )
    assert _epoch(served, 1) == _epoch(two, 1) and re.search(r"cache hit rate 0\.\d+ so far", served), served
    assert [p.name for p in where.glob("*.rows")] == ["C1.25.rows"]
