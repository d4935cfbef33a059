"""Joined lookups: a converted model's ``torch.cat`` of its embedding outputs made by the kernel call.

The references: the plain PyTorch model trained with ``torch.optim`` (every step's outputs,
gradients' effect and tables), and the same model where the joined layout does not apply.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hybridembed as he
from hybridembed.errors import HybridEmbedError
from hybridembed.kernels import cpu_fused
from hybridembed.modules import joined

pytestmark = pytest.mark.skipif(not cpu_fused.available(), reason="the joined layout is the fused CPU step's")


class Dlrm(nn.Module):
    """DLRM's shape: a dense part's (B, D) output, then the features' rows, joined by one cat."""

    def __init__(self, fields: int = 4, vocab: int = 30, dim: int = 8, dense: int = 8, first: bool = True):
        super().__init__()
        self.bot = nn.Linear(5, dense)
        self.embs = nn.ModuleList(nn.EmbeddingBag(vocab, dim, mode="sum") for _ in range(fields))
        self.top = nn.Linear(dense + fields * dim, 1)
        self.first = first

    def forward(self, x, ids):
        z = self.bot(x)
        ly = [e(i) for e, i in zip(self.embs, ids)]
        t = torch.cat([z, *ly], 1) if self.first else torch.cat([*ly[:2], z, *ly[2:]], 1)
        return self.top(torch.relu(t)).squeeze(1), ly


def batch(step: int, b: int = 16, fields: int = 4, vocab: int = 30):
    g = torch.Generator().manual_seed(step)
    return torch.randn(b, 5, generator=g), [torch.randint(0, vocab, (b, 1), generator=g) for _ in range(fields)]


def step_each(opts, outs) -> None:
    """One training step of each model on its own output (a mean squared loss)."""
    for opt, out in zip(opts, outs):
        opt.zero_grad()
        (out**2).mean().backward()
        opt.step()


def spy(monkeypatch) -> list[bool]:
    """Whether each joined lookup asked for made the cat (True) or left it to the usual path."""
    made, real = [], joined.lookup_joined

    def counted(*args, **kwargs):
        out = real(*args, **kwargs)
        made.append(out is not None)
        return out

    monkeypatch.setattr("hybridembed.modules.collection.lookup_joined", counted)
    return made


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("sparse", ["sgd", "adagrad"])
def test_a_joined_cat_trains_as_plain_pytorch(monkeypatch, first, sparse):
    made = spy(monkeypatch)
    torch.manual_seed(0)
    base = Dlrm(first=first)
    ref, conv = copy.deepcopy(base), he.convert(copy.deepcopy(base))
    make = {"sgd": (torch.optim.SGD, he.optim.SGD), "adagrad": (torch.optim.Adagrad, he.optim.Adagrad)}[sparse]
    ropt = make[0](ref.parameters(), lr=0.1)
    opt = he.wrap_optimizer(make[0](conv.parameters(), lr=0.1), conv, sparse=make[1](lr=0.1))
    for s in range(4):
        x, ids = batch(s)
        out, ly = conv(x, ids)
        rout, rly = ref(x, ids)
        torch.testing.assert_close(out, rout, rtol=1e-5, atol=1e-6)
        step_each([opt, ropt], [out, rout])
        torch.testing.assert_close(ly[1], rly[1].detach(), rtol=0, atol=1e-6)  # (read after the step: its value then)
    assert made == [True] * 4
    got, want = conv.state_dict(), ref.state_dict()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-5, msg=k)


def test_outputs_read_after_the_cat_have_their_gradient():
    torch.manual_seed(1)
    base = Dlrm()
    ref, conv = copy.deepcopy(base), he.convert(copy.deepcopy(base))
    opt = he.wrap_optimizer(torch.optim.SGD(conv.parameters(), lr=0.1), conv, sparse=he.optim.SGD(lr=0.1))
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, ids = batch(0)
    out, ly = conv(x, ids)
    rout, rly = ref(x, ids)
    (out.sum() + (ly[2] * 3).sum()).backward()  # (a feature read again after the cat: two gradients)
    (rout.sum() + (rly[2] * 3).sum()).backward()
    opt.step()
    ropt.step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(conv.state_dict()[k], v, rtol=0, atol=1e-6, msg=k)


class Joiner(nn.Module):
    def __init__(self, change_in_place: bool):
        super().__init__()
        self.embs = nn.ModuleList(nn.EmbeddingBag(20, 4, mode="sum") for _ in range(3))
        self.change = change_in_place

    def forward(self, ids):
        ly = [e(i) for e, i in zip(self.embs, ids)]
        t = torch.cat(ly, 1)
        if self.change:
            t.mul_(2)
        return t, ly


@pytest.mark.parametrize("change_in_place", [False, True])
def test_a_joined_tensor_changed_in_place_leaves_the_outputs_theirs(monkeypatch, change_in_place):
    made = spy(monkeypatch)
    torch.manual_seed(2)
    base = Joiner(change_in_place)
    conv = he.convert(copy.deepcopy(base))
    ids = [torch.randint(0, 20, (6, 1)) for _ in range(3)]
    t, ly = conv(ids)
    rt, rly = base(ids)
    assert made == [True]
    torch.testing.assert_close(t, rt)
    for a, b in zip(ly, rly):  # (looked up again where the joined tensor changed: the table did not)
        torch.testing.assert_close(a, b)
    t.mul_(3)  # (an output read before the joined tensor changes is its own copy)
    for a, b in zip(ly, rly):
        torch.testing.assert_close(a, b)


def test_an_output_whose_rows_are_gone_raises_and_says_why():
    torch.manual_seed(3)
    conv = he.convert(Joiner(True))
    opt = he.wrap_optimizer(torch.optim.SGD(conv.parameters(), lr=0.1), conv)
    ids = [torch.randint(0, 20, (6, 1)) for _ in range(3)]
    t, ly = conv(ids)
    t.sum().backward()
    opt.step()  # (the table changed, and so did the joined tensor: the output's rows exist nowhere)
    with pytest.raises(HybridEmbedError, match="changed in place"):
        ly[0] + 1


class Varied(nn.Module):
    """Cats the joined layout does not take (each case still equals plain PyTorch)."""

    def __init__(self, case: str):
        super().__init__()
        self.case = case
        mode = "mean" if case == "mean" else "sum"
        self.embs = nn.ModuleList(nn.EmbeddingBag(20, 4, mode=mode) for _ in range(3))
        self.other = nn.EmbeddingBag(20, 6, mode="sum")

    def forward(self, ids, x):
        ly = [e(i) for e, i in zip(self.embs, ids)]
        if self.case == "odd_dense":  # a dense input 3 wide, rows 4 wide
            return torch.cat([x[:, :3], *ly], 1)
        if self.case == "dim0":
            return torch.cat(ly, 0)
        if self.case == "part":  # a queued lookup left out of the cat
            return torch.cat(ly[:2], 1) + ly[2].sum()
        if self.case == "two_groups":
            return torch.cat([*ly, self.other(ids[0])], 1)
        if self.case == "twice":
            return torch.cat([ly[0], *ly], 1)
        if self.case == "double":
            return torch.cat([x.double(), *ly], 1)
        return torch.cat(ly, 1)  # mean, multi-hot


@pytest.mark.parametrize("case", ["odd_dense", "dim0", "part", "two_groups", "twice", "double", "mean", "multi"])
def test_cats_it_does_not_take_run_the_usual_path(monkeypatch, case):
    made = spy(monkeypatch)
    torch.manual_seed(4)
    base = Varied(case)
    conv = he.convert(copy.deepcopy(base))
    hot = 3 if case == "multi" else 1
    ids = [torch.randint(0, 20, (5, hot)) for _ in range(3)]
    x = torch.randn(5, 4)
    torch.testing.assert_close(conv(ids, x), base(ids, x))
    assert not any(made)


def test_inference_and_no_grad_take_the_joined_layout(monkeypatch):
    made = spy(monkeypatch)
    torch.manual_seed(5)
    base = Dlrm()
    conv = he.convert(copy.deepcopy(base)).eval()
    x, ids = batch(0)
    with torch.no_grad():
        out, _ = conv(x, ids)
    torch.testing.assert_close(out, base(x, ids)[0].detach())
    with torch.inference_mode():  # (left to the usual path)
        out, _ = conv(x, ids)
    torch.testing.assert_close(out, base(x, ids)[0].detach())
    assert made == [True]


def test_bad_ids_in_a_joined_cat_are_refused_and_change_nothing():
    torch.manual_seed(6)
    conv = he.convert(Dlrm())
    opt = he.wrap_optimizer(torch.optim.SGD(conv.parameters(), lr=0.1), conv)
    before = copy.deepcopy(conv.state_dict())
    x, ids = batch(0)
    ids[2][3, 0] = 30  # (the vocabulary is 30)
    with pytest.raises(he.InvalidInputError, match="embs__2|embs.2"):
        conv(x, ids)
    opt.step()
    for k, v in before.items():
        assert torch.equal(conv.state_dict()[k], v), k
    x, ids = batch(1)  # the next forward is served
    conv(x, ids)[0].sum().backward()
    opt.step()


class DeepFm(nn.Module):
    """DeepCTR's shape: per field a (B, 1, D) and a (B, 1, 1) lookup, all called before the first cat
    (two groups queued: each cat joins one, the other stays queued until its own cat)."""

    def __init__(self, fields: int = 3, vocab: int = 25, dim: int = 4):
        super().__init__()
        self.emb = nn.ModuleList(nn.Embedding(vocab, dim) for _ in range(fields))
        self.lin = nn.ModuleList(nn.Embedding(vocab, 1) for _ in range(fields))
        self.dense = nn.Linear(2, dim)
        self.deep = nn.Linear((fields + 1) * dim, 1)

    def forward(self, sparse, x):
        emb = [e(sparse[:, i : i + 1]) for i, e in enumerate(self.emb)]  # F x (B, 1, D)
        lin = [e(sparse[:, i : i + 1]) for i, e in enumerate(self.lin)]  # F x (B, 1, 1)
        e = torch.cat([self.dense(x).unsqueeze(1), *emb], 1)  # (B, F + 1, D)
        first = torch.cat(lin, 1).sum((1, 2))
        fm = 0.5 * (e.sum(1).pow(2) - e.pow(2).sum(1)).sum(1)
        return first + fm + self.deep(e.flatten(1)).squeeze(1)


def test_three_dim_outputs_of_two_groups_are_joined_each_and_train_as_plain_pytorch(monkeypatch):
    made = spy(monkeypatch)
    torch.manual_seed(7)
    base = DeepFm()
    ref, conv = copy.deepcopy(base), he.convert(copy.deepcopy(base))
    ropt = torch.optim.Adagrad(ref.parameters(), lr=0.1)
    opt = he.wrap_optimizer(torch.optim.Adagrad(conv.parameters(), lr=0.1), conv)
    for s in range(3):
        g = torch.Generator().manual_seed(s)
        sparse, x = torch.randint(0, 25, (8, 3), generator=g), torch.randn(8, 2, generator=g)
        out, rout = conv(sparse, x), ref(sparse, x)
        torch.testing.assert_close(out, rout, rtol=1e-5, atol=1e-6)
        step_each([opt, ropt], [out, rout])
    assert made == [True, True] * 3
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(conv.state_dict()[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_a_refused_joined_cat_fails_every_queued_output_as_a_flush_does():
    torch.manual_seed(8)
    base = DeepFm()
    conv = he.convert(copy.deepcopy(base))
    told = []  # (a sharded collection tells the other ranks here; they raised in the same exchange already)
    conv.hybridembed.step_failed = told.append
    sparse, x = torch.randint(0, 25, (4, 3)), torch.randn(4, 2)
    bad = sparse.clone()
    bad[1, 2] = 99  # (the vocabulary is 25)
    with pytest.raises(he.InvalidInputError):
        conv(bad, x)
    assert told == [] and len(conv.hybridembed.lookup_queue) == 0
    torch.testing.assert_close(conv(sparse, x), base(sparse, x))  # (the next forward is served)


def test_dynamic_tables_joined_train_as_the_usual_grouped_path(monkeypatch):
    made, real = [], joined.lookup_joined
    conv = ref = None

    def only_conv(collection, *args, **kwargs):  # (the reference's cats take the usual path)
        if collection is ref.hybridembed:
            return None
        out = real(collection, *args, **kwargs)
        made.append(out is not None)
        return out

    monkeypatch.setattr("hybridembed.modules.collection.lookup_joined", only_conv)
    torch.manual_seed(9)
    base = DeepFm(vocab=1000)
    conv, ref = (he.convert(copy.deepcopy(base), dynamic=True) for _ in range(2))
    opts = [he.wrap_optimizer(torch.optim.Adagrad(m.parameters(), lr=0.1), m) for m in (conv, ref)]
    for s in range(3):
        g = torch.Generator().manual_seed(s)
        sparse, x = torch.randint(-(2**40), 2**40, (8, 3), generator=g), torch.randn(8, 2, generator=g)
        outs = [m(sparse, x) for m in (conv, ref)]
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
        step_each(opts, outs)
    assert made == [True, True] * 3
    for k, v in ref.state_dict().items():  # (ids, rows, counters: a dynamic table's whole entry)
        got = conv.state_dict()[k]
        if v.is_floating_point():
            torch.testing.assert_close(got, v, rtol=1e-5, atol=1e-6, msg=k)
        else:
            assert torch.equal(got, v), k


def test_a_cat_in_another_grad_mode_than_its_lookups_is_that_mode_s(monkeypatch):
    made = spy(monkeypatch)
    conv = he.convert(Joiner(False))
    queue = conv.hybridembed.lookup_queue
    ids = [torch.randint(0, 20, (6, 1)) for _ in range(3)]
    queue.enter()  # (the lookups queued in grad mode, as a forward queues them)
    try:
        ly = [e(i) for e, i in zip(conv.embs, ids)]
        with torch.no_grad():
            t = torch.cat(ly, 1)
    finally:
        queue.exit()
    assert not t.requires_grad and made == []  # (as torch: a cat under no_grad has no gradient)
    torch.testing.assert_close(t, torch.cat([e(i) for e, i in zip(conv.embs, ids)], 1).detach())


def test_an_empty_batch_makes_an_empty_cat_and_training_goes_on_as_plain_pytorch(monkeypatch):
    made = spy(monkeypatch)
    torch.manual_seed(2)
    base = Dlrm()
    ref, conv = copy.deepcopy(base), he.convert(copy.deepcopy(base))
    opt = he.wrap_optimizer(torch.optim.SGD(conv.parameters(), lr=0.1), conv, sparse=he.optim.Adagrad(lr=0.1))
    ropt = [torch.optim.SGD([p for n, p in ref.named_parameters() if not n.startswith("embs")], lr=0.1),
            torch.optim.Adagrad([p for n, p in ref.named_parameters() if n.startswith("embs")], lr=0.1)]  # fmt: skip
    for b in (16, 0, 16):
        x, ids = batch(b, b=b)
        out, ly = conv(x, ids)
        rout, _ = ref(x, ids)
        assert out.shape == rout.shape == (b,) and ly[0].shape == (b, 8)
        for o in (opt, *ropt):
            o.zero_grad()
        (out**2).sum().backward()
        (rout**2).sum().backward()
        for o in (opt, *ropt):
            o.step()
    assert made == [True] * 3
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(conv.state_dict()[k], v, rtol=0, atol=1e-5, msg=k)
