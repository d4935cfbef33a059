"""The planner (make_plan, plan_costs), ``hybridembed plan``, and Plan's own checks."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

import hybridembed as he
from hybridembed import cli as top
from hybridembed.bench.models import MODELS, expand
from hybridembed.distributed.plan import Plan, Shard, TablePlan, shard_table
from hybridembed.distributed.planner import (
    STRATEGIES,
    imbalance,
    make_plan,
    plan_costs,
    table_bytes,
    tables_for_model,
)
from hybridembed.errors import ConfigError

SYNTHETIC = ("tiny", "small", "medium", "large", "jumbo", "colossal")
MB = 100_000 * 16 * 8  # a 100k x 16 table with Adagrad state: 12.8 MB


def _model(name: str):
    return tables_for_model(MODELS[name])


def _mem(plan, tables, **kw) -> list[int]:
    return [c.memory_bytes for c in plan_costs(plan, tables, **kw)]


def _expected_total(tables, plan, optimizer="adagrad") -> int:
    """Every table's bytes once, a replicated table's once per rank."""
    return sum(
        table_bytes(t, optimizer) * (plan.world_size if plan.table(t.name).sharding == "data_parallel" else 1)
        for t in tables
    )


# --- synthetic models at full size --------------------------------------------------------------
@pytest.mark.parametrize("model", [*MODELS])
def test_tables_for_model_matches_expand(model):
    tables, hotness, bags = _model(model)
    specs, inputs = expand(MODELS[model])
    assert [(t.name, t.num_embeddings, t.embedding_dim) for t in tables] == [(s.name, s.rows, s.width) for s in specs]
    assert hotness == {s.name: float(sum(i.hotness for i in inputs if i.table == s.name)) for s in specs}
    assert bags == dict(Counter(i.table for i in inputs))


def test_tables_for_model_sums_the_inputs_of_shared_tables():
    tables, hotness, bags = _model("tiny")
    assert len(tables) == 55 and (tables[0].num_embeddings, tables[0].embedding_dim) == (10_000, 8)
    assert (hotness["t0"], bags["t0"]) == (11.0, 2)  # read by two inputs: 1 and 10 ids
    assert (hotness["t3"], bags["t3"]) == (1.0, 1)


@pytest.mark.parametrize("world_size", [1, 8, 128])
@pytest.mark.parametrize("model", SYNTHETIC)
def test_every_synthetic_model_plans_and_balances_memory(model, world_size):
    tables, hotness, bags = _model(model)
    plan = make_plan(tables, world_size, hotness=hotness, bags=bags)
    plan.check(tables)
    assert plan.strategy == "memory_balanced" and plan.world_size == world_size
    mem = _mem(plan, tables, hotness=hotness, bags=bags)
    assert sum(mem) == _expected_total(tables, plan)  # nothing lost or counted twice
    assert imbalance(mem) < 1.05, (max(mem), sum(mem) / world_size)
    assert min(mem) > 0.95 * sum(mem) / world_size


@pytest.mark.parametrize("model", SYNTHETIC)
def test_every_synthetic_model_plans_comm_balanced_at_128(model):
    tables, hotness, bags = _model(model)
    mem_plan = make_plan(tables, 128, hotness=hotness, bags=bags)
    plan = make_plan(tables, 128, hotness=hotness, bags=bags, strategy="comm_balanced")
    kw = dict(hotness=hotness, bags=bags)
    moved = [c.bytes_moved for c in plan_costs(plan, tables, **kw)]
    moved_mem = [c.bytes_moved for c in plan_costs(mem_plan, tables, **kw)]
    assert max(moved) <= max(moved_mem)  # the busiest rank moves no more
    assert imbalance(_mem(plan, tables, **kw)) <= 1.25 + 1e-9  # memory stays a constraint


def test_jumbo_at_128_plans_in_seconds_within_10_percent_of_the_mean():
    tables, hotness, bags = _model("jumbo")
    start = time.perf_counter()
    plan = make_plan(tables, 128, hotness=hotness, bags=bags, memory_per_rank=80 << 30)
    assert time.perf_counter() - start < 5
    mem = _mem(plan, tables)
    mean = sum(mem) / 128
    assert max(mem) <= 1.1 * mean and min(mem) >= 0.9 * mean
    assert max(mem) <= 80 << 30
    assert plan.table("t74").sharding == "row_wise"  # the 400M x 256 tables: 0.8 TB each
    assert Counter(tp.sharding for tp in plan.tables)["data_parallel"] == 100  # the 10-row tables


def test_jumbo_at_128_all_row_wise_within_10_percent_of_the_mean():
    tables, hotness, bags = _model("jumbo")
    plan = make_plan(tables, 128, hotness=hotness, overrides=dict.fromkeys((t.name for t in tables), "row_wise"))
    assert {tp.sharding for tp in plan.tables} == {"row_wise"}
    assert all(tp.ranks == tuple(range(128)) and tp.placement == "block" for tp in plan.tables)
    mem = _mem(plan, tables)
    mean = sum(mem) / 128
    assert max(mem) <= 1.1 * mean and min(mem) >= 0.9 * mean


def test_plans_are_deterministic():
    tables, hotness, bags = _model("large")
    for strategy in STRATEGIES:
        a = make_plan(tables, 24, hotness=hotness, bags=bags, strategy=strategy)
        b = make_plan(list(tables), 24, hotness=dict(hotness), bags=dict(bags), strategy=strategy)
        assert a == b and a.to_json() == b.to_json()


# --- placement rules --------------------------------------------------------------------------
def _t(name: str, rows: int, dim: int = 16, **kw) -> he.TableConfig:
    return he.TableConfig(name, rows, dim, **kw)


def test_a_table_larger_than_a_ranks_share_is_split_row_wise():
    tables = [_t("a", 100_000), _t("b", 100_000), _t("big", 300_000)]
    plan = make_plan(tables, 2)
    assert plan.table("big").sharding == "row_wise" and plan.table("big").placement == "block"
    assert {plan.table("a").ranks, plan.table("b").ranks} == {(0,), (1,)}
    assert _mem(plan, tables) == [int(2.5 * MB)] * 2


def test_dynamic_tables_are_hash_row_wise_over_every_rank():
    dyn = he.TableConfig("user", None, 16, dynamic=he.Dynamic(capacity=1_000_000))
    grow = he.TableConfig("item", None, 8, dynamic=he.Dynamic())  # no capacity: initial_rows
    tables = [dyn, grow, _t("a", 10)]
    plan = make_plan(tables, 4)
    for name in ("user", "item"):
        tp = plan.table(name)
        assert (tp.sharding, tp.placement, tp.ranks) == ("row_wise", "hash", (0, 1, 2, 3))
        assert all(s.row_stop is None for s in tp.shards)
    costs = plan_costs(plan, tables)
    dp = table_bytes(tables[2])
    assert costs[0].memory_bytes == 250_000 * 16 * 8 + 256 * 8 * 8 + dp  # capacity / 4 and 1024 / 4 rows
    # an override wins, data_parallel does not
    plan = make_plan(tables, 4, overrides={"user": {"sharding": "table_wise", "ranks": [2]}})
    assert plan.table("user").ranks == (2,)
    with pytest.raises(ConfigError, match="'user'.*dynamic table cannot be data_parallel"):
        make_plan(tables, 4, overrides={"user": "data_parallel"})


def test_data_parallel_below_threshold():
    small = _t("small", 511, 16)  # 511 x 16 x 8 bytes = 65,408 < 64 KiB
    edge = _t("edge", 512, 16)  # 65,536: not below
    plan = make_plan([small, edge], 4)
    assert plan.table("small").sharding == "data_parallel" and plan.table("small").ranks == (0, 1, 2, 3)
    assert plan.table("edge").sharding != "data_parallel"
    plan = make_plan([small, edge], 4, data_parallel_below=0)
    assert "data_parallel" not in {tp.sharding for tp in plan.tables}
    plan = make_plan([small, edge], 4, optimizer="sgd")  # half the bytes: both below
    assert {tp.sharding for tp in plan.tables} == {"data_parallel"}


def test_column_slice_threshold_cuts_large_tables_into_slices_on_distinct_ranks():
    tables = [_t("wide", 1000, 64), _t("narrow", 1000, 8)]
    plan = make_plan(tables, 8, column_slice_threshold=10_000, data_parallel_below=0)
    tp = plan.table("wide")  # 64,000 elements: 7 slices of at most 10 columns
    assert tp.sharding == "column_wise" and len(tp.shards) == 7 and len(set(tp.ranks)) == 7
    assert all(s.width * 1000 <= 10_000 for s in tp.shards)
    assert plan.table("narrow").sharding == "table_wise"
    # at most one slice per rank
    plan = make_plan(tables, 2, column_slice_threshold=10_000, data_parallel_below=0)
    assert len(plan.table("wide").shards) == 2


def test_overrides_are_honoured():
    tables = [_t(f"t{i}", 10_000 * (i + 1)) for i in range(6)]
    overrides = {
        "t0": "row_wise",
        "t1": {"sharding": "row_wise", "ranks": [1, 3], "placement": "mod"},
        "t2": {"sharding": "column_wise", "ranks": [0, 2], "widths": [4, 12]},
        "t3": {"sharding": "table_wise", "ranks": [3]},
        "t4": "data_parallel",
        "t5": "table_row_wise",
    }
    plan = make_plan(tables, 4, overrides=overrides, ranks_per_node=2, data_parallel_below=0)
    assert plan.table("t0").ranks == (0, 1, 2, 3) and plan.table("t0").placement == "block"
    assert (plan.table("t1").ranks, plan.table("t1").placement) == ((1, 3), "mod")
    assert [(s.rank, s.width) for s in plan.table("t2").shards] == [(0, 4), (2, 12)]
    assert plan.table("t3").ranks == (3,)
    assert plan.table("t4").sharding == "data_parallel"
    assert plan.table("t5").sharding == "table_row_wise" and plan.table("t5").ranks in ((0, 1), (2, 3))
    assert plan.notes["overrides"] == 6


def test_table_wise_override_is_kept_even_when_it_unbalances():
    tables = [_t("a", 100_000), _t("b", 100_000), _t("big", 300_000)]
    plan = make_plan(tables, 2, overrides={"big": "table_wise"})
    assert plan.table("big").sharding == "table_wise"


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"nope": "row_wise"}, "unknown table 'nope'"),
        ({"a": "diagonal"}, "unknown sharding type 'diagonal'"),
        ({"a": {"sharding": "table_wise", "ranks": [4]}}, "rank 4 is out of range for world size 4"),
        ({"a": {"sharding": "row_wise", "ranks": [-1, 0]}}, "rank -1 is out of range"),
        ({"a": {"sharding": "row_wise", "ranks": [0, 0]}}, "name a rank twice"),
        ({"a": {"sharding": "row_wise", "rank": [0]}}, "unknown key 'rank'"),
        ({"a": {"sharding": "table_wise", "placement": "mod"}}, "placement is for row_wise"),
        ({"a": {"sharding": "table_wise", "ranks": [0, 1]}}, "table_wise takes one rank"),
        ({"a": "table_row_wise"}, "table_row_wise needs ranks_per_node"),
        ({"a": {"sharding": "data_parallel", "ranks": [0]}}, "data_parallel is on every rank"),
        ({"a": 3}, "must be a sharding type name or a dict"),
    ],
)
def test_bad_overrides_are_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        make_plan([_t("a", 100_000)], 4, overrides=overrides)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"world_size": 0}, "world_size must be a positive int, got 0"),
        ({"world_size": True}, "world_size must be a positive int"),
        ({"strategy": "fastest"}, "unknown strategy 'fastest'; allowed: memory_balanced, comm_balanced"),
        ({"batch_size": 0}, "batch_size must be a positive int"),
        ({"optimizer": "lion"}, "unknown optimizer 'lion'"),
        ({"hotness": {"zz": 2.0}}, "hotness names unknown table 'zz'"),
        ({"hotness": -1.0}, "hotness must be a number >= 0"),
        ({"bags": 0}, "bags must be an int >= 1"),
        ({"memory_per_rank": 0}, "memory_per_rank"),
        ({"ranks_per_node": 3}, "ranks_per_node=3 does not divide world_size=4"),
        ({"column_slice_threshold": -5}, "column_slice_threshold"),
        ({"tolerance": float("nan")}, "tolerance"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    args = {"world_size": 4, **kwargs}
    with pytest.raises(ConfigError, match=match):
        make_plan([_t("a", 100_000)], **args)


def test_duplicate_table_names_are_refused():
    with pytest.raises(ConfigError, match="table name 'a' is used twice"):
        make_plan([_t("a", 10), _t("a", 20)], 2)


def test_over_budget_names_the_rank_and_the_shortfall():
    tables = [_t(f"t{i}", 100_000) for i in range(3)]  # 3 x 12.8 MB on 2 ranks: 19.2 MB each at best
    with pytest.raises(ConfigError) as e:
        make_plan(tables, 2, memory_per_rank=15_000_000)
    msg = str(e.value)
    assert "rank 0 needs 19,200,000 bytes (18.3 MiB), 4,200,000 bytes (4.0 MiB) too many" in msg
    assert "2 of 2 ranks are over" in msg and "at least 3 ranks" in msg
    # one rank over, because an override puts a big table there
    tables = [_t("a", 100_000), _t("big", 300_000)]
    with pytest.raises(ConfigError, match=r"rank 1 needs 38,400,000 bytes \(36.6 MiB\), 8,400,000 bytes"):
        make_plan(tables, 2, memory_per_rank=30_000_000, overrides={"big": {"sharding": "table_wise", "ranks": [1]}})
    # the same tables fit when the planner may split
    plan = make_plan(tables, 2, memory_per_rank=30_000_000)
    assert max(_mem(plan, tables)) <= 30_000_000


def test_comm_balanced_spreads_hot_tables_that_memory_balanced_stacks():
    # three cold tables and two hot ones of half their size on 4 ranks: memory_balanced fills
    # the last rank with both hot tables (a perfect memory balance)
    tables = [
        _t("cold0", 200_000),
        _t("cold1", 200_000),
        _t("cold2", 200_000),
        _t("hot1", 100_000),
        _t("hot2", 100_000),
    ]
    hotness = {"hot1": 50.0, "hot2": 50.0}  # the others 1
    mem_plan = make_plan(tables, 4, hotness=hotness)
    comm_plan = make_plan(tables, 4, hotness=hotness, strategy="comm_balanced")
    assert mem_plan.table("hot1").ranks == mem_plan.table("hot2").ranks == (3,)
    assert comm_plan.table("hot1").ranks != comm_plan.table("hot2").ranks
    mem_costs = plan_costs(mem_plan, tables, hotness=hotness)
    comm_costs = plan_costs(comm_plan, tables, hotness=hotness)
    assert max(c.bytes_moved for c in comm_costs) < 0.95 * max(c.bytes_moved for c in mem_costs)
    assert max(c.ids_received for c in comm_costs) < 0.55 * max(c.ids_received for c in mem_costs)
    assert imbalance([c.memory_bytes for c in mem_costs]) < imbalance([c.memory_bytes for c in comm_costs]) <= 1.25
    # on 2 ranks a table-wise table costs both ranks the same bytes: nothing to balance
    two = make_plan(tables[3:], 2, hotness=hotness, strategy="comm_balanced")
    assert len({c.bytes_moved for c in plan_costs(two, tables[3:], hotness=hotness)}) == 1


def test_notes_record_the_assumptions_and_survive_json():
    tables, hotness, bags = _model("tiny")
    plan = make_plan(tables, 8, hotness=hotness, bags=bags, memory_per_rank=2 << 30, batch_size=512, notes={"x": 1})
    n = plan.notes
    assert (n["batch_size"], n["optimizer"], n["memory_per_rank"], n["x"]) == (512, "adagrad", 2 << 30, 1)
    assert "per table" in n["hotness"]
    again = Plan.from_json(plan.to_json())
    assert again == plan and dict(again.notes) == json.loads(json.dumps(dict(n)))


def test_json_round_trips_a_plan_with_every_sharding_type():
    dyn = he.TableConfig("dyn", None, 8, dynamic=he.Dynamic(capacity=1000))
    tables = [dyn, *(_t(f"t{i}", 1000 + i, 8) for i in range(6))]
    overrides = {
        "t0": "data_parallel",
        "t1": {"sharding": "table_wise", "ranks": [2]},
        "t2": {"sharding": "column_wise", "widths": [3, 5]},
        "t3": {"sharding": "row_wise", "placement": "mod"},
        "t4": {"sharding": "row_wise", "ranks": [0, 3]},
        "t5": {"sharding": "table_row_wise", "placement": "mod"},
    }
    plan = make_plan(tables, 4, overrides=overrides, ranks_per_node=2)
    kinds = {(tp.sharding, tp.placement) for tp in plan.tables}
    assert kinds == {
        ("row_wise", "hash"),
        ("data_parallel", None),
        ("table_wise", None),
        ("column_wise", None),
        ("row_wise", "mod"),
        ("row_wise", "block"),
        ("table_row_wise", "mod"),
    }
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.to_json() == plan.to_json()
    again.check(tables)


def test_optimizer_state_is_counted():
    t = _t("a", 1000, 16)
    assert table_bytes(t, "sgd") == 1000 * 16 * 4
    assert table_bytes(t, "adagrad") == 1000 * 16 * 8
    assert table_bytes(t, "rowwise_adagrad") == 1000 * (16 * 4 + 4)
    assert table_bytes(t, "adam") == 1000 * 16 * 12
    half = _t("h", 1000, 16, dtype=__import__("torch").float16)
    assert table_bytes(half, "sgd") == 1000 * 16 * 2
    own = _t("o", 1000, 16, optimizer=he.optim.RowWiseAdagrad(lr=0.1))  # a table's own optimizer wins
    assert table_bytes(own, "adam") == 1000 * (16 * 4 + 4)


# --- the cost model, by hand ----------------------------------------------------------------------
def test_plan_costs_counts_the_exchange_by_hand():
    a, r, d = _t("A", 100, 4), _t("R", 100, 2), _t("D", 3, 1)
    plan = Plan(
        2,
        (
            shard_table(a, "table_wise", [0]),
            shard_table(r, "row_wise", [0, 1]),
            shard_table(d, "data_parallel", [0, 1]),
        ),
    )
    costs = plan_costs(plan, [a, r, d], batch_size=10, hotness={"A": 3.0, "R": 2.0, "D": 1.0})
    # A on rank 0: rank 1 sends 30 ids + 10 lengths (int64) and 10 row gradients of 4 floats, gets 10 rows
    a_req_sent, a_req_recv = 8 * (30 + 10) + 4 * 10 * 4, 4 * 10 * 4
    # R: each rank asks the other's half for its 10 ids, 10 lengths; 10 partial rows of 2 floats back
    r_req_sent, r_req_recv = 8 * (10 + 10) + 4 * 10 * 2, 4 * 10 * 2
    dp = 2 * 1 / 2 * 3 * (1 + 1) * 4  # a ring all-reduce of a (3, 2) float32 gradient
    c0, c1 = costs
    assert c0.memory_bytes == 100 * 4 * 8 + 50 * 2 * 8 + 3 * 8
    assert c1.memory_bytes == 50 * 2 * 8 + 3 * 8
    assert (c0.ids_received, c0.rows_sent) == (30 + 10, 10 + 10)
    assert (c1.ids_received, c1.rows_sent) == (10, 10)
    assert c0.bytes_sent == a_req_recv + r_req_sent + r_req_recv + dp  # A's rows; R: its ask, its half's rows
    assert c0.bytes_received == a_req_sent + r_req_recv + r_req_sent + dp
    assert c1.bytes_sent == a_req_sent + r_req_sent + r_req_recv + dp
    assert c1.bytes_received == a_req_recv + r_req_recv + r_req_sent + dp
    assert c0.bytes_moved == c0.bytes_sent + c0.bytes_received
    # one rank: everything is local
    solo = plan_costs(make_plan([a, r, d], 1), [a, r, d], batch_size=10)
    assert (solo[0].bytes_sent, solo[0].bytes_received, solo[0].ids_received) == (0, 0, 0)


def test_plan_costs_checks_the_plan():
    a = _t("A", 100)
    with pytest.raises(ConfigError, match="does not place table 'B'"):
        plan_costs(make_plan([a], 2), [a, _t("B", 10)])


# --- Plan.check and the sharding functions ----------------------------------------------------------
T = he.TableConfig("a", 10, 4)


def _check(*shards: Shard, sharding: str = "row_wise", placement: str | None = "block", table=T, world_size=2):
    Plan(world_size, (TablePlan(table.name, sharding, shards, placement),)).check([table])


@pytest.mark.parametrize(
    "shards, kw, match",
    [
        (
            (Shard(0, 0, 7, 1, 0, 4), Shard(1, 5, 10, 1, 0, 4)),
            {},
            r"row ranges \[\(0, 7\), \(5, 10\)\] overlap at row 7",
        ),
        ((Shard(0, 0, 5, 1, 0, 4), Shard(1, 6, 10, 1, 0, 4)), {}, r"gap at row 5"),
        ((Shard(0, 0, 5, 1, 0, 4), Shard(1, 5, 9, 1, 0, 4)), {}, r"cover rows 0..9 with step 1, the table has 10"),
        ((Shard(0, 0, 5, 1, 0, 4), Shard(1, 5, 3, 1, 0, 4)), {}, r"reversed range \(5, 3\)"),
        ((Shard(0, 0, 10, 1, 0, 2), Shard(1, 0, 10, 1, 3, 4)), {"sharding": "column_wise"}, "gap at column 2"),
        ((Shard(0, 0, 10, 1, 0, 3), Shard(1, 0, 10, 1, 2, 4)), {"sharding": "column_wise"}, "overlap at column 3"),
        ((Shard(0, 0, 10, 1, 0, 2), Shard(1, 0, 10, 1, 2, 3)), {"sharding": "column_wise"}, "cover 0..3"),
        ((Shard(2, 0, 10, 1, 0, 4),), {"sharding": "table_wise", "placement": None}, "rank 2 is out of range"),
        ((Shard(-1, 0, 10, 1, 0, 4),), {"sharding": "table_wise", "placement": None}, "rank -1 is out of range"),
        ((Shard(0, 0, 5, 1, 0, 4), Shard(0, 5, 10, 1, 0, 4)), {}, "two of its shards are on one rank"),
        ((Shard(0, 0, 10, 2, 0, 4), Shard(1, 1, 10, 2, 0, 4)), {"placement": "hash"}, "'hash' is for dynamic"),
        ((Shard(0, 0, 10, 2, 0, 4), Shard(1, 0, 10, 2, 0, 4)), {"placement": "mod"}, "needs residues 0..1, step 2"),
        ((Shard(0, 0, 10, 1, 0, 4),), {"sharding": "data_parallel", "placement": None}, "on every rank once"),
        ((Shard(0, 0, 10, 1, 0, 4),), {"sharding": "diagonal", "placement": None}, "unknown sharding type"),
        ((Shard(0, 0, None, 1, 0, 4), Shard(1, 0, 10, 1, 0, 4)), {}, "a shard's row_stop is an int"),
        ((Shard(0, 0, 5, 1, 0, 4), Shard(1, 5, None, 1, 0, 4)), {}, "a shard's row_stop is an int"),
    ],
)
def test_plan_check_names_the_problem(shards, kw, match):
    with pytest.raises(ConfigError, match=match):
        _check(*shards, **kw)


def test_plan_check_unknown_missing_and_dynamic_tables():
    other = he.TableConfig("b", 10, 4)
    plan = Plan(2, (shard_table(T, "table_wise", [0]),))
    with pytest.raises(ConfigError, match="unknown table 'a'"):
        plan.check([other])
    with pytest.raises(ConfigError, match="does not place table 'b'"):
        plan.check([T, other])
    dyn = he.TableConfig("d", None, 4, dynamic=he.Dynamic())
    with pytest.raises(ConfigError, match="'d' is dynamic: replicas would make different rows"):
        Plan(2, (TablePlan("d", "data_parallel", (Shard(0, 0, None, 1, 0, 4), Shard(1, 0, None, 1, 0, 4))),)).check(
            [dyn]
        )
    with pytest.raises(ConfigError, match="'d' is dynamic: its rows are placed by a hash"):
        _check(Shard(0, 0, None, 2, 0, 4), Shard(1, 1, None, 2, 0, 4), table=dyn, placement="mod")
    # a hash shard with a fixed row_stop would claim rows a dynamic table does not have
    with pytest.raises(ConfigError, match="a dynamic table's shard has no row_stop"):
        _check(Shard(0, 0, 5, 2, 0, 4), Shard(1, 1, 5, 2, 0, 4), table=dyn, placement="hash")
    _check(Shard(0, 0, None, 2, 0, 4), Shard(1, 1, None, 2, 0, 4), table=dyn, placement="hash")


def test_plan_from_json_keeps_world_size_as_stored():
    text = Plan(2, (shard_table(T, "table_wise", [1]),)).to_json()
    for bad in ("2.7", '"2"'):
        with pytest.raises(ConfigError, match="world_size must be a positive int"):
            Plan.from_json(text.replace('"world_size": 2', f'"world_size": {bad}'))


def test_shard_table_refuses_options_its_type_does_not_take():
    with pytest.raises(ConfigError, match="table_wise takes no option 'placement'; its options: none"):
        shard_table(T, "table_wise", [0], placement="mod")
    with pytest.raises(ConfigError, match="row_wise takes no option 'widths'; its options: placement"):
        shard_table(T, "row_wise", [0, 1], widths=[2, 2])


# --- hybridembed plan ------------------------------------------------------------------------------
def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hybridembed.cli", "plan", *argv], capture_output=True, text=True, timeout=120
    )


def test_cli_plans_jumbo_at_128_and_writes_a_plan_json(tmp_path, capsys):
    """(In this process: a fresh one's output is checked by the test of a bad argument below.)"""
    out = tmp_path / "plan.json"
    assert (
        top.main(["plan", "--model", "jumbo", "--world-size", "128", "--memory-per-rank", "80GiB", "--json", str(out)])
        == 0
    )
    said = capsys.readouterr().out
    assert "jumbo: 1022 tables on 128 ranks, strategy memory_balanced" in said
    assert "memory per rank 80.0 GiB" in said and "max/mean 1.0" in said
    # a screenful by default: the first tables and ranks, then how many more
    assert "\nt29 " in said and "\nt30 " not in said and "... and 992 more tables (--all" in said
    assert "\n   15 " in said and "\n   16 " not in said and "... and 112 more ranks" in said
    assert len(said.splitlines()) < 80
    assert top.main(["plan", "--model", "jumbo", "--world-size", "128", "--memory-per-rank", "80GiB", "--all"]) == 0
    every = capsys.readouterr().out
    assert "\nt1021 " in every and "\n  127 " in every and "more tables" not in every
    plan = Plan.from_json(out.read_text())
    tables, hotness, bags = _model("jumbo")
    assert plan == make_plan(tables, 128, hotness=hotness, bags=bags, memory_per_rank=80 << 30)
    assert plan.notes["source"] == "jumbo" and plan.notes["memory_per_rank"] == 80 << 30


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--model", "jumbo", "--world-size", "0"], "argument --world-size: expected a positive int, got '0'"),
        (["--model", "huge", "--world-size", "2"], "unknown model 'huge'; allowed: tiny"),
        (["--model", "tiny", "--world-size", "2", "--override", "t0=diagonal"], "unknown sharding type 'diagonal'"),
        (["--model", "tiny", "--world-size", "2", "--override", "zz=row_wise"], "unknown table 'zz'"),
        (["--model", "tiny", "--world-size", "2", "--override", "t5=table_wise@7"], "rank 7 is out of range"),
        (["--model", "tiny", "--world-size", "2", "--memory-per-rank", "lots"], "expected a size like 80GiB"),
        (["--model", "tiny"], "the following arguments are required: --world-size"),
        (["--model", "tiny", "--world-size", "2", "--memory-per-rank", "1GiB"], "does not fit memory_per_rank"),
        (["--world-size", "2"], "one of the arguments --model --tables is required"),
    ],
)
def test_cli_bad_arguments_exit_2_with_one_line(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        sys.exit(top.main(["plan", *argv]))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("hybridembed plan: error: ") and match in err, err


def test_cli_bad_argument_in_a_fresh_process_has_no_traceback():
    r = _run("--model", "tiny", "--world-size", "-3")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "hybridembed plan: error: argument --world-size" in r.stderr


def test_cli_reads_tables_from_json(tmp_path, capsys):
    spec = [
        {"name": "user", "num_embeddings": None, "embedding_dim": 16, "dynamic": {"capacity": 100_000}, "hotness": 3},
        {"name": "item", "num_embeddings": 200_000, "embedding_dim": 32, "hotness": 20, "bags": 2},
        {"name": "tiny", "num_embeddings": 10, "embedding_dim": 4},
    ]
    path = tmp_path / "tables.json"
    path.write_text(json.dumps(spec))
    out = tmp_path / "plan.json"
    code = top.main(["plan", "--tables", str(path), "--world-size", "4", "--summary", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0 and "tables.json: 3 tables on 4 ranks" in text and "\nuser " not in text  # --summary
    plan = Plan.from_json(out.read_text())
    assert (plan.table("user").sharding, plan.table("user").placement) == ("row_wise", "hash")
    assert plan.table("tiny").sharding == "data_parallel"
    assert "hotness from tables.json" in plan.notes["hotness_source"]


@pytest.mark.parametrize(
    "content, name, match",
    [
        ('[{"name": "a", "num_embeddings": 10}]', "t.json", "embedding_dim must be a positive int"),
        ('[{"name": "a", "num_embeddings": 10, "embedding_dim": 4, "hot": 1}]', "t.json", "unknown key 'hot'"),
        ("[1, 2", "t.json", "does not parse as JSON"),
        ("- name: a", "t.yaml", None),
    ],
)
def test_cli_bad_tables_files(tmp_path, capsys, content, name, match):
    path = tmp_path / name
    path.write_text(content)
    code = top.main(["plan", "--tables", str(path), "--world-size", "2"])
    err = capsys.readouterr().err
    if match is None:  # YAML: read when PyYAML is installed, else a clear pointer to JSON
        try:
            import yaml  # noqa: F401
        except ImportError:
            assert code == 2 and "needs PyYAML, which is not installed; write the tables as JSON" in err
            return
        assert code == 2 and "num_embeddings" in err
        return
    assert code == 2 and match in err, err


def test_top_level_help_lists_plan(capsys):
    assert top.main(["--help"]) == 0
    assert "plan" in capsys.readouterr().out


def test_planning_calls_no_torch_function():
    """Sizes only: not one torch function (factories included) runs while planning jumbo."""
    from torch.overrides import TorchFunctionMode

    calls = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(func)
            return func(*args, **(kwargs or {}))

    tables, hotness, bags = _model("jumbo")
    with Record():
        plan = make_plan(tables, 128, hotness=hotness, bags=bags, column_slice_threshold=10**9)
        plan_costs(plan, tables, hotness=hotness, bags=bags)
    assert calls == []
    with Record():  # the recorder does see a call
        __import__("torch").zeros(1)
    assert [f.__name__ for f in calls] == ["zeros"]


def test_cli_parses_sizes_and_overrides():
    import argparse

    from hybridembed.distributed.cli import parse_bytes, parse_override

    assert [parse_bytes(s) for s in ("80GiB", "80G", "80GB", "512MiB", "1e9", "1.5k", "7")] == [
        80 << 30,
        80 << 30,
        80 * 10**9,
        512 << 20,
        10**9,
        1536,
        7,
    ]
    assert parse_bytes("0", minimum=0) == 0
    for bad in ("", "GiB", "80 XB", "-1G", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(bad)
    assert parse_override("t3=row_wise:mod") == ("t3", {"sharding": "row_wise", "placement": "mod"})
    assert parse_override("t0=table_wise@5") == ("t0", {"sharding": "table_wise", "ranks": [5]})
    assert parse_override("t1=row_wise@0-2,7") == ("t1", {"sharding": "row_wise", "ranks": [0, 1, 2, 7]})
    for bad in ("t0", "=row_wise", "t0=row_wise:zigzag", "t0=row_wise@x", "t0=row_wise@1-", "t0=row_wise@5-3"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_override(bad)


def test_cli_reads_tables_from_yaml(tmp_path, capsys):
    pytest.importorskip("yaml")
    path = tmp_path / "tables.yaml"
    path.write_text(
        "- {name: user, num_embeddings: 1000000, embedding_dim: 64, hotness: 2}\n"
        "- name: item\n  num_embeddings: 500000\n  embedding_dim: 32\n"
    )
    out = tmp_path / "plan.json"
    assert top.main(["plan", "--tables", str(path), "--world-size", "2", "--json", str(out)]) == 0
    assert "tables.yaml: 2 tables on 2 ranks" in capsys.readouterr().out
    assert {t.table for t in Plan.from_json(out.read_text()).tables} == {"user", "item"}


def test_the_example_tables_file_plans():
    example = Path(__file__).resolve().parents[2] / "examples" / "tables.json"
    r = _run("--tables", str(example), "--world-size", "4")
    assert r.returncode == 0, r.stderr
    assert "tables.json: 6 tables on 4 ranks" in r.stdout and "query_terms" in r.stdout
