"""``he.export``: TorchScript and ONNX files that serve without hybridembed.

A small ranking model (shared dense table, weighted mean and sqrtn bags, a sequence
feature, a trained dynamic table, an MLP) is exported in both formats, then loaded in a
subprocess where ``import hybridembed`` fails; its outputs on other batch sizes and
hotnesses, with ids the dynamic table never saw, equal the trained model's in eval mode.

    python -m pytest -q tests/api/test_export.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten as pytree_flatten

import hybridembed as he
from hybridembed.api.export import _count_below

# torch 2.13 deprecates TorchScript; he.export's torchscript format still uses it, on purpose
pytestmark = pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")

D = 4
DEFAULT = 0.25  # the dynamic table's default vector
TOL = dict(rtol=1e-5, atol=1e-5)


class Ranker(nn.Module):
    """EC + MLP; forward takes a dict of sparse features and a dense tensor."""

    def __init__(self):
        super().__init__()
        self.ec = he.EmbeddingCollection(
            [
                he.TableConfig("video", 40, D),
                he.TableConfig("user", 30, D, combiner="mean"),
                he.TableConfig("query", 25, D, combiner="sqrtn", dtype=torch.float64),
                he.TableConfig("hist", 20, D, combiner="none"),
                he.TableConfig("item", None, D, dynamic=he.Dynamic(default_value=DEFAULT)),
            ],
            features={
                "watched": "video",
                "browsed": "video",
                "user": "user",
                "query": "query",
                "hist": "hist",
                "item": "item",
            },
            sequence_output="padded",
            seed=3,
        )
        self.mlp = nn.Sequential(nn.Linear(6 * D + 2, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, batch: dict, dense: torch.Tensor) -> dict[str, torch.Tensor]:
        e = self.ec(batch)
        pooled = [e["watched"], e["browsed"], e["user"], e["query"].float(), e["hist"].sum(1), e["item"]]
        return {"score": self.mlp(torch.cat(pooled + [dense], 1)).squeeze(1), "hist": e["hist"]}


def padded(b: int, h: int, high: int, pad_frac: float = 0.3, right: bool = False) -> torch.Tensor:
    """(b, h) ids in [0, high) with -1 pads (anywhere, or only trailing with ``right``)."""
    ids = torch.randint(0, high, (b, h))
    if right:
        lengths = torch.randint(0, h + 1, (b,))
        lengths[0] = h  # the longest bag fills H, so the trained model's T equals H
        return torch.where(torch.arange(h) < lengths.unsqueeze(1), ids, -1)
    return torch.where(torch.rand(b, h) < pad_frac, -1, ids)


def make_batch(b: int, h: int, item_ids: torch.Tensor | None = None) -> tuple[dict, torch.Tensor, dict]:
    """(model batch with weighted Jagged features, dense (b, 2), served batch with padded ids + weights)."""
    user, query = padded(b, h, 30), padded(b, h, 25)
    user_w, query_w = torch.rand(b, h) + 0.1, torch.rand(b, h) * 2
    query_w[0] = 0.0  # a bag whose weights sum to 0 pools to 0
    user[-1] = -1  # an empty bag
    if item_ids is None:
        item = padded(b, h, 12)
    else:  # known ids, unknown ids (the default vector), negative ids, padding
        pool = torch.cat([item_ids, torch.tensor([10**12, -5, -(2**40), 999])])
        item = torch.where(torch.rand(b, h) < 0.2, -1, pool[torch.randint(0, pool.numel(), (b, h))])
    served = {
        "watched": padded(b, h, 40),
        "browsed": torch.randint(0, 40, (b,)),  # one id per sample
        "user": user,
        "user:weights": user_w,
        "query": query,
        "query:weights": query_w,
        "hist": padded(b, h, 20, right=True),
        "item": item,
    }
    model_batch = {k: v for k, v in served.items() if ":" not in k}
    model_batch["user"] = he.Jagged.from_dense(user, weights=user_w)
    model_batch["query"] = he.Jagged.from_dense(query, weights=query_w)
    return model_batch, torch.randn(b, 2), served


@pytest.fixture(scope="module")
def trained() -> Ranker:
    torch.manual_seed(0)
    model = Ranker()
    opt = he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model)
    for _ in range(3):
        batch, dense, _ = make_batch(8, 3)
        out = model(batch, dense)
        (out["score"].sum() + out["hist"].sum()).backward()
        opt.step()
        opt.zero_grad()
    return model


def reference(model: nn.Module, batch: dict, dense: torch.Tensor) -> dict[str, torch.Tensor]:
    model.eval()
    try:
        with torch.no_grad():
            return model(batch, dense)
    finally:
        model.train()


def run_without_hybridembed(code: str, tmp_path) -> dict:
    """Run ``code`` in a fresh interpreter where ``import hybridembed`` fails; it leaves
    its results in ``out`` (saved with torch.save)."""
    prog = (
        textwrap.dedent(
            """
        import sys
        sys.modules["hybridembed"] = None  # any import of hybridembed now fails
        import torch
        try:
            import hybridembed
        except ImportError:
            pass
        else:
            raise SystemExit("hybridembed is importable")
        out = {}
        """
        )
        + textwrap.dedent(code)
        + f"\ntorch.save(out, {str(tmp_path / 'out.pt')!r})\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(
        [sys.executable, "-c", prog], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(tmp_path / "out.pt")


def assert_outputs(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k].to(want[k].dtype), want[k], **TOL)


# --- the main path -----------------------------------------------------------------------------
def test_torchscript_and_onnx_serve_without_hybridembed(trained, tmp_path):
    pytest.importorskip("onnxscript")
    pytest.importorskip("onnxruntime")
    item_ids, _ = trained.ec.dynamic_rows("item")
    assert item_ids.numel() > 0
    rows_before = item_ids.numel()

    example_batch, example_dense, _ = make_batch(4, 3, item_ids)
    assert he.export(trained, tmp_path / "m.pt", (example_batch, example_dense)) == tmp_path / "m.pt"
    he.export(trained, tmp_path / "m.onnx", (example_batch, example_dense), format="onnx")
    assert sorted(f.name for f in tmp_path.iterdir()) == ["m.onnx", "m.pt"]  # no temporary left
    assert trained.training and trained.ec.training  # the model is left as it was
    assert trained.ec.dynamic_rows("item")[0].numel() == rows_before  # no rows made by the export

    # other batch sizes and hotnesses than the example's (4, 3), unknown ids in the dynamic table
    cases = [make_batch(b, h, item_ids) for b, h in ((7, 5), (2, 1), (3, 2))]
    torch.save([(served, dense) for _, dense, served in cases], tmp_path / "inputs.pt")
    got = run_without_hybridembed(
        """
        import onnxruntime as ort
        ts = torch.jit.load("m.pt")
        sess = ort.InferenceSession("m.onnx", providers=["CPUExecutionProvider"])
        out["onnx_inputs"] = [i.name for i in sess.get_inputs()]
        out["onnx_outputs"] = [o.name for o in sess.get_outputs()]
        out["ts"], out["onnx"] = [], []
        for batch, dense in torch.load("inputs.pt"):
            out["ts"].append(ts(batch, dense))
            feeds = {"batch." + k: v.numpy() for k, v in batch.items()}
            feeds["dense"] = dense.numpy()
            score, hist = sess.run(["output.score", "output.hist"], feeds)
            out["onnx"].append({"score": torch.from_numpy(score), "hist": torch.from_numpy(hist)})
        """,
        tmp_path,
    )
    assert got["onnx_inputs"] == [
        "batch.watched",
        "batch.browsed",
        "batch.user",
        "batch.user:weights",
        "batch.query",
        "batch.query:weights",
        "batch.hist",
        "batch.item",
        "dense",
    ]
    assert got["onnx_outputs"] == ["output.score", "output.hist"]
    for (model_batch, dense, _), ts_out, onnx_out in zip(cases, got["ts"], got["onnx"]):
        want = reference(trained, model_batch, dense)
        assert_outputs(ts_out, want)
        assert_outputs(onnx_out, want)

    # the reference reads the default vector for the unknown ids the cases hold
    model_batch = cases[0][0]
    assert not torch.isin(model_batch["item"], item_ids).all()
    unknown = torch.full_like(model_batch["item"], 10**12)
    with torch.no_grad():
        pooled = trained.ec.eval()({**model_batch, "item": unknown})["item"]  # (B, D)
    trained.ec.train()
    torch.testing.assert_close(pooled, torch.full_like(pooled, DEFAULT * unknown.shape[1]))


@pytest.mark.parametrize("name", ["m.pt2", "m.bin"])  # (pt2: the default, and any suffix not another format's)
def test_pt2_serves_without_hybridembed_through_torch_export_load(trained, tmp_path, name):
    item_ids, _ = trained.ec.dynamic_rows("item")
    example_batch, example_dense, _ = make_batch(4, 3, item_ids)
    he.export(trained, tmp_path / name, (example_batch, example_dense))
    cases = [make_batch(b, h, item_ids) for b, h in ((7, 5), (2, 1), (3, 2))]
    torch.save([(served, dense) for _, dense, served in cases], tmp_path / "inputs.pt")
    got = run_without_hybridembed(
        f"""
        program = torch.export.load({name!r}).module()
        out["pt2"] = [program(batch, dense) for batch, dense in torch.load("inputs.pt")]
        """,
        tmp_path,
    )
    for (model_batch, dense, _), out in zip(cases, got["pt2"]):
        assert_outputs(out, reference(trained, model_batch, dense))


def test_served_collection_matches_the_collection_in_process(trained, tmp_path):
    """The plain-torch twin, eager and traced, on inputs with pads anywhere in a row."""
    item_ids, _ = trained.ec.dynamic_rows("item")
    model_batch, dense, served = make_batch(6, 4, item_ids)
    path = he.export(trained.ec, tmp_path / "ec.pt", model_batch)  # the collection alone: a dict out
    loaded = torch.jit.load(str(path))
    want = reference_ec(trained.ec, model_batch)
    got = loaded(served)
    assert list(got) == list(want)  # the collection's feature order
    assert_outputs(got, want)
    # a batch of another size, with the sequence feature padded beyond its longest row
    model_batch, dense, served = make_batch(9, 2, item_ids)
    served["hist"] = torch.cat([served["hist"], torch.full((9, 2), -1)], 1)  # (9, 4), T = 2
    got, want = loaded(served), reference_ec(trained.ec, model_batch)
    assert got["hist"].shape == (9, 4, D) and not got["hist"][:, 2:].any()
    got["hist"] = got["hist"][:, :2]
    assert_outputs(got, want)


def reference_ec(ec, batch):
    ec.eval()
    try:
        with torch.no_grad():
            return ec(batch)
    finally:
        ec.train()


def test_empty_and_half_precision_tables(tmp_path):
    """A dynamic table with no rows serves its default vector; float16 rows pool in float32;
    a Jagged sequence output is served padded."""
    ec = he.EmbeddingCollection(
        [
            he.TableConfig("dyn", None, 3, combiner="mean", dynamic=he.Dynamic(default_value=-1.5)),
            he.TableConfig("half", 10, 3, dtype=torch.float16),
            he.TableConfig("seq", 10, 3, combiner="none"),
        ]
    )
    batch = {
        "dyn": torch.tensor([[5, 7], [-1, -1], [8, -1]]),
        "half": he.Jagged.from_lists([[1, 2, 3], [], [4]]),
        "seq": he.Jagged.from_lists([[1, 2], [3], []]),
    }
    path = he.export(ec, tmp_path / "ec.pt", batch)
    got = torch.jit.load(str(path))(
        {
            "dyn": torch.tensor([[1, 2], [3, -1], [-1, -1]]),
            "half": torch.tensor([[1, 2, 3], [-1, -1, -1]]),
            "seq": torch.tensor([[1, 2], [3, -1]]),
        }
    )
    torch.testing.assert_close(got["dyn"], torch.tensor([[-1.5] * 3, [-1.5] * 3, [0.0] * 3]))
    w = ec.weight("half").float()
    assert got["half"].dtype == torch.float32
    torch.testing.assert_close(got["half"], torch.stack([w[1] + w[2] + w[3], torch.zeros(3)]), **TOL)
    s = ec.weight("seq")
    torch.testing.assert_close(got["seq"], torch.stack([s[[1, 2]], torch.stack([s[3], torch.zeros(3)])]))


@pytest.mark.skipif(not hasattr(he.EmbeddingCollection, "lookup"), reason="no EmbeddingCollection.lookup")
def test_a_model_that_looks_up_one_feature(tmp_path):
    class OneFeature(nn.Module):
        def __init__(self):
            super().__init__()
            self.ec = small_ec()

        def forward(self, a: torch.Tensor) -> torch.Tensor:
            return 2 * self.ec.lookup("a", a)

    model = OneFeature()
    path = he.export(model, tmp_path / "m.pt", torch.tensor([[1, 2], [3, -1]]))
    x = torch.tensor([[4, -1, 5], [6, 7, 8], [-1, -1, -1]])
    torch.testing.assert_close(torch.jit.load(str(path))(x), reference_ec(model, x), **TOL)


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 100])
def test_binary_search_counts_keys_below(k):
    keys = torch.sort(torch.randperm(1000)[:k] * 7 - 3000).values  # distinct, negative ones too
    q = torch.cat([keys, keys - 1, keys + 1, torch.tensor([-(2**62), 2**62, 0])]).reshape(1, -1)
    assert torch.equal(_count_below(keys, k, q), torch.searchsorted(keys, q))


# --- errors -------------------------------------------------------------------------------------------
def small_ec():
    return he.EmbeddingCollection([he.TableConfig("a", 10, 2, combiner="mean")])


def test_unknown_format_lists_the_formats(tmp_path):
    with pytest.raises(he.ConfigError, match=r"'tflite'.*torchscript, onnx"):
        he.export(small_ec(), tmp_path / "m", {"a": torch.tensor([[1]])}, format="tflite")


def test_missing_directory_and_directory_path(tmp_path):
    with pytest.raises(he.ConfigError, match="does not exist; create it"):
        he.export(small_ec(), tmp_path / "nowhere" / "m.pt", {"a": torch.tensor([[1, 2]])})
    with pytest.raises(he.ConfigError, match="is a directory"):
        he.export(small_ec(), tmp_path, {"a": torch.tensor([[1, 2]])})
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize(
    "example, match",
    [
        ("a string", "got str; example_inputs must be"),
        ({"a": [[1, 2], [3]]}, r"\['a'\]\[0\]: python lists of ids cannot be served"),
        ({"a": 3}, r"\['a'\]: got int"),
        (
            {"a": torch.sparse_coo_tensor([[0], [1]], [4], (2, 2), check_invariants=True)},
            "sparse_coo tensor cannot be served",
        ),
        ({"a": (torch.tensor([1, 2]), torch.tensor([0, 1, 2]))}, "'a': the served model takes padded ids"),
        ({"a": he.Jagged.from_lists([[1], [2]], [[1.0], [2.0]])}, None),  # fine: weights become 'a:weights'
    ],
)
def test_bad_example_inputs_say_what_to_give(tmp_path, example, match):
    path = tmp_path / "m.pt"
    if match is None:
        he.export(small_ec(), path, example)
        assert path.exists()
        return
    with pytest.raises(he.InvalidInputError, match=match):
        he.export(small_ec(), path, example)
    assert not path.exists()


def test_not_a_module_and_a_model_that_drops_the_weights(tmp_path):
    with pytest.raises(he.ConfigError, match="must be a torch.nn.Module"):
        he.export(lambda x: x, tmp_path / "m.pt", torch.zeros(1))

    class KeepsIds(nn.Module):  # rebuilds the features dict, so the served weights never arrive
        def __init__(self):
            super().__init__()
            self.ec = small_ec()

        def forward(self, batch):
            return self.ec({"a": batch["a"]})["a"]

    example = {"a": he.Jagged.from_lists([[1, 2], [3]], [[1.0, 3.0], [2.0]])}
    with pytest.raises(he.HybridEmbedError, match=r"differs from the model's.*check=False"):
        he.export(KeepsIds(), tmp_path / "m.pt", example)
    assert not (tmp_path / "m.pt").exists()


# --- export leaves the live model as it was ----------------------------------------------------------
class PlainNet(nn.Module):
    """A plain torch model for he.convert: an Embedding with padding_idx, a mean bag of (B, L)
    ids with padding_idx, a weighted sum bag of (N,) ids and offsets, and one layer made dynamic."""

    def __init__(self):
        super().__init__()
        self.user = nn.Embedding(30, D, padding_idx=0)
        self.items = nn.EmbeddingBag(20, D, mode="mean", padding_idx=1)
        self.tags = nn.EmbeddingBag(15, D, mode="sum")
        self.seen = nn.Embedding(1000, D)
        self.mlp = nn.Linear(4 * D, 1)

    def forward(self, user, items, tags, tag_offsets, tag_weights):
        tag = self.tags(tags, tag_offsets, per_sample_weights=tag_weights)
        x = torch.cat([self.user(user), self.items(items), tag, self.seen(user * 31 + 7)], 1)
        return self.mlp(x).squeeze(1)


class ECNet(nn.Module):
    """An EmbeddingCollection (dense, weighted mean, dynamic) and a linear layer."""

    def __init__(self):
        super().__init__()
        self.ec = he.EmbeddingCollection(
            [
                he.TableConfig("a", 30, D),
                he.TableConfig("b", 20, D, combiner="mean"),
                he.TableConfig("c", None, D, dynamic=he.Dynamic()),
            ],
            seed=5,
        )
        self.mlp = nn.Linear(3 * D, 1)

    def forward(self, batch):
        e = self.ec(batch)
        return self.mlp(torch.cat([e["a"], e["b"], e["c"]], 1)).squeeze(1)


def plain_inputs(step: int, b: int = 4, h: int = 3) -> tuple:
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 4, (b,), generator=g)
    lengths[1] = 0  # an empty bag
    n = int(lengths.sum())
    return (
        torch.randint(0, 30, (b,), generator=g),  # user; 0 is padding
        torch.randint(0, 20, (b, h), generator=g),  # items; 1 is padding
        torch.randint(0, 15, (n,), generator=g),  # tags, in bags starting at
        torch.cumsum(lengths, 0) - lengths,  # (B,) offsets
        torch.rand(n, generator=g),
    )


def ec_inputs(step: int) -> tuple:
    g = torch.Generator().manual_seed(step)
    return (
        {
            "a": torch.randint(-1, 30, (4, 2), generator=g),
            "b": torch.randint(-1, 20, (4, 3), generator=g),
            "c": torch.randint(0, 10**9, (4, 2), generator=g),
        },
    )


def twin(kind: str, opt_name: str):
    torch.manual_seed(1)
    if kind == "converted":
        model = he.convert(PlainNet(), tables={"seen": {"dynamic": he.Dynamic()}}, seed=2)
    else:
        model = ECNet()
    opt_cls = torch.optim.SGD if opt_name == "sgd" else torch.optim.Adagrad
    return model, he.wrap_optimizer(opt_cls(model.parameters(), lr=0.1), model)


def train_steps(model, opt, inputs, steps):
    for s in steps:
        opt.zero_grad()
        (model(*inputs(s)) ** 2).sum().backward()
        opt.step()


@pytest.mark.parametrize("fmt", ["torchscript", "onnx"])
@pytest.mark.parametrize("kind, opt_name", [("converted", "adagrad"), ("converted", "sgd"), ("ec", "adagrad")])
def test_export_leaves_the_live_model_training_as_before(kind, opt_name, fmt, tmp_path):
    if fmt == "onnx":
        pytest.importorskip("onnxscript")
    inputs = plain_inputs if kind == "converted" else ec_inputs
    model, opt = twin(kind, opt_name)
    other, other_opt = twin(kind, opt_name)  # never exported
    train_steps(model, opt, inputs, range(3))
    train_steps(other, other_opt, inputs, range(3))
    he.export(model, tmp_path / "m", inputs(100), format=fmt)  # ids the dynamic tables never saw
    assert model.training
    train_steps(model, opt, inputs, range(3, 6))
    train_steps(other, other_opt, inputs, range(3, 6))
    a, b = model.state_dict(), other.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sa, sb = opt.state_dict(), other_opt.state_dict()
    flat_a, spec_a = pytree_flatten(sa)
    flat_b, spec_b = pytree_flatten(sb)
    assert spec_a == spec_b
    for x, y in zip(flat_a, flat_b):
        assert torch.equal(x, y) if torch.is_tensor(x) else x == y


@pytest.mark.parametrize("fmt", ["torchscript", "onnx"])
def test_a_converted_model_serves_other_batch_sizes(fmt, tmp_path):
    if fmt == "onnx":
        ort = pytest.importorskip("onnxruntime")
        pytest.importorskip("onnxscript")
    model, opt = twin("converted", "adagrad")
    train_steps(model, opt, plain_inputs, range(3))
    path = he.export(model, tmp_path / "m", plain_inputs(100), format=fmt)
    for b, h in [(2, 1), (9, 5)]:
        x = plain_inputs(200 + b, b, h)
        model.eval()
        with torch.no_grad():
            want = model(*x)
        model.train()
        if fmt == "torchscript":
            got = torch.jit.load(str(path))(*x)
        else:
            s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            got = torch.from_numpy(s.run(None, {i.name: t.numpy() for i, t in zip(s.get_inputs(), x)})[0])
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("kind", ["converted", "ec"])
def test_out_of_range_example_ids_are_refused_by_the_models_validation(kind, tmp_path):
    model, opt = twin(kind, "sgd")
    train_steps(model, opt, plain_inputs if kind == "converted" else ec_inputs, range(2))
    if kind == "converted":
        bad = list(plain_inputs(100))
        bad[0] = torch.tensor([1, 2, 30, 4])  # the user table has rows 0..29
        feature = "user"
    else:
        (bad,) = ec_inputs(100)
        bad = (dict(bad, a=torch.tensor([[1, 2], [30, -1], [3, 4], [5, 6]])),)
        feature = "'a'"
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(he.InvalidInputError, match=f"{feature}.*30"):
        he.export(model, tmp_path / "m.pt", tuple(bad))
    assert not (tmp_path / "m.pt").exists()
    assert model.training and all(m.training for m in model.modules())
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
