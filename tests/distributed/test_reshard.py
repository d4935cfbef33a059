"""A checkpoint saved by N ranks under one plan loads at M ranks under another (2 -> 3, 4 -> 1,
1 -> 4; row-wise -> table-wise, column-wise -> row-wise, data-parallel <-> sharded, dynamic
hash shards <-> column slices), optimizer state included (Adam, Adagrad, row-wise Adagrad, SGD with
momentum): K steps, save, load elsewhere, K more steps equal an uninterrupted one-process run
within 1e-5. A distributed chain of incremental versions (one written in the background) loads
at another world size like the full state."""

from __future__ import annotations

import torch
from torch import nn

import hybridembed as he
from hybridembed.distributed import Plan, shard_table
from hybridembed.launch import spawn
from tests.distributed.test_checkpoint import _close, _snapshot

N, K = 12, 3  # global batch (divisible by 1..4), steps before and after the save
FEATURES = {f: f for f in "abcdef"}


def _tables() -> list[he.TableConfig]:
    return [
        he.TableConfig("a", 40, 8, optimizer=he.optim.Adam(lr=0.02)),
        he.TableConfig("b", 30, 8, combiner="mean", optimizer=he.optim.RowWiseAdagrad(lr=0.1)),
        he.TableConfig("c", 24, 8, optimizer=he.optim.Adagrad(lr=0.1)),
        he.TableConfig("d", 16, 8, combiner="mean", optimizer=he.optim.Adam(lr=0.03)),
        he.TableConfig("e", None, 8, dynamic=he.Dynamic(), optimizer=he.optim.Adagrad(lr=0.05)),
        he.TableConfig("f", 20, 8, optimizer=he.optim.SGD(lr=0.1, momentum=0.9)),
    ]


def _plan(world: int, which: str) -> Plan:
    """``A``: a row-wise, b column-wise, c data-parallel, d row-wise by residues, e (dynamic) hash
    shards, f table-wise; ``B`` moves every table to another kind."""
    t = {x.name: x for x in _tables()}
    ranks = tuple(range(world))
    if which == "A":
        kinds = {
            "a": ("row_wise", ranks, "block"),
            "b": ("column_wise", ranks, None),
            "c": ("data_parallel", ranks, None),
            "d": ("row_wise", ranks, "mod"),
            "e": ("row_wise", ranks, None),
            "f": ("table_wise", (world - 1,), None),
        }
    else:
        kinds = {
            "a": ("table_wise", (0,), None),
            "b": ("row_wise", ranks, "block"),
            "c": ("row_wise", ranks, "mod"),
            "d": ("data_parallel", ranks, None),
            "e": ("column_wise", ranks, None),
            "f": ("column_wise", ranks, None),
        }
    out = []
    for name, (kind, on, placement) in kinds.items():
        kw = {"placement": placement} if placement else {}
        out.append(shard_table(t[name], kind, on, **kw))
    return Plan(world, tuple(out))


class Ranker(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.ec = he.EmbeddingCollection(_tables(), FEATURES, seed=9)
        self.mlp = nn.Linear(48, 1)

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.ec(x)
        return self.mlp(torch.cat([out[f] for f in FEATURES], 1)).squeeze(1)


def _batch(step: int, lo: int, hi: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    x = {}
    for f, rows in (("a", 40), ("b", 30), ("c", 24), ("d", 16), ("e", 500), ("f", 20)):
        ids = torch.randint(0, rows, (N, 3), generator=g)
        ids[torch.rand(N, 3, generator=g) < 0.3] = -1
        x[f] = ids[lo:hi]
    return x, torch.rand(N, generator=g)[lo:hi]


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return he.wrap_optimizer(torch.optim.Adam(model.parameters(), lr=0.01), model)


def _steps(model, opt, steps, rank: int, world: int) -> None:
    per = N // world
    for s in steps:
        x, y = _batch(s, rank * per, (rank + 1) * per)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _model(world: int, which: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = Ranker() if which == "one" else he.distribute(Ranker(), plan=_plan(world, which))
    return model, _optimizer(model)


def _train_save(rank: int, world: int, path: str, which: str, incremental: bool) -> dict:
    model, opt = _model(world, which)
    if not incremental:
        _steps(model, opt, range(K), rank, world)
        he.save(path, model, opt)
        return {}
    _steps(model, opt, range(1), rank, world)
    he.save(path, model, opt, incremental=True)  # the full base
    _steps(model, opt, range(1, 2), rank, world)
    he.save(path, model, opt, incremental=True)
    _steps(model, opt, range(2, K), rank, world)
    handle = he.save(path, model, opt, incremental=True, background=True)
    saved = _snapshot(model)
    _steps(model, opt, range(K, K + 1), rank, world)  # trains on while the delta is written
    return {"written": handle.wait(), "saved": saved}


def _load_train(rank: int, world: int, path: str, which: str) -> dict:
    model, opt = _model(world, which)
    he.load(path, model, opt)
    loaded = _snapshot(model)
    _steps(model, opt, range(K, 2 * K), rank, world)
    return {"loaded": loaded, "final": _snapshot(model)}


def _reference() -> tuple[dict, dict]:
    model, opt = _model(1, "one")
    _steps(model, opt, range(K), 0, 1)
    saved = _snapshot(model)
    _steps(model, opt, range(K, 2 * K), 0, 1)
    return saved, _snapshot(model)


def test_two_ranks_to_three_under_another_plan(tmp_path):
    saved, final = _reference()
    path = str(tmp_path / "ckpt")
    spawn(_train_save, 2, path, "A", False, timeout=240)
    for r in spawn(_load_train, 3, path, "B", timeout=240):
        _close(r["loaded"], saved, 1e-5)
        _close(r["final"], final, 1e-5)


def test_four_ranks_to_one_process_and_one_process_to_four(tmp_path):
    saved, final = _reference()
    path = str(tmp_path / "ckpt")
    spawn(_train_save, 4, path, "A", False, timeout=240)
    model, opt = _model(1, "one")
    he.load(path, model, opt)
    _close(_snapshot(model), saved, 1e-5)
    _steps(model, opt, range(K, 2 * K), 0, 1)
    _close(_snapshot(model), final, 1e-5)

    one = str(tmp_path / "one")
    model, opt = _model(1, "one")
    _steps(model, opt, range(K), 0, 1)
    he.save(one, model, opt)
    for r in spawn(_load_train, 4, one, "B", timeout=240):
        _close(r["loaded"], saved, 1e-5)
        _close(r["final"], final, 1e-5)


def test_an_incremental_chain_of_three_ranks_loads_at_two_under_another_plan(tmp_path):
    saved, final = _reference()
    path = str(tmp_path / "ckpt")
    results = spawn(_train_save, 3, path, "B", True, timeout=240)
    assert results[0]["written"].endswith("v-000003")
    from hybridembed.checkpoint import compact, read_manifest

    m = read_manifest(path)
    assert m["incremental"]["length"] == 2 and m["world_size"] == 3
    _close(results[0]["saved"], saved, 1e-5)
    for r in spawn(_load_train, 2, path, "A", timeout=240):
        _close(r["loaded"], saved, 1e-5)
        _close(r["final"], final, 1e-5)
    # the chain written again as one full version (no job needed) loads the same rows
    compact(path)
    done = read_manifest(path)
    assert "incremental" not in done
    step = {q: {s.get("step") for s in t["shards"]} for q, t in m["tables"].items()}  # (a job's resume takes it)
    assert {q: {s.get("step") for s in t["shards"]} for q, t in done["tables"].items()} == step, step
    model, opt = _model(1, "one")
    he.load(path, model, opt)
    _close(_snapshot(model), saved, 1e-5)


def _background_failure(rank: int, world: int, path: str) -> dict:
    from hybridembed.checkpoint import layout as ck_layout

    model, opt = _model(world, "A")
    _steps(model, opt, range(1), rank, world)
    he.save(path, model, opt)
    _steps(model, opt, range(1, 2), rank, world)
    real = ck_layout._write_file
    if rank == 1:  # rank 1 cannot write its shards: every rank's wait() raises, naming it

        def failing(p, obj):
            if p.parent.name == "tables":
                raise ck_layout._WriteError(p, OSError(28, "No space left on device"))
            real(p, obj)

        ck_layout._write_file = failing
    handle = he.save(path, model, opt, incremental=True, background=True)
    _steps(model, opt, range(2, K), rank, world)  # the failure arrives while training goes on
    try:
        handle.wait()
        failed = None
    except he.CheckpointError as e:
        failed = str(e)
    ck_layout._write_file = real
    he.save(path, model, opt, incremental=True)  # holds every row changed since the full version
    return {"failed": failed, "saved": _snapshot(model)}


def test_a_background_save_that_fails_on_one_rank_fails_on_every_rank_and_the_next_one_has_every_row(tmp_path):
    from hybridembed.checkpoint import read_manifest

    path = str(tmp_path / "ckpt")
    results = spawn(_background_failure, 2, path, timeout=240)
    for r in results:
        assert "rank 1:" in r["failed"] and "No space left on device" in r["failed"], r["failed"]
    m = read_manifest(path)
    assert m["path"].endswith("v-000002") and m["incremental"]["parent"]["version"] == "v-000001"
    model, opt = _model(1, "one")
    he.load(path, model, opt)
    _close(_snapshot(model), results[0]["saved"], 1e-6)
