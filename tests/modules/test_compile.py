"""``torch.compile(fullgraph=True)`` of a collection and of a converted model: training and eval
equal the eager path (the single-process reference), dynamic tables included; bad ids fail the
compiled call and change nothing."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hybridembed as he

torch._dynamo.config.cache_size_limit = 16


@pytest.fixture(autouse=True, scope="module")
def _scalar_cpp_kernels():
    """Inductor's C++ kernels without SIMD: they compile in about two thirds of the time here (what is
    tested is the graph the compiler sees, not its vectorization)."""
    from torch._inductor import config

    with config.patch({"cpp.vec_isa_ok": False}):
        yield


TABLES = [
    he.TableConfig("a", 100, 8),
    he.TableConfig("b", 50, 8, combiner="mean"),
    he.TableConfig("c", 40, 8, combiner="sqrtn"),
    he.TableConfig("s", 30, 8, combiner="none"),
]
FEATURES = {"a": "a", "b": "b", "c": "c", "s": "s"}


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 50, (16, 3), generator=g)
    b[::3, 1] = -1  # padding inside bags
    b[5] = -1  # an empty bag
    s = torch.randint(0, 30, (16, 4), generator=g)
    s[:, 3] = -1
    lengths = torch.randint(0, 3, (16,), generator=g)
    c = he.Jagged.from_lengths(torch.randint(0, 40, (int(lengths.sum()),), generator=g), lengths,
                               torch.rand(int(lengths.sum()), generator=g))  # fmt: skip
    return {"a": torch.randint(0, 100, (16,), generator=g), "b": b, "c": c, "s": s}, torch.rand(16, generator=g)


class Ranker(nn.Module):
    def __init__(self):
        super().__init__()
        self.ec = he.EmbeddingCollection(TABLES, FEATURES, seed=1, sequence_output="padded")
        self.top = nn.Linear(32, 1)

    def forward(self, x):
        o = self.ec(x)
        return self.top(torch.cat([o["a"], o["b"], o["c"], o["s"].sum(1)], 1)).squeeze(1)


def _train(model, opt, steps):
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


@pytest.mark.parametrize("optimizer", [torch.optim.Adagrad, torch.optim.Adam])
def test_a_compiled_collection_trains_and_serves_as_the_eager_one(optimizer):
    torch.manual_seed(0)
    eager = Ranker()
    start = copy.deepcopy(eager.state_dict())
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, fullgraph=True)
    _train(eager, he.wrap_optimizer(optimizer(eager.parameters(), lr=0.05), eager), 3)
    _train(compiled, he.wrap_optimizer(optimizer(twin.parameters(), lr=0.05), twin), 3)
    for k, v in eager.state_dict().items():
        torch.testing.assert_close(twin.state_dict()[k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert not torch.equal(eager.state_dict()["ec.b.weight"], start["ec.b.weight"])  # (the tables trained)
    eager.eval(), compiled.eval()
    x, _ = _batch(9)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-6)


def test_an_empty_batch_serves_an_empty_output_under_compile():
    model = Ranker().eval()
    compiled = torch.compile(model, fullgraph=True)
    x, _ = _batch(3)
    empty = {k: (he.Jagged.from_lengths(v.values[:0], v.lengths()[:0], v.weights[:0]) if k == "c" else v[:0])
             for k, v in x.items()}  # fmt: skip
    with torch.no_grad():
        assert compiled(empty).shape == model(empty).shape == (0,)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)


def test_a_bad_id_fails_the_compiled_call_and_changes_nothing():
    model = Ranker()
    compiled = torch.compile(model, fullgraph=True)
    opt = he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.05), model)
    before = copy.deepcopy(model.state_dict())
    x, y = _batch(0)
    x["a"][3] = 100  # one past the last row
    with pytest.raises(RuntimeError, match="feature 'a': an id is out of range"):
        opt.zero_grad()
        ((compiled(x) - y) ** 2).mean().backward()
        opt.step()
    for k, v in before.items():
        assert torch.equal(model.state_dict()[k], v), k


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.user = nn.EmbeddingBag(100, 8, mode="mean", padding_idx=0)
        self.item = nn.Embedding(50, 8, padding_idx=3)
        self.tags = nn.EmbeddingBag(30, 8, mode="sum")
        self.top = nn.Linear(24, 1)

    def forward(self, users, items, tags, tag_offsets, tag_weights):
        parts = [
            self.user(users),
            self.item(items).sum(1),
            self.tags(tags, tag_offsets, per_sample_weights=tag_weights),
        ]
        return self.top(torch.cat(parts, 1)).squeeze(1)


def _plain_batch(seed):
    g = torch.Generator().manual_seed(seed)
    tags = torch.randint(0, 30, (40,), generator=g)
    offsets = torch.tensor([0, 3, 3, 10, 12, 20, 25, 30, 31, 32, 33, 34, 35, 36, 37, 39])
    users = torch.randint(0, 100, (16, 3), generator=g)
    users[2] = 0  # a bag of padding alone
    args = (users, torch.randint(0, 50, (16, 2), generator=g), tags, offsets, torch.rand(40, generator=g))
    return args, torch.rand(16, generator=g)


def test_a_compiled_converted_model_trains_as_the_plain_model():
    torch.manual_seed(0)
    plain = Plain()
    model = he.convert(copy.deepcopy(plain))
    compiled = torch.compile(model, fullgraph=True)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)  # (SGD: the sparse update equals the dense one)
    opt = he.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    for step in range(3):
        args, y = _plain_batch(step)
        for m, o in ((plain, plain_opt), (compiled, opt)):
            o.zero_grad()
            ((m(*args) - y) ** 2).mean().backward()
            o.step()
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-5, atol=1e-6, msg=k)


class DynamicRanker(nn.Module):
    def __init__(self):
        super().__init__()
        tables = [
            he.TableConfig("d", None, 8, combiner="mean", dynamic=he.Dynamic(capacity=64, eviction="lru")),
            he.TableConfig("e", None, 8, dynamic=he.Dynamic()),
            he.TableConfig("a", 100, 8),
        ]
        self.ec = he.EmbeddingCollection(tables, {"d": "d", "e": "e", "a": "a"}, seed=2)
        self.top = nn.Linear(24, 1)

    def forward(self, x):
        o = self.ec(x)
        return self.top(torch.cat([o["d"], o["e"], o["a"]], 1)).squeeze(1)


def _dynamic_batch(seed):
    g = torch.Generator().manual_seed(seed)
    d = torch.randint(0, 10**12, (16, 3), generator=g)
    d[::4, 2] = -1  # padding
    return {"d": d, "e": torch.randint(0, 50, (16,), generator=g), "a": torch.randint(0, 100, (16,), generator=g)}


def test_dynamic_tables_compile_and_train_as_the_eager_ones():
    torch.manual_seed(0)
    eager = DynamicRanker()
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, fullgraph=True)
    opts = [he.wrap_optimizer(torch.optim.Adam(m.parameters(), lr=0.05), m) for m in (eager, twin)]
    for step in range(4):  # (ids new at every step: rows made, 64 rows at most in "d": evictions)
        x, y = _dynamic_batch(step), torch.rand(16)
        for m, o in ((eager, opts[0]), (compiled, opts[1])):
            o.zero_grad()
            ((m(x) - y) ** 2).mean().backward()
            o.step()
    for name in ("d", "e"):
        ids, rows = eager.ec.dynamic_rows(name)
        got_ids, got_rows = twin.ec.dynamic_rows(name)
        assert torch.equal(got_ids, ids) and ids.numel() > 0
        torch.testing.assert_close(got_rows, rows, rtol=1e-5, atol=1e-6)
    assert twin.ec.dynamic_stats()["d"] == eager.ec.dynamic_stats()["d"]
    eager.eval(), compiled.eval()
    x = _dynamic_batch(2)  # (known ids and, in eval, unknown ones reading the default row)
    x["d"][0, 0] = 7
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-6)


def test_learnable_per_id_weights_are_refused_under_compile():
    ec = he.EmbeddingCollection([he.TableConfig("t", 10, 4)])
    w = torch.rand(3, requires_grad=True)
    with pytest.raises(Exception, match="per-id weights that require grad"):
        torch.compile(ec, fullgraph=True)({"t": he.Jagged(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 3]), w)})
