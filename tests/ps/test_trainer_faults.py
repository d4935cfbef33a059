"""Parameter servers when a trainer fails, dies, stops or leaves: every survivor ends, naming it.

Jobs of separate ``python`` processes (``tests/distributed/job_script.py``: 2 trainers, rank 2
serves, DDP off so nothing but the servers ties the trainers together), as torchrun runs them."""

from __future__ import annotations

import pytest

from tests.distributed.jobs import run_job

SCRIPT = "tests/distributed/job_script.py"
TIMEOUT = 8.0
ENV = {"JOB_TIMEOUT": str(TIMEOUT), "JOB_STEPS": "8", "JOB_DDP": "0"}


def test_a_trainer_that_raises_fails_the_other_trainer_and_the_server_naming_it():
    ranks = run_job(SCRIPT, ["1", "raise", "1", "2"], 3, timeout=60, env=ENV)
    assert ranks[1].code == 1 and ranks[1].error == "RuntimeError: boom in the training loop", ranks[1].err[-2000:]
    for r in (ranks[0], ranks[2]):
        assert r.code == 1, (r.rank, r.err[-2000:])
        assert "trainer 1 failed: RuntimeError: boom in the training loop" in r.error, r.error
        assert r.seconds < 30, r.seconds


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_trainer_killed_or_stopped_is_named_by_the_other_trainer_and_the_server(fault):
    ranks = run_job(SCRIPT, ["1", fault, "1", "2"], 3, timeout=90, env=ENV, linger={1})
    for r in (ranks[0], ranks[2]):
        assert r.code == 1, (r.rank, r.err[-2000:])
        named = ("trainer 1 is dead or stopped", "rank 1 is dead or stopped", "lost a trainer")
        assert any(n in r.error for n in named), r.error
        assert r.seconds < TIMEOUT + 30 + 15, r.seconds  # (the job's timeout + 30 s, after a start of ~15 s)


def test_a_server_whose_trainers_were_all_killed_ends_within_the_timeout():
    ranks = run_job(SCRIPT, ["1", "kill", "0,1", "2"], 3, timeout=90, env=ENV)
    server = ranks[2]
    assert server.code == 1 and server.error.startswith("hybridembed.errors.RankLost: "), server.err[-2000:]
    assert "trainer 0" in server.error, server.error
    assert server.seconds < TIMEOUT + 30 + 15, server.seconds


def test_a_script_that_ends_with_destroy_process_group_ends():
    ranks = run_job(SCRIPT, ["1", "destroy", "0,1,2", "0"], 3, timeout=60, env=ENV)
    assert [r.code for r in ranks] == [0, 0, 0], [r.err[-1500:] for r in ranks]
    assert max(r.seconds for r in ranks) < 40
