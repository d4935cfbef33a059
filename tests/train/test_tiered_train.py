"""``hybridembed train --tiered DIR``: the main job with its tables on disk (dense tables of
--capacity rows, ids hashed into them, a cache in memory): it trains, checkpoints, resumes as a
run never stopped, exports; what it cannot do yet is refused before anything starts.

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
    straight = _run(
        [*base, "--workdir", str(tmp_path / "a"), "--tiered", str(tmp_path / "a/tiers"), "--epochs", "2"], capsys
    )
    assert "26 tiered tables (dim 4, 5,000 rows each, ids hashed into them" in straight
    hit = re.search(r"cache hit rate ([\d.]+) so far \(([\d,]+) rows read from disk\)", straight)
    assert hit and 0 < float(hit.group(1)) < 1 and int(hit.group(2).replace(",", "")) > 0, straight  # (evictions)
    b = ["--workdir", str(tmp_path / "b"), "--tiered", str(tmp_path / "b/tiers")]
    first = _run([*base, *b, "--epochs", "1"], capsys)
    assert _epoch(first, 1) == _epoch(straight, 1)
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
        (["--nproc", "2"], "runs in one process"),
        (["--capacity", "0"], "needs --capacity N > 0"),
        (["--min-count", "2"], "drop --min-count"),
        (["--tiered-cache", "100"], "--tiered-cache 100 rows cannot hold a batch's rows"),
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
    _run([*argv, "--tiered", str(tmp_path / "tiers"), "--tiered-cache", "9000"], capsys)
    assert cli.main([*argv, "--resume", str(tmp_path / "checkpoint"), "--epochs", "2"]) == 2
    assert "give --tiered DIR to resume" in capsys.readouterr().err
    _run([*argv, "--workdir", str(tmp_path / "dyn"), "--no-export"], capsys)  # dynamic tables in memory
    again = [*argv, "--resume", str(tmp_path / "dyn/checkpoint"), "--tiered", str(tmp_path / "t2"), "--epochs", "2"]
    assert cli.main(again) == 2
    assert "the checkpoint's tables are dynamic tables in memory; resume without --tiered" in capsys.readouterr().err
