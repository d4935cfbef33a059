"""A distributed converted model's ``torch.cat`` of its tables' rows made by the lookup
(:mod:`hybridembed.distributed.joined`): replicated tables' by the replicas' kernel call, table-wise
ones' by the exchange (through shared memory), against one process on the concatenated batches;
through gloo, or replicated and sharded tables in one cat, the usual path (and the same results)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridembed as he
from hybridembed.distributed import Plan, shard_table
from hybridembed.kernels import cpu_fused
from hybridembed.launch import spawn

pytestmark = pytest.mark.skipif(not cpu_fused.available(), reason="the joined layout is the fused CPU step's")
STEPS, B, VOCAB, DIM = 3, 6, 40, 4


class Joining(nn.Module):
    """DLRM's cat of a dense output and the rows; ``three_d``: DeepCTR's, (B, 1, D) pieces along dim 1."""

    def __init__(self, three_d: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.bot = nn.Linear(3, DIM)
        layer = (lambda: nn.Embedding(VOCAB, DIM)) if three_d else (lambda: nn.EmbeddingBag(VOCAB, DIM, mode="sum"))
        self.embs = nn.ModuleList(layer() for _ in range(3))
        self.top = nn.Linear(4 * DIM, 1)
        self.three_d = three_d

    def forward(self, x, ids):
        z = self.bot(x)
        t = torch.cat([z.unsqueeze(1) if self.three_d else z, *(e(i) for e, i in zip(self.embs, ids))], 1)
        fm = t.sum(1).pow(2).sum(1) if self.three_d else 0  # (the (B, F + 1, D) layout read as such)
        return self.top(t.flatten(1)).squeeze(1) + fm


def _batch(step: int, rank: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(B, 3, generator=g), [torch.randint(0, VOCAB, (B, 1), generator=g) for _ in range(3)]


def _whole(step: int, world: int):
    parts = [_batch(step, r) for r in range(world)]
    return torch.cat([p[0] for p in parts]), [torch.cat([p[1][k] for p in parts]) for k in range(3)]


def _train(model, batch_of, plain: bool = False, steps: int = STEPS) -> None:
    if plain:  # (torch's Adagrad on the tables' dense gradients: untouched rows do not move)
        embs = [p for n, p in model.named_parameters() if n.startswith("embs")]
        dense = [p for n, p in model.named_parameters() if not n.startswith("embs")]
        opt = torch.optim.SGD(dense, lr=0.2)
        both = [opt, torch.optim.Adagrad(embs, lr=0.2)]
    else:
        both = [he.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.2), model, sparse=he.optim.Adagrad(lr=0.2))]
    for step in range(steps):
        x, ids = batch_of(step)
        loss = (model(x, ids) ** 2).mean()
        for opt in both:
            opt.zero_grad()
        loss.backward()
        for opt in both:
            opt.step()


def _job(rank: int, world: int, sharding: str, way: str, three_d: bool = False) -> dict:
    import os

    from hybridembed.distributed import exchange, runtime, shm
    from hybridembed.modules import joined

    os.environ[shm.ENV] = "1" if way == "shared" else "0"
    if way != "folded":  # (rows of any size through shared memory, or gloo: no status folded in)
        runtime.FOLD_ROWS = 0
    made, real = [], (joined.Ready.run, exchange.SharedRowsJoined.apply, exchange.RowsJoined.apply)

    def counted(self, train):
        made.append(1)
        return real[0](self, train)

    def joined_rows(*a):
        made.append(1)
        return real[1](*a)

    def folded_rows(*a):
        made.append(1)
        return real[2](*a)

    joined.Ready.run, exchange.SharedRowsJoined.apply, exchange.RowsJoined.apply = counted, joined_rows, folded_rows
    try:
        plain = Joining(three_d)
        tables = [he.TableConfig(f"embs__{k}", VOCAB, DIM) for k in range(3)]
        every = tuple(range(world))
        kinds = {"mixed": ["data_parallel", "data_parallel", "table_wise"]}.get(sharding, [sharding] * 3)
        ranks = [every if kind == "data_parallel" else (k % world,) for k, kind in enumerate(kinds)]
        plan = Plan(world, tuple(shard_table(t, kind, r) for t, kind, r in zip(tables, kinds, ranks)))
        model = he.distribute(plain, plan)
        _train(model, lambda step: _batch(step, rank))
    finally:
        joined.Ready.run, exchange.SharedRowsJoined.apply, exchange.RowsJoined.apply = real
    state = {k: v.detach().clone() for k, v in plain.named_parameters() if not k.startswith("embs")}
    state.update({f"embs.{k}.weight": model.hybridembed.gather_table(f"embs__{k}") for k in range(3)})
    return {"made": len(made), "state": state}


@pytest.mark.parametrize(
    "sharding, way, three_d",
    [
        ("data_parallel", "shared", False),
        ("table_wise", "shared", False),
        ("table_wise", "shared", True),
        ("table_wise", "folded", False),
        ("table_wise", "folded", True),
        ("table_wise", "gloo", False),
        ("mixed", "shared", False),
    ],
)
def test_a_joined_cat_of_a_sharded_job_equals_one_process(sharding, way, three_d):
    got = spawn(_job, 2, sharding, way, three_d, timeout=120)
    ref = Joining(three_d)
    _train(ref, lambda step: _whole(step, 2), plain=True)
    for r in got:
        # every step's cat made by the replicas' kernel call, or by the exchange of the owners' rows
        # (through shared memory, or gloo with the status folded in); unfolded through gloo (then
        # the cat after the exchange), or replicated and sharded tables in one cat, never
        assert r["made"] == (STEPS if way != "gloo" and sharding != "mixed" else 0)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-5, atol=1e-6, msg=k)


def _faulty_job(rank: int, world: int, sharding: str) -> dict:
    import os

    from hybridembed.distributed import runtime, shm

    os.environ[shm.ENV] = "1"
    runtime.FOLD_ROWS = 0
    plain = Joining()
    every = tuple(range(world))
    tables = [he.TableConfig(f"embs__{k}", VOCAB, DIM) for k in range(3)]
    plan = Plan(
        world,
        tuple(
            shard_table(t, sharding, every if sharding == "data_parallel" else (k % world,))
            for k, t in enumerate(tables)
        ),
    )
    model = he.distribute(plain, plan)
    opt = he.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.2), model, sparse=he.optim.Adagrad(lr=0.2))
    skipped = []
    for step in range(STEPS):
        x, ids = _batch(step, rank)
        if step == 1 and rank == 1:
            ids[2][4, 0] = VOCAB  # (out of range, on one rank)
        try:
            loss = (model(x, ids) ** 2).mean()
        except he.InvalidInputError as e:
            skipped.append((step, str(e)))
            continue
        opt.zero_grad()
        loss.backward()
        opt.step()
    tables = {f"embs.{k}.weight": model.hybridembed.gather_table(f"embs__{k}") for k in range(3)}
    return {"skipped": skipped, "tables": tables}


@pytest.mark.parametrize("sharding", ["data_parallel", "table_wise"])
def test_a_bad_id_on_one_rank_fails_the_joined_step_on_every_rank_and_changes_nothing(sharding):
    got = spawn(_faulty_job, 2, sharding, timeout=120)
    ref = Joining()
    _train(ref, lambda step: _whole(2 * step, 2), plain=True, steps=2)  # (steps 0 and 2: 1 skipped)
    for rank, r in enumerate(got):  # (the victim its own error, the other one naming it)
        assert [s for s, _ in r["skipped"]] == [1], r["skipped"]
        text = r["skipped"][0][1]
        assert text.startswith("feature 'embs__2': id out of range" if rank else "rank(s) 1 got invalid input"), text
        for k, v in r["tables"].items():
            torch.testing.assert_close(v, ref.state_dict()[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("seed", range(4))
def test_the_column_runs_view_exactly_the_pieces_columns(seed):
    """The folded exchange's strided views, a run of evenly spaced pieces of one width at a time,
    hold each piece's columns in order, for shuffled pieces of mixed widths (and a transposed
    gradient's strides)."""
    from hybridembed.distributed.exchange import _column_runs

    g = torch.Generator().manual_seed(seed)
    widths = [int(w) for w in torch.randint(1, 4, (9,), generator=g)] if seed % 2 else [4] * 9
    starts = [sum(widths[:k]) for k in range(9)]
    pieces = [(starts[k], starts[k] + widths[k]) for k in torch.randperm(9, generator=g).tolist()]
    if seed in (0, 2):  # (a block of one width; every other one of them, as tables alternate ranks)
        pieces = sorted(pieces) if seed == 0 else sorted(pieces)[::2] + sorted(pieces)[1::2]
    for flat in (torch.randn(5, sum(widths)), torch.randn(sum(widths), 5).t()):
        got, runs = [], 0
        for n, w, view in _column_runs(flat, pieces):
            assert view.shape == (flat.shape[0], n, w)
            got.extend(view[:, k] for k in range(n))
            runs += 1
        assert len(got) == len(pieces)
        for (lo, hi), x in zip(pieces, got):
            assert torch.equal(x, flat[:, lo:hi])
        if seed in (0, 2):  # (one strided copy a run)
            assert runs == 1 + seed // 2


def _empty_rank_job(rank: int, world: int, way: str) -> dict:
    """Rank 0 has no samples at step 1 (the other does): the joined cat of table-wise tables, made
    by the exchange, is (0, W) there; the loss a sum (a mean of nothing has no gradient), and so
    the tables' reduction."""
    import os

    from hybridembed.distributed import runtime, shm

    os.environ[shm.ENV] = "1" if way in ("shared", "replicated") else "0"
    if way != "folded":
        runtime.FOLD_ROWS = 0
    plain = Joining()
    tables = [he.TableConfig(f"embs__{k}", VOCAB, DIM) for k in range(3)]
    kind, every = ("data_parallel", (0, 1)) if way == "replicated" else ("table_wise", None)
    plan = Plan(world, tuple(shard_table(t, kind, every or (k % world,)) for k, t in enumerate(tables)))
    model = he.distribute(plain, plan, reduction="sum")
    opt = he.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, sparse=he.optim.Adagrad(lr=0.05))
    shapes = []
    for step in range(STEPS):
        x, ids = _empty_batch(step, rank)
        out = model(x, ids)
        shapes.append(tuple(out.shape))
        opt.zero_grad()
        (out**2).sum().backward()
        opt.step()
    tables = {f"embs.{k}.weight": model.hybridembed.gather_table(f"embs__{k}") for k in range(3)}
    return {"shapes": shapes, "tables": tables}


def _empty_batch(step: int, rank: int):
    x, ids = _batch(step, rank)
    n = 0 if (step, rank) == (1, 0) else B
    return x[:n], [i[:n] for i in ids]


@pytest.mark.parametrize("way", ["folded", "shared", "gloo", "replicated"])
def test_a_rank_without_samples_makes_an_empty_joined_cat_and_the_job_equals_one_process(way):
    got = spawn(_empty_rank_job, 2, way, timeout=120)
    ref = Joining()
    embs = [p for n, p in ref.named_parameters() if n.startswith("embs")]
    dense = [p for n, p in ref.named_parameters() if not n.startswith("embs")]
    # (the tables' gradients summed over the ranks; the dense layers' averaged, as DDP: half the rate)
    opts = [torch.optim.SGD(dense, lr=0.025), torch.optim.Adagrad(embs, lr=0.05)]
    for step in range(STEPS):
        parts = [_empty_batch(step, r) for r in range(2)]
        x, ids = torch.cat([p[0] for p in parts]), [torch.cat([p[1][k] for p in parts]) for k in range(3)]
        for o in opts:
            o.zero_grad()
        (ref(x, ids) ** 2).sum().backward()
        for o in opts:
            o.step()
    assert got[0]["shapes"] == [(B,), (0,), (B,)] and got[1]["shapes"] == [(B,)] * STEPS
    for r in got:
        for k, v in r["tables"].items():
            torch.testing.assert_close(v, ref.state_dict()[k], rtol=1e-5, atol=1e-6, msg=k)
