"""Bad input through ``EmbeddingCollection.forward`` and bad configurations (bad input never corrupts a table).

Run: python -m pytest -q tests/modules/test_validation.py

Every bad input must raise ``hybridembed.InvalidInputError`` (a ``ValueError``) naming the
feature and, where there is one, the first bad position, before any row is touched.
"""

import pytest
import torch

import hybridembed as he

T = torch.tensor


def make_collection():
    return he.EmbeddingCollection(
        [
            he.TableConfig("items", 10, 4, init=he.init.normal()),
            he.TableConfig("users", 7, 3, combiner="mean", init=he.init.normal()),
            he.TableConfig("history", 10, 4, combiner="none", init=he.init.normal()),
        ],
        features={"clicked_items": "items", "viewed_items": "items", "user_id": "users", "watch_history": "history"},
    )


def good_inputs():
    return {
        "clicked_items": he.Jagged(T([1, 2, 9]), T([0, 2, 3])),
        "viewed_items": T([[3, -1], [4, 5]]),
        "user_id": T([6, 0]),
        "watch_history": [[1, 2, 3], [9]],
    }


def snapshot(ec):
    return {k: v.detach().clone() for k, v in ec.state_dict().items()}


_INT_OF = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}


def bits(t):
    """The raw bits of a float tensor, so that even a NaN written into a row is caught."""
    return t.view(_INT_OF[t.dtype])


def assert_unchanged(ec, snap):
    now = ec.state_dict()
    assert sorted(now) == sorted(snap)
    for k, v in snap.items():
        assert now[k].dtype == v.dtype and torch.equal(bits(now[k]), bits(v)), k
    for storage in ec.storages:
        assert storage.weight.grad is None


# (feature, bad input, first bad position or None where no position applies)
BAD_INPUTS = {
    # ids out of range
    "too-large-jagged": ("clicked_items", he.Jagged(T([1, 2, 10]), T([0, 2, 3])), 2),
    "too-large-first": ("clicked_items", he.Jagged(T([10, 2, 3]), T([0, 2, 3])), 0),
    "too-large-huge": ("clicked_items", he.Jagged(T([1, 2**40]), T([0, 1, 2])), 1),
    "too-large-1d": ("user_id", T([6, 7]), 1),
    "too-large-lists": ("watch_history", [[1, 2], [10, 3]], 2),
    "too-large-padded": ("viewed_items", T([[3, -1], [4, 10]]), None),
    "too-large-sparse": (
        "viewed_items",
        torch.sparse_coo_tensor(T([[0, 1], [0, 0]]), T([3, 11]), (2, 2), check_invariants=True),
        1,
    ),
    "too-large-int32": (
        "clicked_items",
        he.Jagged(T([1, 12, 3], dtype=torch.int32), T([0, 2, 3], dtype=torch.int32)),
        1,
    ),
    "too-large-uint8": ("clicked_items", he.Jagged(T([1, 255, 3], dtype=torch.uint8), T([0, 2, 3])), 1),
    # negative ids (the pad value is only dropped from dense 2-D / 1-D tensors)
    "negative-jagged": ("clicked_items", he.Jagged(T([1, -1, 3]), T([0, 2, 3])), 1),
    "negative-lists": ("watch_history", [[1, 2], [3, -1]], 3),
    "negative-padded-not-pad": ("viewed_items", T([[3, -2], [4, 5]]), None),
    "negative-1d-not-pad": ("user_id", T([-5, 0]), 0),
    "negative-sequence-jagged": ("watch_history", he.Jagged(T([1, -1]), T([0, 1, 2])), 1),
    # offsets
    "offsets-decrease": ("clicked_items", he.Jagged(T([1, 2, 3]), T([0, 2, 1, 3])), 2),
    "offsets-first-nonzero": ("clicked_items", he.Jagged(T([1, 2, 3]), T([1, 2, 3])), 0),
    "offsets-last-short": ("clicked_items", he.Jagged(T([1, 2, 3]), T([0, 1, 2])), 2),
    "offsets-last-long": ("clicked_items", he.Jagged(T([1, 2, 3]), T([0, 1, 4])), 2),
    # inner offset beyond the id count while the last one is right: the joined offsets of
    # a group must catch it for a feature followed by another one, and for a group's last
    "offsets-inner-beyond-count-then-more": ("clicked_items", he.Jagged(T([1, 2, 3]), T([0, 4, 3])), 2),
    "offsets-inner-beyond-count-last": ("user_id", he.Jagged(T([1, 2]), T([0, 3, 2])), 2),
    "offsets-decrease-sequence": ("watch_history", he.Jagged(T([1, 2, 3]), T([0, 3, 2, 3])), 2),
    "offsets-empty": ("clicked_items", he.Jagged(T([1, 2, 3]), T([], dtype=torch.int64)), None),
    "offsets-2d": ("clicked_items", he.Jagged(T([1, 2, 3]), T([[0, 3]])), None),
    "offsets-float": ("clicked_items", he.Jagged(T([1, 2, 3]), T([0.0, 2.0, 3.0])), None),
    # weights
    "weights-short": ("clicked_items", he.Jagged(T([1, 2, 3]), T([0, 2, 3]), T([1.0, 2.0])), 2),
    "weights-long": ("user_id", he.Jagged(T([1, 2]), T([0, 1, 2]), T([1.0, 2.0, 3.0])), 2),
    "weights-int": ("clicked_items", he.Jagged(T([1, 2, 3]), T([0, 2, 3]), T([1, 2, 3])), None),
    "weights-2d": ("clicked_items", he.Jagged(T([1, 2, 3]), T([0, 2, 3]), T([[1.0, 2.0, 3.0]])), None),
    "weights-tuple-short": ("user_id", (T([1, 2]), T([0, 1, 2]), T([1.0])), 1),
    "weights-on-another-device-sum": (
        "clicked_items",
        he.Jagged(T([1, 2, 3]), T([0, 2, 3]), torch.ones(3, device="meta")),
        None,
    ),
    "weights-on-another-device-mean": (
        "user_id",
        he.Jagged(T([1, 2]), T([0, 1, 2]), torch.ones(2, device="meta")),
        None,
    ),
    "weights-on-another-device-sequence": (
        "watch_history",
        he.Jagged(T([1, 2]), T([0, 1, 2]), torch.ones(2, device="meta")),
        None,
    ),
    "weights-nan-sum": ("clicked_items", he.Jagged(T([1, 2, 3]), T([0, 2, 3]), T([1.0, float("nan"), 2.0])), 1),
    "weights-inf-mean": ("user_id", he.Jagged(T([1, 2]), T([0, 1, 2]), T([1.0, float("inf")])), 1),
    "weights-neg-inf-sequence": (
        "watch_history",
        he.Jagged(T([1, 2, 3]), T([0, 2, 3]), T([-float("inf"), 1.0, 1.0])),
        0,
    ),
    "weights-nan-float16": (
        "clicked_items",
        he.Jagged(T([1, 2, 3]), T([0, 2, 3]), T([1.0, 1.0, float("nan")], dtype=torch.float16)),
        2,
    ),
    "offsets-on-another-device": ("clicked_items", he.Jagged(T([1, 2, 3]), T([0, 2, 3], device="meta")), None),
    # ids of the wrong dtype or shape
    "float-ids-jagged": ("clicked_items", he.Jagged(T([1.0, 2.0, 3.0]), T([0, 2, 3])), None),
    "float-ids-1d": ("user_id", T([1.0, 2.0]), None),
    "float-ids-padded": ("viewed_items", T([[3.0, -1.0], [4.0, 5.0]]), None),
    "float-ids-lists": ("watch_history", [[1.5, 2], [3]], None),
    "float-ids-sparse": (
        "viewed_items",
        torch.sparse_coo_tensor(T([[0, 1], [0, 0]]), T([3.0, 4.0]), (2, 2), check_invariants=True),
        None,
    ),
    "bool-ids": ("user_id", T([True, False]), None),
    "ids-2d-in-jagged": ("clicked_items", he.Jagged(T([[1, 2, 3]]), T([0, 3])), None),
    "ids-3d": ("viewed_items", torch.zeros(2, 2, 2, dtype=torch.int64), None),
    "ids-0d": ("user_id", T(3), None),
    "meta-ids-1d": ("user_id", torch.empty(2, dtype=torch.int64, device="meta"), None),
    "meta-ids-padded": ("viewed_items", torch.empty(2, 2, dtype=torch.int64, device="meta"), None),
    # not ids at all
    "string": ("user_id", "6,0", None),
    "int": ("user_id", 6, None),
    "none": ("user_id", None, None),
    "dict": ("user_id", {"ids": [6, 0]}, None),
    "list-of-ints": ("watch_history", [1, 2, 3], None),
    "tuple-ids-list-and-offsets": ("clicked_items", ([1, 2, 9], T([0, 2, 3])), None),
    "tuple-of-ids-alone": ("user_id", (T([6, 0]),), None),
    "tuple-of-lists": ("watch_history", ([1, 2, 3], [9]), None),
    "list-with-str": ("watch_history", [[1, "2"], [3]], None),
    "numpy-like-object": ("user_id", object(), None),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_before_touching_a_row(case):
    feature, bad, position = BAD_INPUTS[case]
    ec = make_collection()
    snap = snapshot(ec)
    inputs = good_inputs()
    inputs[feature] = bad
    with pytest.raises(he.InvalidInputError) as info:
        ec(inputs)
    e = info.value
    assert isinstance(e, ValueError) and isinstance(e, he.HybridEmbedError)
    assert feature in str(e), str(e)
    assert e.feature == feature, str(e)
    if position is not None:
        assert e.position == position, str(e)
    assert_unchanged(ec, snap)
    # the collection still works afterwards
    out = ec(good_inputs())
    assert out["clicked_items"].shape == (2, 4)


def test_first_bad_position_is_the_first_whatever_the_problem():
    # an id out of range at position 1 comes before a negative id at position 3
    ec = make_collection()
    inputs = good_inputs()
    inputs["clicked_items"] = he.Jagged(T([1, 10, 2, -4]), T([0, 2, 4]))
    with pytest.raises(he.InvalidInputError) as info:
        ec(inputs)
    assert info.value.feature == "clicked_items"
    assert info.value.position == 1, str(info.value)


def test_every_bad_feature_is_caught_whatever_its_place():
    # the last feature of the last group bad, the first fine: still nothing changes
    for feature in ("clicked_items", "viewed_items", "user_id", "watch_history"):
        ec = make_collection()
        snap = snapshot(ec)
        inputs = good_inputs()
        inputs[feature] = he.Jagged(T([100]), T([0, 1, 1]))
        with pytest.raises(he.InvalidInputError) as info:
            ec(inputs)
        assert info.value.feature == feature and info.value.position == 0
        assert feature in str(info.value)
        assert_unchanged(ec, snap)


def test_bad_input_after_training_steps_leaves_rows_and_grads_unchanged():
    ec = make_collection()
    out = ec(good_inputs())
    sum(o.values.sum() if isinstance(o, he.Jagged) else o.sum() for o in out.values()).backward()
    grads = [s.weight.grad.coalesce().to_dense().clone() for s in ec.storages]
    snap = snapshot(ec)
    inputs = good_inputs()
    inputs["user_id"] = T([0, 7])
    with pytest.raises(he.InvalidInputError):
        ec(inputs)
    for k, v in snap.items():
        assert torch.equal(ec.state_dict()[k], v)
    for s, g in zip(ec.storages, grads, strict=True):
        assert torch.equal(s.weight.grad.coalesce().to_dense(), g)


def test_unknown_feature():
    ec = make_collection()
    snap = snapshot(ec)
    inputs = good_inputs()
    inputs["clicked_itemz"] = T([1, 2])
    with pytest.raises(he.InvalidInputError) as info:
        ec(inputs)
    assert isinstance(info.value, ValueError)
    assert info.value.feature == "clicked_itemz"
    assert "clicked_itemz" in str(info.value)
    assert "clicked_items" in str(info.value)  # says what is allowed
    assert_unchanged(ec, snap)


def test_table_name_is_not_a_feature_name():
    ec = make_collection()
    inputs = good_inputs()
    inputs["items"] = inputs.pop("clicked_items")
    with pytest.raises(he.InvalidInputError) as info:
        ec(inputs)
    assert info.value.feature == "items" and "items" in str(info.value)


def test_missing_feature():
    ec = make_collection()
    snap = snapshot(ec)
    inputs = good_inputs()
    del inputs["user_id"]
    with pytest.raises(he.InvalidInputError) as info:
        ec(inputs)
    assert isinstance(info.value, ValueError)
    assert info.value.feature == "user_id"
    assert "user_id" in str(info.value)
    assert_unchanged(ec, snap)


@pytest.mark.parametrize("inputs", ["clicked_items", [T([1])], T([1, 2]), None, 3])
def test_inputs_not_a_mapping(inputs):
    ec = make_collection()
    snap = snapshot(ec)
    with pytest.raises(he.InvalidInputError) as info:
        ec(inputs)
    assert isinstance(info.value, ValueError)
    assert_unchanged(ec, snap)


META_IDS = {
    "1d": lambda: T([1, 2], device="meta"),
    "2d-padded": lambda: T([[1, -1], [2, 3]], device="meta"),
    "jagged": lambda: he.Jagged(T([1, 2], device="meta"), T([0, 1, 2], device="meta")),
    "tuple": lambda: (T([1, 2], device="meta"), T([0, 1, 2], device="meta")),
    "sparse": lambda: torch.sparse_coo_tensor(T([[0, 1], [0, 0]]), T([1, 2]), (2, 1), check_invariants=True).to("meta"),
}


@pytest.mark.parametrize("form", list(META_IDS))
@pytest.mark.parametrize("dynamic", [False, True])
def test_meta_ids_are_refused_naming_the_feature(form, dynamic):
    """(were a raw RuntimeError "Tensor.item() cannot be called on meta tensors" or NotImplementedError)"""
    table = TC("t", None, 4, dynamic=he.Dynamic()) if dynamic else TC("t", 10, 4)
    ec = he.EmbeddingCollection([table], features={"clicked_items": "t"})
    before = dynamic_state(ec) if dynamic else snapshot(ec)
    for call in (lambda x: ec({"clicked_items": x}), lambda x: ec.lookup("clicked_items", x)):
        with pytest.raises(he.InvalidInputError, match="meta tensors hold no values") as info:
            call(META_IDS[form]())
        assert info.value.feature == "clicked_items" and str(info.value).startswith("feature 'clicked_items': ids")
    if dynamic:
        assert_same_state(before, dynamic_state(ec))
    else:
        assert_unchanged(ec, before)


@pytest.mark.parametrize("grouped", [False, True])
def test_a_collection_built_on_meta_refuses_lookups(grouped):
    ec = he.EmbeddingCollection([TC("t", 10, 4)], features={"clicked_items": "t"}, device="meta")
    for ids in (T([1, 2]), T([1, 2], device="meta")):  # (its advice was .to('meta'), then a raw RuntimeError)
        with pytest.raises(he.InvalidInputError, match="built on the meta device and has no rows") as info:
            ec({"clicked_items": ids})
        assert info.value.feature == "clicked_items"
    model = he.convert(torch.nn.Sequential(torch.nn.Embedding(10, 4, device="meta")), grouped=grouped)
    with pytest.raises(he.InvalidInputError, match="built on the meta device"):
        model(T([1, 2], device="meta")).sum()


def test_input_on_another_device():
    ec = make_collection()
    snap = snapshot(ec)
    inputs = good_inputs()
    inputs["clicked_items"] = inputs["clicked_items"].to("meta")
    with pytest.raises(he.InvalidInputError) as info:
        ec(inputs)
    assert info.value.feature == "clicked_items" and "clicked_items" in str(info.value)
    assert "meta" in str(info.value)
    assert_unchanged(ec, snap)


def test_good_edge_inputs_pass():
    ec = make_collection()
    inputs = good_inputs()
    inputs["clicked_items"] = he.Jagged(T([0, 9]), T([0, 0, 2]))  # boundary ids, an empty bag
    inputs["user_id"] = T([-1, 6])  # pad in a 1-D tensor is an empty bag
    inputs["watch_history"] = [[], []]
    out = ec(inputs)
    assert torch.equal(out["user_id"][0], torch.zeros(3))


# --- bad configuration ---------------------------------------------------------------------


def TC(*args, **kw):
    return he.TableConfig(*args, **kw)


BAD_CONFIGS = {
    "duplicate-table-names": lambda: he.EmbeddingCollection([TC("a", 5, 4), TC("a", 6, 4)]),
    "duplicate-names-other-dims": lambda: he.EmbeddingCollection([TC("a", 5, 4), TC("b", 5, 2), TC("a", 6, 8)]),
    "feature-to-unknown-table": lambda: he.EmbeddingCollection([TC("a", 5, 4)], features={"f": "b"}),
    "one-feature-to-unknown-table": lambda: he.EmbeddingCollection(
        [TC("a", 5, 4), TC("b", 5, 4)], features={"f": "a", "g": "c"}
    ),
    "feature-name-not-str": lambda: he.EmbeddingCollection([TC("a", 5, 4)], features={1: "a"}),
    "no-features": lambda: he.EmbeddingCollection([TC("a", 5, 4)], features={}),
    "features-not-mapping": lambda: he.EmbeddingCollection([TC("a", 5, 4)], features=[("f", "a")]),
    "no-tables": lambda: he.EmbeddingCollection([]),
    "table-not-config": lambda: he.EmbeddingCollection([{"name": "a", "num_embeddings": 5, "embedding_dim": 4}]),
    "bad-sequence-output": lambda: he.EmbeddingCollection([TC("a", 5, 4)], sequence_output="list"),
    "reserved-name": lambda: he.EmbeddingCollection([TC("storages", 5, 4)]),
    "bad-combiner": lambda: TC("a", 5, 4, combiner="max"),
    "combiner-case": lambda: TC("a", 5, 4, combiner="SUM"),
    "combiner-none-object": lambda: TC("a", 5, 4, combiner=None),
    "dim-zero": lambda: TC("a", 5, 0),
    "dim-negative": lambda: TC("a", 5, -4),
    "dim-float": lambda: TC("a", 5, 4.0),
    "dim-bool": lambda: TC("a", 5, True),
    "rows-zero": lambda: TC("a", 0, 4),
    "rows-negative": lambda: TC("a", -1, 4),
    "rows-str": lambda: TC("a", "5", 4),
    "dtype-int": lambda: TC("a", 5, 4, dtype=torch.int64),
    "dtype-complex": lambda: TC("a", 5, 4, dtype=torch.complex64),
    "name-empty": lambda: TC("", 5, 4),
    "name-dot": lambda: TC("a.b", 5, 4),
    "name-not-str": lambda: TC(3, 5, 4),
    # numbers of the wrong type or beyond what can be addressed (TypeError, OverflowError or
    # a torch allocation error before)
    "rows-beyond-max": lambda: TC("a", 2**62, 4),
    "rows-times-dim-overflow": lambda: TC("a", 2**40, 2**24),
    "group-rows-overflow": lambda: he.EmbeddingCollection([TC("a", 2**48, 2**14), TC("b", 2**48, 2**14)]),
    "admit-probability-str": lambda: he.Dynamic(admit_probability="0.5"),
    "admit-probability-nan": lambda: he.Dynamic(admit_probability=float("nan")),
    "evict-fraction-none": lambda: he.Dynamic(evict_fraction=None),
    "capacity-beyond-int32-slots": lambda: he.Dynamic(capacity=2**40),
    "initial-rows-beyond-int32-slots": lambda: he.Dynamic(initial_rows=2**31),
    # (were accepted, then a raw RuntimeError or OverflowError when the table was built or first looked up)
    "sketch-width-huge": lambda: he.Dynamic(sketch_width=2**62),
    "sketch-depth-huge": lambda: he.Dynamic(sketch_depth=2**40, min_count=2),
    "sketch-cells-beyond-2**31": lambda: he.Dynamic(sketch_depth=3, sketch_width=2**30),
    "min-count-beyond-int32": lambda: he.Dynamic(min_count=2**31),
    "ttl-steps-beyond-int64": lambda: he.Dynamic(eviction="ttl", ttl_steps=2**63),
    "group-capacity-beyond-int32-slots": lambda: he.EmbeddingCollection(
        [TC(n, None, 4, dynamic=he.Dynamic(capacity=2**30)) for n in "ab"]
    ),
    "pad-beyond-int64": lambda: he.EmbeddingCollection([TC("a", 5, 4)], pad=2**70),
    "seed-beyond-int64": lambda: he.EmbeddingCollection([TC("a", 5, 4)], seed=2**70),
    "seed-beyond-int64-dynamic": lambda: he.EmbeddingCollection([TC("a", None, 4, dynamic=he.Dynamic())], seed=2**63),
    "convert-seed-beyond-int64": lambda: he.convert(torch.nn.Sequential(torch.nn.Embedding(5, 4)), seed=2**70),
    # devices torch cannot make rows on (RuntimeError, AssertionError, TypeError or NotImplementedError before)
    "device-not-a-name": lambda: he.EmbeddingCollection([TC("a", 5, 4)], device="bogus"),
    "device-negative-index": lambda: he.EmbeddingCollection([TC("a", 5, 4)], device="cuda:-1"),
    "device-not-str": lambda: he.EmbeddingCollection([TC("a", 5, 4)], device=1.5),
    "device-absent-accelerator": lambda: he.EmbeddingCollection([TC("a", 5, 4)], device="xla"),
}

# the bad value each of those must name
BAD_CONFIG_VALUES = {
    "rows-beyond-max": str(2**62),
    "rows-times-dim-overflow": "2**63",
    "group-rows-overflow": "2**63",
    "admit-probability-str": "'0.5'",
    "admit-probability-nan": "nan",
    "evict-fraction-none": "None",
    "capacity-beyond-int32-slots": str(2**40),
    "initial-rows-beyond-int32-slots": str(2**31),
    "sketch-width-huge": "4 x 4611686018427387904 = 18446744073709551616 counters per table; at most 2**31",
    "sketch-depth-huge": "1099511627776 x 65536",
    "sketch-cells-beyond-2**31": "3 x 1073741824 = 3221225472",
    "min-count-beyond-int32": "min_count must be at most 2147483647 (sketch counters are int32), got 2147483648",
    "ttl-steps-beyond-int64": "ttl_steps must be at most 9223372036854775807 (the step clock is int64), got 9223372036854775808",
    "group-capacity-beyond-int32-slots": str(2**30),
    "pad-beyond-int64": str(2**70),
    "seed-beyond-int64": str(2**70),
    "seed-beyond-int64-dynamic": str(2**63),
    "convert-seed-beyond-int64": str(2**70),
    "device-not-a-name": "device 'bogus' is not a device name; use 'cpu', 'cuda', 'cuda:N'",
    "device-negative-index": "'cuda:-1'",
    "device-not-str": "got 1.5",
    "device-absent-accelerator": "device 'xla' is not available here",
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_raises_config_error(case):
    with pytest.raises(he.ConfigError) as info:
        BAD_CONFIGS[case]()
    assert isinstance(info.value, ValueError) and isinstance(info.value, he.HybridEmbedError)
    assert str(info.value)
    assert BAD_CONFIG_VALUES.get(case, "") in str(info.value)


def test_a_dynamic_table_on_meta_is_a_description_with_no_rows_to_look_up_or_save(tmp_path):
    """(For he.distribute, which makes each rank's shards: tests/distributed/test_tiered_job.py.)"""
    ec = he.EmbeddingCollection([TC("a", None, 4, dynamic=he.Dynamic())], device="meta")
    assert "HashStorage(rows=meta/unbounded" in repr(ec)
    with pytest.raises(he.InvalidInputError, match="'a' was built on the meta device"):
        ec({"a": torch.tensor([1, 2])})
    with pytest.raises(he.HybridEmbedError, match="dynamic table 'a' was built on the meta device"):
        ec.state_dict()
    for model in (ec, he.EmbeddingCollection([TC("b", 5, 4)], device="meta")):  # (nor a dense one)
        with pytest.raises(he.CheckpointError, match="was built on the meta device and holds no rows to save"):
            he.save(tmp_path / "ck", model)
    assert not (tmp_path / "ck").exists()
    real = he.EmbeddingCollection([TC("a", None, 4, dynamic=he.Dynamic()), TC("b", 5, 4)])
    real({"a": torch.tensor([1, 2]), "b": torch.tensor([3])})
    he.save(tmp_path / "real", real)
    for tables in ([TC("a", None, 4, dynamic=he.Dynamic())], [TC("b", 5, 4)]):
        with pytest.raises(he.CheckpointError, match="was built on the meta device and has no rows to load into"):
            he.load(tmp_path / "real", he.EmbeddingCollection(tables, device="meta"))


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_gpu_this_machine_lacks_is_a_config_error(dynamic):
    table = TC("a", None, 4, dynamic=he.Dynamic()) if dynamic else TC("a", 5, 4)
    if torch.cuda.is_available():  # the first index past the last GPU
        devices, needle = [f"cuda:{torch.cuda.device_count()}"], "this machine has"
    else:  # (was torch's AssertionError "Torch not compiled with CUDA enabled", or a RuntimeError)
        devices, needle = (
            ["cuda", "cuda:0", torch.device("cuda", 1)],
            "CUDA is not available in this torch build/machine",
        )
    for device in devices:
        with pytest.raises(he.ConfigError, match=needle) as info:
            he.EmbeddingCollection([table], device=device)
        assert f"device {str(device)!r}" in str(info.value) and "EmbeddingCollection" in str(info.value)


def test_dynamic_bounds_are_inclusive():
    d = he.Dynamic(min_count=2, sketch_depth=2, sketch_width=2**30)  # 2**31 counters: allowed (not built here)
    assert d.sketch_depth * d.sketch_width == 2**31
    he.Dynamic(min_count=2**31 - 1, eviction="ttl", ttl_steps=2**63 - 1)


def test_config_errors_name_the_bad_value():
    with pytest.raises(he.ConfigError, match=r"unique.*\ba\b"):
        he.EmbeddingCollection([TC("a", 5, 4), TC("a", 6, 4)])
    with pytest.raises(he.ConfigError, match="nope"):
        he.EmbeddingCollection([TC("a", 5, 4)], features={"f": "nope"})
    with pytest.raises(he.ConfigError, match="max"):
        TC("a", 5, 4, combiner="max")
    with pytest.raises(he.ConfigError, match="-4"):
        TC("a", 5, -4)


def test_unknown_table_lookup():
    ec = make_collection()
    with pytest.raises(he.ConfigError, match="nope"):
        ec.weight("nope")


def test_config_is_frozen():
    t = TC("a", 5, 4)
    with pytest.raises(AttributeError):
        t.num_embeddings = 0  # type: ignore[misc]


@pytest.mark.parametrize("kwargs", [{"seed": "x"}, {"seed": 1.5}, {"pad": 1.5}, {"pad": True}])
def test_collection_refuses_non_int_seed_and_pad(kwargs):
    with pytest.raises(he.ConfigError):
        he.EmbeddingCollection([he.TableConfig("a", 3, 2)], **kwargs)


def dynamic_state(ec):
    """Everything a dynamic lookup may change: rows, ids, counters, sketch, index, free slots."""
    out = {k: v.clone() for k, v in ec.state_dict().items() if isinstance(v, torch.Tensor)}
    for g, s in enumerate(ec.storages):
        for name in ("slot_key", "slot_table", "last_seen", "freq", "free", "sketch", "counters", "size", "_hrow"):
            out[f"{g}.{name}"] = getattr(s, name).clone()
        out[f"{g}.weight"] = s.weight.detach()[s.slot_table != -1].clone()  # (free slots are uninitialized)
        out[f"{g}.clock"] = torch.tensor(s.clock)
        out[f"{g}.gen"] = s._gen.get_state()
    return out


def assert_same_state(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        x, y = a[k], b[k]
        if x.is_floating_point():
            x, y = bits(x), bits(y)
        assert x.shape == y.shape and torch.equal(x, y), k


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn", "none"])
def test_weights_on_another_device_leave_a_dynamic_table_unchanged(combiner):
    """Weights on another device than the ids are refused before any id is inserted (they
    were read as invalid memory with ``sum``, and raised only after inserting with ``mean``)."""
    ec = he.EmbeddingCollection(
        [he.TableConfig("t", None, 4, combiner=combiner, dynamic=he.Dynamic(min_count=2))], features={"f": "t"}
    )
    ec({"f": [[1, 2], [3]]})
    before = dynamic_state(ec)
    bad = he.Jagged(T([1, 5, 6]), T([0, 2, 3]), torch.ones(3, device="meta"))
    with pytest.raises(he.InvalidInputError, match="meta") as info:
        ec({"f": bad})
    assert info.value.feature == "f" and "'f'" in str(info.value)
    with pytest.raises(he.InvalidInputError, match="meta"):
        ec.lookup("f", bad)
    assert_same_state(before, dynamic_state(ec))


def test_non_finite_weights_leave_a_dynamic_table_unchanged():
    ec = he.EmbeddingCollection([he.TableConfig("t", None, 4, dynamic=he.Dynamic(min_count=2))], features={"f": "t"})
    ec({"f": [[1, 2], [3]]})
    before = dynamic_state(ec)
    with pytest.raises(he.InvalidInputError, match="finite") as info:
        ec({"f": he.Jagged(T([1, 5, 6]), T([0, 2, 3]), T([1.0, 1.0, float("nan")]))})
    assert info.value.feature == "f" and info.value.position == 2
    assert_same_state(before, dynamic_state(ec))


def test_weights_add_no_host_sync(monkeypatch):
    """The weights' finiteness check is queued with the other checks: weighted inputs make
    no more host syncs than the same inputs without weights."""
    ec = make_collection()

    def syncs(weighted):
        inputs = good_inputs()
        w = (lambda *x: T(x)) if weighted else (lambda *x: None)
        inputs["clicked_items"] = he.Jagged(T([1, 2, 9]), T([0, 2, 3]), w(1.0, 2.0, 3.0))
        inputs["user_id"] = he.Jagged(T([6, 0]), T([0, 1, 2]), w(0.5, 2.0))
        calls = []
        real = torch.Tensor.__bool__
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "__bool__", lambda t: calls.append(1) or real(t))
            ec(inputs)
        return len(calls)

    assert syncs(True) == syncs(False) >= 1


@pytest.mark.parametrize("first", [he.Dynamic(), he.Dynamic(min_count=2, admit_probability=0.5, capacity=8)])
def test_a_batch_one_group_refuses_changes_no_other_group(first):
    """A dynamic table over capacity refuses the batch; the groups looked up before it
    (another dim: another storage) keep their ids, rows, counters, sketch and draws."""
    ec = he.EmbeddingCollection(
        [he.TableConfig("a", None, 4, dynamic=first), he.TableConfig("b", None, 8, dynamic=he.Dynamic(capacity=2))]
    )
    assert len(ec.groups) == 2
    ec({"a": [[1, 2], [3]], "b": [[1], [2]]})
    before = dynamic_state(ec)
    with pytest.raises(he.HybridEmbedError, match="'b'.*capacity"):
        ec({"a": [[1, 4, 5], [6, 4]], "b": [[1, 7], [8]]})  # b: 2 new rows, none evictable
    assert_same_state(before, dynamic_state(ec))
    # and the refused call left no plan behind: the next one runs as on an untouched copy
    twin = he.EmbeddingCollection(
        [he.TableConfig("a", None, 4, dynamic=first), he.TableConfig("b", None, 8, dynamic=he.Dynamic(capacity=2))]
    )
    twin({"a": [[1, 2], [3]], "b": [[1], [2]]})
    good = {"a": [[1, 4, 5], [6, 4]], "b": [[1], [2]]}
    out, ref = ec(good), twin(good)
    assert all(torch.equal(out[f], ref[f]) for f in ref)
    assert_same_state(dynamic_state(twin), dynamic_state(ec))
