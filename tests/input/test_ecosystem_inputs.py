"""Inputs from the rest of the ecosystem: TorchRec's KeyedJaggedTensor and JaggedTensor (duck-typed,
no TorchRec dependency), ``torch.nested`` jagged tensors, and TorchRec's table configs, each checked
against the same lookup through :class:`he.Jagged`."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import hybridembed as he
from hybridembed.input import as_feature_inputs

TABLES = [he.TableConfig("t", 50, 4, combiner="mean"), he.TableConfig("u", 30, 4)]
FEATURES = {"a": "t", "b": "t", "c": "u"}


class FakeKJT:
    """The part of TorchRec's KeyedJaggedTensor hybridembed reads (the tests run without TorchRec)."""

    def __init__(self, keys, values, lengths, weights=None):
        self._keys, self._values, self._lengths, self._weights = keys, values, lengths, weights

    def keys(self):
        return self._keys

    def values(self):
        return self._values

    def lengths(self):
        return self._lengths

    def weights_or_none(self):
        return self._weights

    def stride(self):
        return self._lengths.numel() // len(self._keys)

    def length_per_key(self):
        return [int(x.sum()) for x in self._lengths.split(self.stride())]

    def variable_stride_per_key(self):
        return False


def _batch(seed, batch=5):
    g = torch.Generator().manual_seed(seed)
    lengths = {f: torch.randint(0, 4, (batch,), generator=g) for f in FEATURES}
    hi = {"a": 50, "b": 50, "c": 30}
    values = {f: torch.randint(0, hi[f], (int(n.sum()),), generator=g) for f, n in lengths.items()}
    weights = {f: torch.rand(int(n.sum()), generator=g) for f, n in lengths.items()}
    return lengths, values, weights


def _reference(ec, lengths, values, weights=None):
    w = weights or {}
    return ec({f: he.Jagged.from_lengths(values[f], lengths[f], w.get(f)) for f in FEATURES})


@pytest.mark.parametrize("weighted", [False, True])
def test_a_keyed_jagged_tensor_equals_the_jagged_inputs(weighted):
    ec = he.EmbeddingCollection(TABLES, FEATURES, seed=1)
    lengths, values, weights = _batch(0)
    keys = list(FEATURES)
    kjt = FakeKJT(
        keys,
        torch.cat([values[f] for f in keys]),
        torch.cat([lengths[f] for f in keys]),
        torch.cat([weights[f] for f in keys]) if weighted else None,
    )
    got, want = ec(kjt), _reference(ec, lengths, values, weights if weighted else None)
    for f in FEATURES:
        torch.testing.assert_close(got[f], want[f])


def test_a_real_torchrec_keyed_jagged_tensor_and_jagged_tensor():
    jt_mod = pytest.importorskip("torchrec.sparse.jagged_tensor")
    ec = he.EmbeddingCollection(TABLES, FEATURES, seed=1)
    lengths, values, _ = _batch(1)
    keys = list(FEATURES)
    kjt = jt_mod.KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.cat([values[f] for f in keys]), lengths=torch.cat([lengths[f] for f in keys])
    )
    want = _reference(ec, lengths, values)
    got = ec(kjt)
    per_key = ec({f: kjt[f] for f in keys})  # JaggedTensors, one per feature
    for f in FEATURES:
        torch.testing.assert_close(got[f], want[f])
        torch.testing.assert_close(per_key[f], want[f])


def test_torch_nested_jagged_tensors_equal_the_jagged_inputs():
    ec = he.EmbeddingCollection(TABLES, FEATURES, seed=1)
    lengths, values, _ = _batch(2)
    nested = {
        f: torch.nested.nested_tensor(list(values[f].split(lengths[f].tolist())), layout=torch.jagged) for f in FEATURES
    }
    got, want = ec(nested), _reference(ec, lengths, values)
    for f in FEATURES:
        torch.testing.assert_close(got[f], want[f])


def test_malformed_ecosystem_inputs_are_refused_clearly():
    ec = he.EmbeddingCollection(TABLES, FEATURES, seed=1)
    bad = FakeKJT(["a", "b", "c"], torch.arange(4), torch.tensor([1, 1, 1, 1, 0]))  # 5 lengths for 3 keys
    with pytest.raises(he.InvalidInputError, match="needs .* lengths"):
        ec(bad)
    short = FakeKJT(["a", "b", "c"], torch.arange(2), torch.tensor([1, 1, 1]))  # 3 lengths, 2 values
    with pytest.raises(he.InvalidInputError, match="lengths sum to 3"):
        ec(short)
    twice = FakeKJT(["a", "a", "c"], torch.arange(3), torch.tensor([1, 1, 1]))
    with pytest.raises(he.InvalidInputError, match="names feature 'a' twice"):
        ec(twice)
    missing = FakeKJT(["a", "b"], torch.arange(2), torch.tensor([1, 1]))
    with pytest.raises(he.InvalidInputError, match="missing feature 'c'"):
        ec(missing)
    strided = torch.nested.nested_tensor([torch.tensor([1, 2]), torch.tensor([3])])  # layout=torch.strided
    with pytest.raises(he.InvalidInputError, match="layout=torch.jagged"):
        ec({"a": strided, "b": [[1]], "c": [[1]]})
    out_of_range = torch.nested.nested_tensor([torch.tensor([1, 99])], layout=torch.jagged)
    with pytest.raises(he.InvalidInputError, match="feature 'a'"):
        ec({"a": out_of_range, "b": [[1]], "c": [[1]]})
    assert as_feature_inputs({"a": 1}) == {"a": 1}  # (a mapping passes through untouched)


def test_torchrec_table_configs_convert():
    pooling = SimpleNamespace(value="MEAN")
    configs = [
        SimpleNamespace(name="t", num_embeddings=100, embedding_dim=8, feature_names=["a", "b"], pooling=pooling),
        SimpleNamespace(
            name="u",
            num_embeddings=10,
            embedding_dim=4,
            feature_names=["c"],
            weight_init_min=-0.5,
            weight_init_max=0.5,
            data_type=SimpleNamespace(value="FP16"),
        ),
    ]
    tables, features = he.tables_from_torchrec(configs)
    assert features == {"a": "t", "b": "t", "c": "u"}
    t, u = tables
    assert (t.num_embeddings, t.embedding_dim, t.combiner, t.dtype) == (100, 8, "mean", torch.float32)
    assert (t.init.kind, t.init.low, t.init.high) == ("uniform", -0.1, 0.1)  # TorchRec's sqrt(1 / rows)
    assert (u.combiner, u.dtype, u.init.low, u.init.high) == ("none", torch.float16, -0.5, 0.5)
    ec = he.EmbeddingCollection(tables, features)
    assert ec({"a": [[1, 2]], "b": [[3]], "c": torch.tensor([4])})["a"].shape == (1, 8)
    with pytest.raises(he.ConfigError, match="not a TorchRec table config"):
        he.tables_from_torchrec([SimpleNamespace(name="x")])
    with pytest.raises(he.ConfigError, match="a feature reads one"):
        he.tables_from_torchrec([configs[0], SimpleNamespace(**{**vars(configs[1]), "feature_names": ["a"]})])
    with pytest.raises(he.ConfigError, match="FP32, FP16, BF16"):
        he.tables_from_torchrec([SimpleNamespace(**{**vars(configs[1]), "data_type": "INT8"})])


def test_real_torchrec_configs_convert():
    cfg = pytest.importorskip("torchrec.modules.embedding_configs")
    tables, features = he.tables_from_torchrec(
        [cfg.EmbeddingBagConfig(num_embeddings=64, embedding_dim=8, name="t", feature_names=["a"])]
    )
    assert features == {"a": "t"} and tables[0].combiner == "sum"
    assert math.isclose(tables[0].init.high, 0.125)
