"""One rank's fault is every rank's error, and no rank waits past the job's timeout.

Each job here runs ``tests/distributed/job_script.py`` as separate ``python`` processes (as
torchrun would), so unhandled exceptions, SIGKILL, SIGSTOP and ``destroy_process_group()``
behave as in a user's job; setup refusals run in :func:`spawn`'s ranks. Every job is bounded.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hybridembed as he
from hybridembed.distributed import health
from hybridembed.launch import spawn
from tests.distributed import job_script
from tests.distributed.jobs import run_job

SCRIPT = "tests/distributed/job_script.py"
BAD_EC = ["bad-dtype", "bad-missing", "bad-extra", "bad-weights", "bad-type", "bad-meta", "bad-range"]
BAD_PLAIN = ["bad-dtype", "bad-meta", "bad-range", "bad-offsets"]


def _reference(plain: bool, world: int, steps: int, skipped: set[int]) -> dict:
    """One process on the ranks' concatenated batches, skipping the same steps (the distributed
    job's reduction is the mean, as DDP's: the two are equal)."""
    model = he.convert(job_script.Plain()) if plain else job_script.Model()
    opt = he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model)
    for step in range(steps):
        if step in skipped:
            continue
        parts = [job_script.batch(step, r) for r in range(world)]
        x = {
            "a": torch.cat([p[0]["a"] for p in parts]),
            "b": he.Jagged.from_lists([bag for p in parts for bag in p[0]["b"].to_lists()]),
        }
        y = torch.cat([p[1] for p in parts])
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    ec = model.hybridembed if plain else model.ec
    return {n: ec.weight(n) for n in ("a", "b")}


def test_a_script_that_ends_without_destroying_its_process_group_has_it_destroyed_at_exit():
    """Most scripts end without destroy_process_group(): the library destroys the groups at exit,
    while the interpreter is whole (gloo's threads freeing tensors in its finalisation aborted a
    rank now and then: 'terminate called without an active exception', exit code -6)."""
    ranks = run_job(SCRIPT, ["0", "none", "1", "1"], 2, timeout=90, env={"JOB_STEPS": "2", "JOB_EXIT_CHECK": "1"})
    for r in ranks:
        assert r.code == 0 and "AT EXIT initialized=False" in r.out, (r.rank, r.code, r.out[-500:], r.err[-2000:])


@pytest.mark.parametrize("model", ["collection", "plain"])
def test_bad_input_on_one_rank_fails_the_step_on_every_rank_and_a_skipping_loop_finishes(model):
    faults = BAD_PLAIN if model == "plain" else BAD_EC
    steps = len(faults) + 2
    env = {"JOB_STEPS": str(steps), "JOB_MODEL": model}
    ranks = run_job(SCRIPT, ["0", ",".join(faults), "1", "1"], 2, timeout=90, env=env)
    for r in ranks:
        assert r.code == 0, (r.rank, r.code, r.err[-3000:])
    victim, other = ranks[1].result, ranks[0].result
    assert [s[0] for s in victim["skipped"]] == [s[0] for s in other["skipped"]] == list(range(1, 1 + len(faults)))
    for (_, kind, text), (_, mine, _) in zip(other["skipped"], victim["skipped"]):
        assert kind == mine == "InvalidInputError", (kind, mine, text)
        assert text.startswith("rank(s) 1 got invalid input in this step (rank 1: "), text
        assert "its error names it" not in text, text  # (the cause travels to every rank)
    want = _reference(model == "plain", 2, steps, set(range(1, 1 + len(faults))))
    for name in ("a", "b"):
        for r in ranks:
            torch.testing.assert_close(torch.tensor(r.result["tables"][name]), want[name], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "fault,shared", [("stop", "0"), ("raise", "0"), ("stop", "1"), ("raise", "1"), ("kill", "1")]
)  # (a rank killed in gloo's exchange fails it the same way, at once: tests/ps/test_trainer_faults.py kills;
#     "0": every exchange through gloo; "1": every exchange through shared memory, whose meetings wait on
#     the peers' counts in their control files: a peer whose process ended is noticed there, one stopped
#     when the job's timeout has passed)
def test_a_lost_sharded_rank_is_named_by_every_survivor_within_the_timeout(fault, shared):
    timeout = 4.0
    env = {"JOB_TIMEOUT": str(timeout), "JOB_STEPS": "4", "JOB_DDP": "0", "JOB_SHARED": shared}
    ranks = run_job(SCRIPT, ["0", fault, "1", "2"], 2, timeout=timeout + 60, env=env, linger={1})
    for r in ranks[:1]:
        assert r.code == 1, (r.rank, r.code, r.err[-2000:])
        assert r.error.startswith("hybridembed.errors.RankLost: "), r.error
        why = {"kill": "rank 1 is dead or stopped", "stop": "rank 1 is dead or stopped", "raise": "rank 1 failed: "}
        assert why[fault] in r.error, r.error
        assert r.seconds < timeout + 30 + 15, r.seconds  # (the job's timeout + 30 s, after a start of ~15 s)
    if fault == "raise":
        assert "RuntimeError: boom in the training loop" in ranks[0].error


def _setup_refusals(rank: int, world: int) -> list[str]:
    """Arguments that one rank refuses or that differ on one rank: every rank raises, naming it."""
    from hybridembed.distributed import make_plan

    out = []
    model = job_script.Model
    tables = list(model().ec.tables.values())
    cases = [
        {"plan": make_plan(tables, world + 1) if rank == 1 else None},
        {"memory_per_rank": 64 if rank == 1 else None},
        {"memory_per_rank": 64},
        {"servers": 1, "mode": "bogus" if rank == 1 else "sync"},
        {"servers": 1, "mode": "async" if rank == world - 1 else "sync"},
        {"servers": 1, "max_request_bytes": (1 << 16) if rank == world - 1 else (1 << 20)},
        {"servers": 1, "ps_timeout": 5.0 if rank == 0 else None},
        {"reduction": "sum" if rank == 1 else "mean"},
    ]
    for kwargs in cases:
        t0 = time.monotonic()
        try:
            he.distribute(model(), ddp=False, server_exit=False, **kwargs)
            out.append("no error")
        except he.ConfigError as e:
            out.append(str(e))
        assert time.monotonic() - t0 < 20
    dist.barrier()
    return out


def test_a_setup_one_rank_refuses_or_that_differs_on_one_rank_is_refused_on_every_rank():
    results = spawn(_setup_refusals, 3, timeout=120, pg_timeout=30)
    plan, budget1, budget, mode, async_, limit, ps_timeout, reduction = zip(*results)
    assert "the plan is for world size 4, this process group has 3 ranks" in plan[1]
    for r in (0, 2):
        assert plan[r].startswith("the model was refused on rank(s) 1 (rank 1: the plan is for world size 4"), plan[r]
        assert mode[r].startswith("he.distribute's arguments was refused on rank(s) 1 (rank 1: mode must be"), mode[r]
    assert all(b.startswith("the plan puts ") and "over memory_per_rank=64 B" in b for b in budget), budget
    for texts, what in [
        (budget1, "memory_per_rank: None on rank 0, 64 on rank 1"),
        (async_, "ps.mode: 'sync' on rank 0, 'async' on rank 2"),
        (limit, "ps.max_request_bytes: 1048576 on rank 0, 65536 on rank 2"),
        (ps_timeout, "ps.ps_timeout: 5.0 on rank 0, None on rank 1"),
        (reduction, "reduction: 'mean' on rank 0, 'sum' on rank 1"),
    ]:
        for text in texts:
            assert text == f"ranks disagree on he.distribute's arguments: {what}", texts


def _timeouts(rank: int, world: int) -> dict:
    out = {}
    model = he.distribute(job_script.Model(), ddp=False)
    from hybridembed.checkpoint.collective import _checkpoint_group

    group = he.distributed.unwrap(model).ec.process_group
    out["exchange"] = health.job_timeout(group).total_seconds()
    out["background saves"] = health.job_timeout(_checkpoint_group(group)).total_seconds()
    model = he.distribute(job_script.Model(), ddp=False, timeout=5)
    out["given"] = health.job_timeout(he.distributed.unwrap(model).ec.process_group).total_seconds()
    model = he.distribute(job_script.Model(), servers=1, server_exit=False)
    if model is not None:
        ec = he.distributed.unwrap(model).ec
        out["ps"] = health.job_timeout(next(iter(ec.client.links.values())).group).total_seconds()
        out["trainers"] = health.job_timeout(ec.trainers_group).total_seconds()
        out["ps_timeout"] = next(iter(ec.client.links.values())).seconds
    return out


def test_the_library_s_process_groups_wait_as_long_as_the_job_s_timeout():
    trainer, server = spawn(_timeouts, 2, timeout=90, pg_timeout=17)
    common = {"exchange": 17, "background saves": 17, "given": 5}
    assert trainer == common | {"ps": 17, "trainers": 17, "ps_timeout": 17}
    assert server == common
