"""``he.convert`` against the unconverted model: same forward, same training, same state_dict keys.

The reference is a deep copy of the plain PyTorch model made before conversion, trained with
the plain ``torch.optim`` optimizer; the converted model is trained with
``he.wrap_optimizer(<the same torch optimizer>, converted)``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import hybridembed as he
from hybridembed.api.convert import HybridEmbedding, HybridEmbeddingBag

D = 4
B = 5
STEPS = 4


class Tower(nn.Module):
    def __init__(self, shared: nn.Embedding):
        super().__init__()
        self.shared = shared  # the same nn.Embedding object in both towers
        self.bag = nn.EmbeddingBag(15, D, mode="mean", padding_idx=0)

    def forward(self, ids, bag_ids):  # (B, L), (B, L) -> (B, D)
        return self.shared(ids).sum(1) + self.bag(bag_ids)


class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.user = nn.Embedding(20, D, padding_idx=3, sparse=True)
        self.items = nn.EmbeddingBag(30, D, mode="sum")  # 1-D ids + offsets + per_sample_weights
        shared = nn.Embedding(12, D, sparse=True)
        self.towers = nn.ModuleList([Tower(shared), Tower(shared)])
        self.heads = nn.ModuleDict(
            {
                "geo": nn.EmbeddingBag(8, D, mode="sum", padding_idx=2, include_last_offset=True, sparse=True),
                "ctx": nn.Embedding(6, D),
            }
        )
        self.mlp = nn.Sequential(nn.Linear(6 * D, 8), nn.ReLU(), nn.Linear(8, 1))


class Model(Base):  # a subclassed user model
    def forward(self, b):
        parts = [
            self.user(b["user"]).mean(1),  # (B, 2, D) -> (B, D)
            self.items(b["items"], b["items_off"], b["items_w"]),
            self.towers[0](b["t0"], b["t0_bag"]),
            self.towers[1](b["t1"], b["t1_bag"]),
            self.heads["geo"](b["geo"], b["geo_off"]),
            self.heads["ctx"](b["ctx"]),
        ]
        return self.mlp(torch.cat(parts, 1)).squeeze(1)  # (B,)


def batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    user = torch.randint(0, 20, (B, 2), generator=g)
    user[0, 1] = 3  # padding_idx
    lengths = torch.randint(0, 4, (B,), generator=g)
    lengths[1] = 0  # an empty bag
    n = int(lengths.sum())
    items = torch.randint(0, 30, (n,), generator=g)
    items[: min(n, 2)] = 7  # a duplicate id
    t0_bag = torch.randint(0, 15, (B, 3), generator=g)
    t0_bag[2] = 0  # a bag of padding only: its mean is 0
    t0_bag[3, 0] = 0
    geo_len = torch.randint(0, 3, (B,), generator=g)
    geo = torch.randint(0, 8, (int(geo_len.sum()),), generator=g)
    return {
        "user": user,
        "items": items,
        "items_off": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]]),
        "items_w": torch.rand(n, generator=g),
        "t0": torch.randint(0, 12, (B, 3), generator=g),
        "t0_bag": t0_bag,
        "t1": torch.randint(0, 12, (B, 2), generator=g),
        "t1_bag": torch.randint(0, 15, (B, 1), generator=g),
        "geo": torch.cat([geo, torch.tensor([2])]),  # and a padding id in the last bag
        "geo_off": torch.cat([torch.zeros(1, dtype=torch.int64), geo_len.cumsum(0) + (torch.arange(B) == B - 1)]),
        "ctx": torch.randint(0, 6, (B,), generator=g),
        "target": torch.randn(B, generator=g),
    }


def train(model, opt, steps=STEPS):
    outs = []
    for s in range(steps):
        b = batch(s)
        opt.zero_grad()
        out = model(b)
        ((out - b["target"]) ** 2).sum().backward()
        opt.step()
        outs.append(out.detach())
    return outs


def make_opt(name, params):
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1)
    return torch.optim.SGD(params, lr=0.05)


def assert_same_state(a: nn.Module, b: nn.Module, skip: tuple[str, ...] = ()):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(k for k in sa if not k.startswith(skip)) == sorted(k for k in sb if not k.startswith(skip))
    for k in sa:
        if not k.startswith(skip):
            torch.testing.assert_close(sa[k], sb[k], rtol=1e-6, atol=1e-7, msg=k)


# --- the main claim: two changed lines, same training ---------------------------------------
@pytest.mark.parametrize("opt_name", ["adagrad", "sgd"])
def test_converted_model_trains_like_the_original(opt_name):
    model = Model()
    ref = copy.deepcopy(model)
    conv = he.convert(model)
    assert conv is model
    for path in ("user", "towers.0.shared", "heads.ctx"):
        assert isinstance(conv.get_submodule(path), HybridEmbedding)
    for path in ("items", "towers.0.bag", "heads.geo"):
        assert isinstance(conv.get_submodule(path), HybridEmbeddingBag)
    assert conv.towers[0].shared is conv.towers[1].shared  # still shared: one table
    assert len(conv.hybridembed.tables) == 7 and len(conv.hybridembed.groups) == 1  # one storage, one update
    assert not any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for m in conv.modules())
    assert_same_state(conv, ref)  # same keys (old checkpoints load), same weights
    torch.testing.assert_close(conv(batch(0)), ref(batch(0)), rtol=0, atol=0)

    ref_outs = train(ref, make_opt(opt_name, ref.parameters()))
    outs = train(conv, he.wrap_optimizer(make_opt(opt_name, conv.parameters()), conv))
    for o, r in zip(outs, ref_outs):
        torch.testing.assert_close(o, r, rtol=1e-6, atol=1e-6)
    assert_same_state(conv, ref)
    assert torch.equal(conv.user.weight[3], torch.zeros(D))  # the padding row got no update
    assert torch.equal(conv.towers[0].bag.weight[0], torch.zeros(D))


def test_plain_checkpoint_loads_into_the_converted_model():
    ref = Model()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(1.0)
    conv = he.convert(Model())
    conv.load_state_dict(ref.state_dict())  # strict: keys match
    torch.testing.assert_close(conv(batch(1)), ref(batch(1)), rtol=0, atol=0)
    missing, unexpected = conv.load_state_dict({**ref.state_dict(), "oops.weight": torch.zeros(1)}, strict=False)
    assert unexpected == ["oops.weight"] and missing == []
    with pytest.raises(RuntimeError, match="user.weight"):
        conv.load_state_dict({**ref.state_dict(), "user.weight": torch.zeros(3, D)})


# --- tables=: one layer made dynamic ------------------------------------------------------------
def test_dynamic_override_trains_like_the_dense_original_from_the_same_initial_rows():
    model = Model()
    dyn = {"dynamic": he.Dynamic(), "init": he.init.normal()}
    conv = he.convert(copy.deepcopy(model), tables={"user": dyn}, seed=7)
    assert conv.hybridembed.tables["user"].dynamic is not None
    assert len(conv.hybridembed.groups) == 2  # the dense tables, and the dynamic one
    # the fair reference: the dense original, its user rows replaced by the rows the dynamic
    # table makes on first sight (row-keyed init at (seed, "user", id)); the padding row stays 0
    ref = copy.deepcopy(model)
    with torch.no_grad():
        ref.user.weight.copy_(he.init.generate(he.init.normal(), 7, "user", torch.arange(20), D))
        ref.user.weight[3] = 0
    ref_outs = train(ref, make_opt("adagrad", ref.parameters()))
    outs = train(conv, he.wrap_optimizer(make_opt("adagrad", conv.parameters()), conv))
    for o, r in zip(outs, ref_outs):
        torch.testing.assert_close(o, r, rtol=1e-6, atol=1e-6)
    assert_same_state(conv, ref, skip=("user.",))
    ids, rows = conv.hybridembed.dynamic_rows("user")
    seen = torch.cat([batch(s)["user"].reshape(-1) for s in range(STEPS)]).unique()
    assert ids.tolist() == [i for i in seen.tolist() if i != 3]  # rows made on first sight; padding never
    torch.testing.assert_close(rows, ref.user.weight.detach()[ids], rtol=1e-6, atol=1e-7)
    sd = conv.state_dict()
    assert {"user.ids", "user.weight", "user.last_seen", "user.freq"} <= set(sd)
    again = he.convert(Model(), tables={"user": dyn}, seed=7)
    again.load_state_dict(sd)
    torch.testing.assert_close(again(batch(5)), conv(batch(5)), rtol=0, atol=0)


def test_copy_dynamic_rows_keeps_the_original_rows_and_trains_identically():
    model = Model()
    ref = copy.deepcopy(model)
    dyn = he.TableConfig("user_rows", None, D, dynamic=he.Dynamic(capacity=64))
    conv = he.convert(model, tables={"user": dyn}, copy_dynamic_rows=True)
    ids, rows = conv.hybridembed.dynamic_rows("user_rows")
    assert ids.tolist() == list(range(20)) and torch.equal(rows, ref.user.weight.detach())
    ref_outs = train(ref, make_opt("sgd", ref.parameters()))
    outs = train(conv, he.wrap_optimizer(make_opt("sgd", conv.parameters()), conv))
    for o, r in zip(outs, ref_outs):
        torch.testing.assert_close(o, r, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(conv.hybridembed.dynamic_rows("user_rows")[1], ref.user.weight.detach())
    # a plain (N, D) weight loads into the dynamic layer as ids 0..N-1
    fresh = he.convert(Model(), tables={"user": {"dynamic": he.Dynamic()}})
    fresh.load_state_dict(ref.state_dict())
    torch.testing.assert_close(fresh(batch(6)), ref(batch(6)), rtol=0, atol=0)


def test_table_overrides_name_optimizer_and_dtype():
    conv = he.convert(
        Model(),
        tables={
            "towers.1.shared": {"name": "video", "optimizer": he.optim.SGD(lr=0.5)},  # any path of a shared layer
            "heads.ctx": {"dtype": torch.float64},
        },
    )
    ec = conv.hybridembed
    assert "video" in ec.tables and ec.tables["video"].optimizer == he.optim.SGD(lr=0.5)
    assert sorted(map(sorted, ec.groups)) == [
        ["heads__ctx"],
        ["heads__geo", "items", "towers__0__bag", "towers__1__bag", "user"],
        ["video"],
    ]
    opt = he.wrap_optimizer(torch.optim.Adagrad(conv.parameters(), lr=0.1), conv)
    assert opt.sparse_optimizers()["video"].name == "SGD" and opt.sparse_optimizers()["user"].name == "Adagrad"
    out = conv.heads["ctx"](torch.tensor([1, 2]))
    assert out.dtype == torch.float32  # the layer's output dtype is kept


def test_none_override_keeps_a_layer_and_refused_settings_can_be_kept_that_way():
    model = nn.Module()
    model.emb = nn.Embedding(5, 2, max_norm=1.0)
    model.other = nn.Embedding(5, 2)
    conv = he.convert(model, tables={"emb": None})
    assert type(conv.emb) is nn.Embedding and isinstance(conv.other, HybridEmbedding)


# --- refusals ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "layer, words",
    [
        (lambda: nn.Embedding(5, 2, max_norm=1.0), "max_norm=1.0"),
        (lambda: nn.Embedding(5, 2, scale_grad_by_freq=True), "scale_grad_by_freq"),
        (lambda: nn.EmbeddingBag(5, 2, mode="max"), "mode='max'"),
        (lambda: nn.EmbeddingBag(5, 2, max_norm=2.0), "max_norm=2.0"),
        (lambda: nn.Embedding.from_pretrained(torch.zeros(5, 2)), "frozen"),
    ],
)
def test_settings_without_a_sparse_equivalent_are_refused_naming_the_layer(layer, words):
    model = nn.Module()
    model.enc = nn.Sequential(nn.Linear(2, 2), layer())
    with pytest.raises(he.ConfigError, match="'enc.1'") as e:
        he.convert(model)
    assert words in str(e.value) and "tables={'enc.1': None}" in str(e.value)
    assert isinstance(model.enc[1], (nn.Embedding, nn.EmbeddingBag))  # nothing was replaced


def test_tied_weights_subclassed_forward_and_unknown_paths_are_refused():
    tied = nn.Module()
    tied.emb = nn.Embedding(5, 2)
    tied.out = nn.Linear(2, 5, bias=False)
    tied.out.weight = tied.emb.weight
    with pytest.raises(he.ConfigError, match=r"'emb'.*'out.weight'"):
        he.convert(tied)

    class Scaled(nn.Embedding):
        def forward(self, x):
            return super().forward(x) * 2

    own = nn.Module()
    own.emb = Scaled(5, 2)
    with pytest.raises(he.ConfigError, match="'emb'.*own forward"):
        he.convert(own)
    with pytest.raises(he.ConfigError, match="'usr'.*'user'"):
        he.convert(Model(), tables={"usr": {"dynamic": he.Dynamic()}})
    with pytest.raises(he.ConfigError, match="cannot override embedding_dim"):
        he.convert(Model(), tables={"user": {"embedding_dim": 8}})
    with pytest.raises(he.ConfigError, match="different overrides"):
        he.convert(Model(), tables={"towers.0.shared": {"name": "a"}, "towers.1.shared": {"name": "b"}})


def test_mean_bag_refuses_per_sample_weights_as_torch_does():
    model = nn.Module()
    model.bag = nn.EmbeddingBag(5, 2, mode="mean")
    conv = he.convert(model)
    with pytest.raises(he.InvalidInputError, match="mode='sum'"):
        conv.bag(torch.tensor([[1, 2]]), per_sample_weights=torch.ones(1, 2))


# --- forward signatures, on random inputs ------------------------------------------------------------
@given(
    shape=st.lists(st.integers(0, 3), min_size=0, max_size=3),
    pad=st.sampled_from([None, 0, 4]),
    seed=st.integers(0, 2**16),
)
def test_embedding_forward_matches_any_id_shape(shape, pad, seed):
    g = torch.Generator().manual_seed(seed)
    model = nn.Module()
    model.emb = nn.Embedding(6, 3, padding_idx=pad)
    ids = torch.randint(0, 6, tuple(shape), generator=g)
    expected = model.emb(ids)
    conv = he.convert(model)
    got = conv.emb(ids)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@given(
    lengths=st.lists(st.integers(0, 4), min_size=1, max_size=5),
    mode=st.sampled_from(["sum", "mean"]),
    pad=st.sampled_from([None, 1]),
    last=st.booleans(),
    weighted=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_embedding_bag_forward_matches_with_offsets(lengths, mode, pad, last, weighted, seed):
    g = torch.Generator().manual_seed(seed)
    bag = nn.EmbeddingBag(6, 3, mode=mode, padding_idx=pad, include_last_offset=last)
    n = sum(lengths)
    ids = torch.randint(0, 6, (n,), generator=g)
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    offsets = offsets if last else offsets[:-1]
    psw = torch.rand(n, generator=g) if weighted and mode == "sum" else None
    expected = bag(ids, offsets, psw)
    conv = he.convert(bag)  # the model is the layer itself: the returned module replaces it
    assert isinstance(conv, HybridEmbeddingBag)
    torch.testing.assert_close(conv(ids, offsets, psw), expected, rtol=1e-6, atol=1e-7)
    two_d = torch.randint(0, 6, (len(lengths), 3), generator=g)
    torch.testing.assert_close(conv(two_d), bag(two_d), rtol=1e-6, atol=1e-7)


def test_containers_as_the_root_keep_iterating_their_layers():
    seq = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    ids = torch.tensor([1, 2, 3])
    expected = seq(ids)
    conv = he.convert(seq)
    assert len(conv) == 2 and isinstance(conv[0], HybridEmbedding)
    torch.testing.assert_close(conv(ids), expected, rtol=0, atol=0)  # the collection is not run as a layer
    assert sorted(conv.state_dict()) == ["0.weight", "1.bias", "1.weight"]
    before = conv[0].weight.clone()
    opt = he.wrap_optimizer(torch.optim.Adagrad(conv.parameters(), lr=0.1), conv)
    conv(ids).sum().backward()
    opt.step()
    changed = (conv[0].weight != before).any(1)
    assert changed.nonzero().squeeze(1).tolist() == [1, 2, 3]


def test_bad_ids_raise_before_any_row_changes():
    conv = he.convert(Model())
    with pytest.raises(he.InvalidInputError, match="user.*out of range"):
        conv.user(torch.tensor([[1, 25]]))
    with pytest.raises(he.InvalidInputError, match="towers__0__bag"):
        conv.towers[0].bag(torch.tensor([[1, -2]]))


def test_convert_refuses_tables_that_are_not_a_mapping():
    with pytest.raises(he.ConfigError, match="mapping"):
        he.convert(nn.Sequential(nn.Embedding(3, 2)), tables=[("0", None)])


def test_module_apply_on_a_converted_model_visits_every_layer():
    model = he.convert(Model())

    @torch.no_grad()
    def init_fn(m):
        if isinstance(m, nn.Linear):
            m.weight.fill_(0.5)

    assert model.apply(init_fn) is model
    assert all(bool((m.weight == 0.5).all()) for m in model.modules() if isinstance(m, nn.Linear))
    seen = []
    model.apply(seen.append)
    assert any(isinstance(m, HybridEmbeddingBag) for m in seen) and any(
        isinstance(m, he.EmbeddingCollection) for m in seen
    )


@pytest.mark.parametrize("bad", ["cuda:0", None, [1, 2, 3], 7])
def test_a_bag_layer_refuses_input_that_is_not_a_tensor_as_the_embedding_layer_does(bad):
    """It raised AttributeError ('str' object has no attribute 'device'): at world 2 the bad rank's
    loop, skipping ValueErrors, stopped, and every other rank with it (benchmarks/fuzz_faults.py)."""
    model = he.convert(nn.ModuleDict({"bag": nn.EmbeddingBag(10, D, mode="sum"), "emb": nn.Embedding(10, D)}))
    with pytest.raises(he.InvalidInputError, match="table 'bag': input must be a tensor of ids, got"):
        model["bag"](bad, torch.tensor([0, 1]))
    with pytest.raises(he.InvalidInputError, match="table 'bag': input must be a tensor of ids, got"):
        model["bag"](bad, torch.tensor([0, 1]), torch.ones(3))
    with pytest.raises(he.InvalidInputError, match="table 'emb': input must be a tensor of ids, got"):
        model["emb"](bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool])
def test_a_bag_layer_refuses_offsets_that_are_not_integers_as_torch_does(dtype):
    """They were cast to int64: offsets [0, 1.5] read as [0, 1], a silently different batch (found
    by benchmarks/fuzz_faults.py: one process accepted what torch's nn.EmbeddingBag refuses)."""
    model = he.convert(nn.Sequential(nn.EmbeddingBag(10, D, mode="sum")))
    with pytest.raises(he.InvalidInputError, match=f"offsets must be integers, got dtype {dtype}"):
        model[0](torch.tensor([1, 2, 3]), torch.tensor([0, 1.5]).to(dtype))
    assert model[0](torch.tensor([1, 2, 3]), torch.tensor([0, 1], dtype=torch.int32)).shape == (2, D)


@pytest.mark.parametrize("padded", [False, True])
def test_per_sample_weights_on_another_device_are_refused_before_any_row_changes(padded):
    model = he.convert(nn.Sequential(nn.EmbeddingBag(10, D, mode="sum", padding_idx=0 if padded else None)))
    before = copy.deepcopy(model.state_dict())
    ids, offsets = torch.tensor([1, 2, 0, 3]), torch.tensor([0, 2])
    with pytest.raises(he.InvalidInputError, match="meta"):
        model[0](ids, offsets, torch.ones(4, device="meta"))
    with pytest.raises(he.InvalidInputError, match="floating"):
        model[0](ids, offsets, torch.ones(4, dtype=torch.int64))
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
