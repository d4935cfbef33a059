"""Asynchronous parameter servers: one trainer without a cache equals one process; the hot-row
cache serves a row for ``staleness`` steps and writes every gradient back (with SGD and a loss
whose gradient does not depend on the rows, the tables end equal to one process whatever the
cache did); lookups without autograd do not pile rows up on the trainer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridembed as he
from hybridembed.distributed import unwrap
from hybridembed.errors import ConfigError
from hybridembed.launch import spawn

W = torch.linspace(-1.0, 1.0, 4)  # the loss's fixed weights: d loss / d row = W per id


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        tables = [he.TableConfig("a", 40, 4), he.TableConfig("d", None, 4, dynamic=he.Dynamic())]
        self.ec = he.EmbeddingCollection(tables, {"a": "a", "d": "d"}, seed=4)

    def forward(self, x):
        out = self.ec(x)
        return (out["a"] * W).sum() + (out["d"] * W).sum()


def _ids(step: int, same: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0 if same else 40 + step)
    return {"a": torch.randint(0, 40, (6, 2), generator=g), "d": torch.randint(-50, 50, (6,), generator=g)}


def _run(model, steps: int, same: bool) -> None:
    opt = he.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    for s in range(steps):
        opt.zero_grad()
        model(_ids(s, same)).backward()
        opt.step()


def _tables(ec) -> dict[str, torch.Tensor]:
    ids, rows = ec.gather_table("d") if hasattr(ec, "gather_table") else ec.dynamic_rows("d")
    a = ec.gather_table("a") if hasattr(ec, "gather_table") else ec.weight("a").detach()
    return {"a": a, "d.ids": ids, "d": rows}


def _job(rank: int, world: int, steps: int, same: bool, cache_rows: int, staleness: int) -> dict:
    model = he.distribute(
        Linear(), servers=1, mode="async", staleness=staleness, cache_rows=cache_rows, server_exit=False
    )
    if model is None:
        return {}
    _run(model, steps, same)
    ec = unwrap(model).ec
    stats = ec.stats()
    ec.write_back()  # (the cached gradients reach the server)
    tables = _tables(ec)
    model.eval()
    with torch.no_grad():  # lookups without autograd replace each other's rows
        for s in range(5):
            model(_ids(100 + s, False))
    held = [st.weight.shape[0] for st in ec.storages]
    return {"tables": tables, "stats": stats, "held": held}


def _reference(steps: int, same: bool) -> dict:
    model = Linear()
    _run(model, steps, same)
    return _tables(model.ec)


@pytest.mark.parametrize(
    ("cache_rows", "staleness", "same"),
    [(0, 1, False), (8, 3, False), (64, 3, True)],  # no cache; a cache too small (evictions); all hits
)
def test_async_cache_writes_every_gradient_back(cache_rows, staleness, same):
    steps = 9
    ref = _reference(steps, same)
    got = spawn(_job, 2, steps, same, cache_rows, staleness, timeout=120)[0]
    for k in ref:
        torch.testing.assert_close(got["tables"][k], ref[k], atol=1e-6, rtol=1e-6)
    stats = got["stats"]
    if same:  # each row pulled at steps 0, 3, 6 and served from the cache at the 6 others
        assert stats["cache_hit_rate"] == pytest.approx(6 / 9)
    elif cache_rows:
        assert 0 < stats["cache_hit_rate"] < 1
    assert all(h <= cache_rows + 12 for h in got["held"])  # (the cache, then one eval batch's rows)


def test_cache_needs_async_mode_and_arguments_are_checked():
    with pytest.raises(ConfigError, match="cache_rows needs mode='async'"):
        he.distribute(Linear(), servers=1, cache_rows=10)
    for kw, msg in (
        ({"servers": -1}, "servers must be"),
        ({"servers": 1, "mode": "eventual"}, "mode must be one of"),
        ({"servers": 1, "staleness": 0}, "staleness must be"),
        ({"servers": 1, "ps_timeout": 0}, "ps_timeout must be"),
        ({"servers": 1, "max_request_bytes": 10}, "max_request_bytes must be"),
    ):
        with pytest.raises(ConfigError, match=msg):
            he.distribute(Linear(), **kw)


class _FakeClient:
    """Answers pulls at once with rows that encode their (table, id): row = [id, table, ...]."""

    def __init__(self) -> None:
        self.step = 0
        self.queued = []

    def queue(self, pull) -> None:
        self.queued.append(pull)

    def drop(self, pull) -> None:
        self.queued.remove(pull)

    def complete(self, pull) -> torch.Tensor:
        if pull in self.queued:
            self.queued.remove(pull)
        return torch.stack([pull.ids.double(), pull.tabs.double()], 1).repeat(1, pull.storage.dim // 2).float()


def test_the_cache_index_stays_exact_under_random_lookups():
    from hybridembed.ps.cache import RowCache
    from hybridembed.ps.remote import RemoteStorage

    tables = [he.TableConfig("x", None, 4, dynamic=he.Dynamic()), he.TableConfig("y", None, 4, dynamic=he.Dynamic())]
    st = RemoteStorage(tables)
    st.client, st.staleness = _FakeClient(), 3
    st.cache = RowCache(st, 50)
    g = torch.Generator().manual_seed(3)
    for step in range(60):
        st.client.step = step
        n = int(torch.randint(1, 90, (1,), generator=g))  # (sometimes more distinct ids than the cache holds)
        ids = torch.randint(-40, 40, (n,), generator=g)
        tabs = torch.randint(0, 2, (n,), generator=g)
        order = torch.argsort(tabs, stable=True)
        ids, tabs = ids[order], tabs[order]
        counts = torch.bincount(tabs, minlength=2).tolist()
        plan = st.resolve(ids, [0, 1], counts, True)
        slots = plan.commit()[0]
        rows = st.weight.detach().index_select(0, slots)
        # every id reads its own row (cached or staged), whatever was evicted or refreshed
        torch.testing.assert_close(rows[:, 0], ids.float())
        torch.testing.assert_close(rows[:, 1], tabs.float())
        c = st.cache
        held = (c.fetched >= 0).nonzero().squeeze(1)
        assert torch.equal(c.sorted_keys, torch.sort(c.key[held])[0])  # the index is the held keys, sorted
        assert torch.equal(c.key.index_select(0, c.sorted_slots), c.sorted_keys)
        assert c.sorted_keys.unique().numel() == held.numel()  # (no key held twice)
        assert bool((step - c.fetched[held] < 3).all())  # (nothing held past its staleness)
        grad = torch.sparse_coo_tensor(slots.unsqueeze(0), torch.ones(n, 4), st.weight.shape, check_invariants=True)
        st.weight.grad = grad
        st.take_gradient(st.grad_rows())
        st.after_step()


def test_the_one_process_default_checks_its_arguments_too():
    for kw, msg in (
        ({"reduction": "max"}, "reduction must be one of"),
        ({"ddp": "yes"}, "ddp must be True, False"),
        ({"seeds": 3}, "unknown argument 'seeds'"),
    ):
        with pytest.raises(ConfigError, match=msg):
            he.distribute(Linear(), servers=1, **kw)
