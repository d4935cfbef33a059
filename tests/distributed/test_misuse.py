"""Bad plans and misuse: clear errors before any allocation. A world-1 gloo group in this
process (no spawn) is enough for every check made before the exchange."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridembed as he
from hybridembed.distributed import Plan, Shard, ShardedCollection, TablePlan, make_plan, shard_table
from tests.procs import world_of_one


@pytest.fixture
def world1():
    with world_of_one():
        yield


T = [he.TableConfig("a", 100, 8), he.TableConfig("b", 50, 4, combiner="mean")]


def test_default_plan_comes_from_the_planner_and_matches_the_collection(world1):
    sc = ShardedCollection(T, seed=5)
    assert sc.plan == make_plan(T, 1)
    ec = he.EmbeddingCollection(T, seed=5)
    x = {"a": torch.tensor([[1, 2], [3, -1]]), "b": he.Jagged.from_lists([[4], []])}
    for f, y in sc(x).items():
        torch.testing.assert_close(y, ec(x)[f])


def test_a_plan_for_another_world_size_is_refused(world1):
    with pytest.raises(he.ConfigError, match="world size 2, this process group has 1"):
        ShardedCollection(T, plan=make_plan(T, 2))


@pytest.mark.parametrize(
    "plan, match",
    [
        (Plan(1, (shard_table(T[0], "table_wise", (0,)),)), "does not place table 'b'"),
        (
            Plan(1, (shard_table(T[0], "table_wise", (0,)), shard_table(T[1], "table_wise", (3,)))),
            "rank 3 is out of range",
        ),
        (
            Plan(
                1,
                (
                    TablePlan("a", "row_wise", (Shard(0, 0, 60, 1, 0, 8),), "block"),
                    shard_table(T[1], "table_wise", (0,)),
                ),
            ),
            "cover rows 0..60",
        ),
        (
            Plan(
                1,
                (
                    shard_table(T[0], "table_wise", (0,)),
                    shard_table(T[1], "table_wise", (0,)),
                    shard_table(he.TableConfig("zzz", 5, 4), "table_wise", (0,)),
                ),
            ),
            "unknown table 'zzz'",
        ),
    ],
)
def test_bad_plans_are_refused_before_any_allocation(world1, plan, match):
    with pytest.raises(he.ConfigError, match=match):
        ShardedCollection(T, plan=plan)


def test_memory_over_budget_names_the_rank_and_the_shortfall(world1):
    with pytest.raises(he.ConfigError, match=r"on rank 0, .* over memory_per_rank"):
        ShardedCollection(T, memory_per_rank=1000)


def test_distribute_misuse(world1):
    with pytest.raises(he.ConfigError, match="no embedding layers"):
        he.distribute(nn.Linear(2, 2))
    with pytest.raises(he.ConfigError, match="unknown argument 'grouped'"):
        he.distribute(nn.Embedding(4, 2), grouped=False)
    with pytest.raises(he.ConfigError, match="reduction"):
        he.distribute(nn.Embedding(4, 2), reduction="max")
    model = he.distribute(nn.ModuleDict({"e": nn.EmbeddingBag(10, 4), "l": nn.Linear(4, 1)}))
    with pytest.raises(he.ConfigError, match="not a DistributedDataParallel|distributed already|wrapper"):
        he.distribute(model)


def test_distribute_without_a_process_group_is_refused():
    with pytest.raises(he.ConfigError, match="init_process_group"):
        he.distribute(nn.Embedding(4, 2))


def test_sharded_weight_attribute_points_to_gather(world1):
    model = he.distribute(nn.ModuleDict({"e": nn.Embedding(10, 4)}), ddp=False)
    with pytest.raises(AttributeError, match="gather_table"):
        model["e"].weight  # noqa: B018


def test_wrong_ids_are_refused_and_change_nothing(world1):
    sc = ShardedCollection(T)
    before = sc.gather_table("a").clone()
    with pytest.raises(he.InvalidInputError, match="feature 'a'.*out of range"):
        sc({"a": torch.tensor([1, 100]), "b": torch.tensor([1, 2])})
    with pytest.raises(he.InvalidInputError, match="unknown feature 'c'"):
        sc({"a": torch.tensor([1]), "b": torch.tensor([1]), "c": torch.tensor([1])})
    with pytest.raises(he.InvalidInputError, match="must be integers"):
        sc({"a": torch.tensor([1.0]), "b": torch.tensor([1])})
    assert torch.equal(sc.gather_table("a"), before)


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.e, self.b = nn.Embedding(10, 4), nn.EmbeddingBag(10, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B,) ids -> (B, 8): both layers in one grouped forward
        return torch.cat([self.e(x), self.b(x.reshape(-1, 1))], 1)


def test_a_distributed_model_refuses_wrong_ids_of_one_per_bag_and_changes_nothing(world1):
    """Inside a model's forward the converted layers' lookups are queued, their bags of one id with the
    collection's own offsets (whose checks are skipped): the ids themselves are still checked."""
    model = he.distribute(_TwoLayers(), ddp=False)
    sc = [m for m in model.modules() if isinstance(m, ShardedCollection)][0]
    before = {t: sc.gather_table(t).clone() for t in sc.tables}
    for bad, why in (
        (torch.tensor([1.0, 2.0]), "must be integers"),
        (torch.tensor([1, 10]), "out of range"),
        (torch.tensor([-1, 2]), "out of range|>= 0"),
        (torch.empty(2, dtype=torch.int64, device="meta"), "meta"),
    ):
        with pytest.raises(he.InvalidInputError, match=why):
            model(bad).sum().backward()
    assert model(torch.tensor([1, 2])).shape == (2, 8)  # (and good ids still work after)
    for t, w in before.items():
        assert torch.equal(sc.gather_table(t), w), t


def test_clip_grad_norm_of_a_distributed_model_is_refused(world1):
    model = he.distribute(nn.ModuleDict({"e": nn.EmbeddingBag(10, 4)}), ddp=False)
    with pytest.raises(he.ConfigError, match="this rank's alone"):
        he.clip_grad_norm_(model, 1.0)
    with pytest.raises(he.ConfigError, match="this rank's alone"):  # a parameter list (Lightning's) too
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)


def test_distribute_a_model_holding_an_embedding_collection(world1):
    tables = [he.TableConfig("v", 30, 4, combiner="mean"), he.TableConfig("u", None, 4, dynamic=he.Dynamic())]
    ref = he.EmbeddingCollection(tables, {"a": "v", "b": "v", "u": "u"}, seed=2)
    with torch.no_grad():
        ref.weight("v").mul_(3.0)  # weights the collection holds (not its initializer's) are what get sharded
    model = nn.ModuleDict({"ec": he.EmbeddingCollection(tables, {"a": "v", "b": "v", "u": "u"}, seed=2)})
    model["ec"].load_state_dict(ref.state_dict())
    model = he.distribute(model, ddp=False)
    sc = model["ec"]
    assert isinstance(sc, ShardedCollection)
    # the default plan at world 1: the small table replicated, the dynamic one hash-sharded (one shard)
    assert [(t, s.rank) for t, _, s, _ in sc.shards_here()] == [("u", 0)] and list(sc.replicated.tables) == ["v"]
    x = {"a": torch.tensor([[1, 2], [3, -1]]), "b": [[4], []], "u": torch.tensor([10**12, -5])}
    ref.train()
    want = ref(x)
    for f, y in sc(x).items():
        torch.testing.assert_close(y, want[f])


def test_to_moves_the_exchange_device_with_the_shards(world1):
    sc = ShardedCollection([he.TableConfig("a", 100, 8)], plan=Plan(1, (shard_table(T[0], "table_wise", (0,)),)))
    sc.to("meta")  # (no second device here: meta stands in for one)
    assert sc._device == torch.device("meta")
    with pytest.raises(he.InvalidInputError, match="is on cpu but its table is on meta"):
        sc({"a": torch.tensor([1])})


def test_distribute_refuses_bad_options_before_changing_the_model(world1):
    model = nn.ModuleDict({"e": nn.Embedding(10, 4)})
    for kwargs, match in (
        ({"ddp": "yes"}, "ddp must be"),
        ({"memory_per_rank": -1}, "memory_per_rank"),
        ({"dedup": 1}, "dedup"),
    ):
        with pytest.raises(he.ConfigError, match=match):
            he.distribute(model, **kwargs)
        assert isinstance(model["e"], nn.Embedding)  # not converted


def test_spawn_refuses_a_timeout_that_would_never_fire():
    from hybridembed.launch import spawn

    with pytest.raises(he.HybridEmbedError, match="timeout must be"):
        spawn(print, 2, timeout=float("nan"))


def test_save_and_load_refuse_bad_arguments(tmp_path):
    model = nn.ModuleDict({"ec": he.EmbeddingCollection([he.TableConfig("a", 10, 4)])})
    with pytest.raises(he.CheckpointError, match="extra must be a dict"):
        he.save(str(tmp_path / "c"), model, extra=[("epoch", 3)])
    he.save(str(tmp_path / "c"), model)
    with pytest.raises(he.CheckpointError, match="load needs the model"):
        he.load(str(tmp_path / "c"), "model")
    with pytest.raises(he.CheckpointError, match="verify must be"):
        he.load(str(tmp_path / "c"), model, verify="no")


def test_a_keyed_jagged_tensor_is_a_sharded_collection_s_input_too(world1):
    from tests.input.test_ecosystem_inputs import FakeKJT

    sc, ec = ShardedCollection(T, seed=3), he.EmbeddingCollection(T, seed=3)
    kjt = FakeKJT(["a", "b"], torch.tensor([1, 2, 3, 4, 5]), torch.tensor([1, 2, 0, 2]))
    want = ec({"a": he.Jagged.from_lengths([1, 2, 3], [1, 2]), "b": he.Jagged.from_lengths([4, 5], [0, 2])})
    got = sc(kjt)
    for f in ("a", "b"):
        torch.testing.assert_close(got[f], want[f])


def test_the_distributed_model_reads_the_user_s_attributes(world1):
    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.e, self.top = nn.EmbeddingBag(10, 4), nn.Linear(4, 1)
            self.loss_fn = nn.MSELoss()

        def forward(self, x):
            return self.top(self.e(x))

        def predict(self, x):
            return torch.sigmoid(self(x))

    model = he.distribute(WithLoss())
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel)  # (DDP, as before)
    assert isinstance(model.loss_fn, nn.MSELoss)  # (DLRM's model.loss_fn, not model.module.loss_fn)
    x = torch.tensor([[1, 2], [3, 4]])
    torch.testing.assert_close(model.predict(x), torch.sigmoid(model(x)))
    with pytest.raises(AttributeError, match="no_such"):
        model.no_such  # noqa: B018
