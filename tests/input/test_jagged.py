"""Tests for ``hybridembed.input.jagged``: every constructor, the accessors, validation.

Run: python -m pytest -q tests/input/test_jagged.py

The reference for every input form is a plain-Python description of the bags
(``bags``: list of lists of ids, ``wbags``: list of lists of weights or None).
"""

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import hybridembed as he
from hybridembed.input import as_jagged

FEATURE = "clicked_items"  # distinctive, so "the message names the feature" cannot match by accident


def coo_tensor(indices, values, size):
    return torch.sparse_coo_tensor(indices, values, size, check_invariants=True)


# --- plain-Python reference ----------------------------------------------------------------


def expected(bags, wbags=None):
    """(values, offsets, weights) exactly as the module docstring defines them."""
    values = torch.tensor([i for bag in bags for i in bag], dtype=torch.int64)
    offsets = [0]
    for bag in bags:
        offsets.append(offsets[-1] + len(bag))
    weights = None
    if wbags is not None:
        weights = torch.tensor([w for bag in wbags for w in bag], dtype=torch.float32)
    return values, torch.tensor(offsets, dtype=torch.int64), weights


def assert_same(j, bags, wbags=None):
    values, offsets, weights = expected(bags, wbags)
    assert isinstance(j, he.Jagged)
    assert j.values.dtype == torch.int64
    assert j.offsets.dtype == torch.int64
    assert torch.equal(j.values, values)
    assert torch.equal(j.offsets, offsets)
    if wbags is None:
        assert j.weights is None
    else:
        assert j.weights is not None and j.weights.is_floating_point()
        assert torch.equal(j.weights.to(torch.float32), weights)
    assert j.to_lists() == [list(b) for b in bags]
    assert j.batch_size == len(bags)


def padded(bags, wbags, pad, rng, extra):
    """(B, H) ids with ``pad`` interleaved at random columns, the matching weights and
    the column of every id (for the sparse form)."""
    width = max([len(b) for b in bags], default=0) + extra
    ids = torch.full((len(bags), width), pad, dtype=torch.int64)
    w = torch.zeros(len(bags), width)
    cols = []
    for b, bag in enumerate(bags):
        c = sorted(rng.sample(range(width), len(bag)))
        cols.append(c)
        for k, (col, i) in enumerate(zip(c, bag, strict=True)):
            ids[b, col] = i
            if wbags is not None:
                w[b, col] = wbags[b][k]
    return ids, (w if wbags is not None else None), cols


def sparse(bags, wbags, cols, width, rng):
    """A 2-D COO tensor of ids (and one of weights) with the nonzeros in shuffled order."""
    entries = [
        (b, c, i, None if wbags is None else wbags[b][k])
        for b, bag in enumerate(bags)
        for k, (c, i) in enumerate(zip(cols[b], bag, strict=True))
    ]
    rng.shuffle(entries)
    idx = torch.tensor([[e[0] for e in entries], [e[1] for e in entries]], dtype=torch.int64).reshape(2, len(entries))
    shape = (len(bags), width)
    ids = coo_tensor(idx, torch.tensor([e[2] for e in entries], dtype=torch.int64), shape)
    w = None
    if wbags is not None:
        w = coo_tensor(idx, torch.tensor([e[3] for e in entries], dtype=torch.float32), shape)
    return ids, w


bag_lists = st.lists(st.lists(st.integers(0, 1000), max_size=5), min_size=1, max_size=6)
weight_values = st.floats(-4, 4, width=32, allow_nan=False)


@st.composite
def bags_and_weights(draw):
    bags = draw(bag_lists)
    wbags = None
    if draw(st.booleans()):
        wbags = [draw(st.lists(weight_values, min_size=len(b), max_size=len(b))) for b in bags]
    return bags, wbags


# --- constructors --------------------------------------------------------------------------


def test_constructor_stores_the_tensors_unchanged():
    v, o, w = torch.tensor([3, 1, 7]), torch.tensor([0, 2, 2, 3]), torch.tensor([0.5, 1.0, 2.0])
    j = he.Jagged(v, o, w)
    assert j.values is v and j.offsets is o and j.weights is w
    assert he.Jagged(v, o).weights is None
    assert j.lengths().tolist() == [2, 0, 1]
    assert j.to_lists() == [[3, 1], [], [7]]
    assert j.batch_size == 3
    assert j.validate(FEATURE, num_embeddings=8) is j


@pytest.mark.parametrize(
    "args",
    [
        ([3, 1], torch.tensor([0, 2]), None),
        (torch.tensor([3, 1]), [0, 2], None),
        (torch.tensor([3, 1]), torch.tensor([0, 2]), [1.0, 2.0]),
    ],
)
def test_constructor_rejects_non_tensors(args):
    with pytest.raises(he.InvalidInputError):
        he.Jagged(*args)


def test_from_lists_docstring_example():
    assert_same(he.Jagged.from_lists([[3, 1], [], [7]]), [[3, 1], [], [7]])
    assert_same(
        he.Jagged.from_lists([[3, 1], [], [7]], [[0.5, 2.0], [], [1.5]]), [[3, 1], [], [7]], [[0.5, 2.0], [], [1.5]]
    )


def test_from_dense_drops_padding_anywhere_in_a_row():
    ids = torch.tensor([[4, -1, 2], [-1, -1, -1], [-1, 5, 6]])
    w = torch.tensor([[1.0, 9.0, 2.0], [9.0, 9.0, 9.0], [9.0, 3.0, 4.0]])
    assert_same(he.Jagged.from_dense(ids), [[4, 2], [], [5, 6]])
    assert_same(he.Jagged.from_dense(ids, weights=w), [[4, 2], [], [5, 6]], [[1.0, 2.0], [], [3.0, 4.0]])
    # another pad value: -1 is then an id (and invalid, but from_dense does not check ranges)
    assert_same(he.Jagged.from_dense(torch.tensor([[0, 3], [4, 0]]), pad=0), [[3], [4]])


def test_from_dense_narrow_int_dtypes_become_int64():
    for dtype in (torch.int32, torch.int16, torch.int8, torch.uint8):
        j = he.Jagged.from_dense(torch.tensor([[1, 2], [3, 0]], dtype=dtype), pad=0)
        assert_same(j, [[1, 2], [3]])


def test_from_tensor_1d_is_one_id_per_sample():
    assert_same(he.Jagged.from_tensor(torch.tensor([5, 0, 9])), [[5], [0], [9]])
    assert_same(he.Jagged.from_tensor(torch.tensor([5, -1, 9])), [[5], [], [9]])
    assert_same(
        he.Jagged.from_tensor(torch.tensor([5, -1, 9]), weights=torch.tensor([0.5, 7.0, 2.0])),
        [[5], [], [9]],
        [[0.5], [], [2.0]],
    )
    assert_same(he.Jagged.from_tensor(torch.tensor([[5, -1], [1, 2]])), [[5], [1, 2]])


def test_from_lengths():
    assert_same(he.Jagged.from_lengths(torch.tensor([3, 1, 7]), torch.tensor([2, 0, 1])), [[3, 1], [], [7]])
    j = he.Jagged.from_lengths(
        torch.tensor([3, 1, 7]), torch.tensor([0, 3, 0], dtype=torch.int32), torch.tensor([1.0, 2.0, 3.0])
    )
    assert_same(j, [[], [3, 1, 7], []], [[], [1.0, 2.0, 3.0], []])
    assert_same(he.Jagged.from_lengths(torch.tensor([], dtype=torch.int64), torch.tensor([0, 0])), [[], []])


def test_from_sparse_orders_each_bag_by_column():
    # tf.SparseTensor layout: indices (row, column), values are ids; given out of order here
    idx = torch.tensor([[2, 0, 0, 2], [1, 3, 0, 0]])
    coo = coo_tensor(idx, torch.tensor([8, 4, 3, 6]), (3, 4))
    wcoo = coo_tensor(idx, torch.tensor([0.8, 0.4, 0.3, 0.6]), (3, 4))
    assert_same(he.Jagged.from_sparse(coo), [[3, 4], [], [6, 8]])
    assert_same(he.Jagged.from_sparse(coo, wcoo), [[3, 4], [], [6, 8]], [[0.3, 0.4], [], [0.6, 0.8]])


def test_from_sparse_trailing_empty_rows_count_as_bags():
    coo = coo_tensor(torch.tensor([[0], [0]]), torch.tensor([2]), (4, 3))
    assert_same(he.Jagged.from_sparse(coo), [[2], [], [], []])


def test_empty_batch():
    assert_same(he.Jagged.from_lists([]), [])
    assert_same(he.Jagged.from_dense(torch.zeros(0, 3, dtype=torch.int64)), [])
    assert_same(he.Jagged.from_lists([[], [], []]), [[], [], []])
    he.Jagged.from_lists([]).validate(FEATURE, num_embeddings=1)


@given(bw=bags_and_weights(), seed=st.integers(0, 2**31), extra=st.integers(0, 2), pad=st.sampled_from([-1, -7]))
def test_every_form_gives_the_same_jagged(bw, seed, extra, pad):
    bags, wbags = bw
    rng = random.Random(seed)
    values, offsets, weights = expected(bags, wbags)
    lengths = torch.tensor([len(b) for b in bags], dtype=torch.int64)
    ids2d, w2d, cols = padded(bags, wbags, pad, rng, extra)
    coo, wcoo = sparse(bags, wbags, cols, ids2d.shape[1], rng)

    forms = {
        "ctor": he.Jagged(values, offsets, weights),
        "lengths": he.Jagged.from_lengths(values, lengths, weights),
        "lists": he.Jagged.from_lists(bags, wbags),
        "dense": he.Jagged.from_dense(ids2d, pad=pad, weights=w2d),
        "tensor2d": he.Jagged.from_tensor(ids2d, pad=pad, weights=w2d),
        "sparse": he.Jagged.from_sparse(coo, wcoo),
    }
    if all(len(b) <= 1 for b in bags):
        ids1d = torch.tensor([b[0] if b else pad for b in bags], dtype=torch.int64)
        w1d = None if wbags is None else torch.tensor([w[0] if w else 0.0 for w in wbags])
        forms["tensor1d"] = he.Jagged.from_tensor(ids1d, pad=pad, weights=w1d)
        if wbags is None:
            forms["as_jagged_1d"] = as_jagged(ids1d, pad=pad)
    if wbags is None:  # as_jagged takes weights only through a Jagged or a tuple
        forms["as_jagged_lists"] = as_jagged(bags)
        forms["as_jagged_dense"] = as_jagged(ids2d, pad=pad)
        forms["as_jagged_sparse"] = as_jagged(coo)
        forms["as_jagged_tuple"] = as_jagged((values, offsets))
    else:
        forms["as_jagged_tuple"] = as_jagged((values, offsets, weights))
    for name, j in forms.items():
        try:
            assert_same(j, bags, wbags)
        except AssertionError as e:
            raise AssertionError(f"form {name}: {e}") from e
        assert j.validate(FEATURE, num_embeddings=1001) is j


@given(bw=bags_and_weights())
def test_lengths_and_to_lists_round_trip(bw):
    bags, wbags = bw
    j = he.Jagged.from_lists(bags, wbags)
    assert j.lengths().tolist() == [len(b) for b in bags]
    assert j.lengths().dtype == torch.int64
    assert_same(he.Jagged.from_lists(j.to_lists(), wbags), bags, wbags)
    assert_same(he.Jagged.from_lengths(j.values, j.lengths(), j.weights), bags, wbags)


def test_as_jagged_passes_a_jagged_through():
    j = he.Jagged.from_lists([[1], [2, 3]])
    assert as_jagged(j) is j


def test_to_moves_every_tensor():
    j = he.Jagged(torch.tensor([3, 1, 7]), torch.tensor([0, 2, 2, 3]), torch.tensor([0.5, 1.0, 2.0]))
    m = j.to("meta")
    assert isinstance(m, he.Jagged)
    assert m.values.device.type == "meta" and m.offsets.device.type == "meta" and m.weights.device.type == "meta"
    assert m.values.dtype == torch.int64 and m.weights.dtype == torch.float32
    assert j.values.device.type == "cpu"  # the original is untouched
    c = j.to(torch.device("cpu"))
    assert torch.equal(c.values, j.values) and torch.equal(c.offsets, j.offsets) and torch.equal(c.weights, j.weights)
    assert j.to("meta").__class__ is he.Jagged and he.Jagged(j.values, j.offsets).to("meta").weights is None


# --- bad input to constructors ---------------------------------------------------------------


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda: he.Jagged.from_dense(torch.tensor([[1.0, 2.0]])), id="dense-float-ids"),
        pytest.param(lambda: he.Jagged.from_dense(torch.tensor([1, 2])), id="dense-1d"),
        pytest.param(lambda: he.Jagged.from_dense(torch.ones(2, 2, 2, dtype=torch.int64)), id="dense-3d"),
        pytest.param(
            lambda: he.Jagged.from_dense(torch.tensor([[1, 2]]), weights=torch.ones(1, 3)), id="dense-weights-shape"
        ),
        pytest.param(lambda: he.Jagged.from_tensor(torch.tensor([1.0, 2.0])), id="tensor-float-ids"),
        pytest.param(lambda: he.Jagged.from_tensor(torch.tensor(3)), id="tensor-0d"),
        pytest.param(lambda: he.Jagged.from_tensor(torch.ones(2, 2, 2, dtype=torch.int64)), id="tensor-3d"),
        pytest.param(
            lambda: he.Jagged.from_tensor(torch.tensor([1, 2]), weights=torch.ones(3)), id="tensor-weights-len"
        ),
        pytest.param(
            lambda: he.Jagged.from_lengths(torch.tensor([1, 2]), torch.tensor([1.0, 1.0])), id="float-lengths"
        ),
        pytest.param(lambda: he.Jagged.from_lengths(torch.tensor([1, 2]), torch.tensor([[1, 1]])), id="2d-lengths"),
        pytest.param(lambda: he.Jagged.from_lengths(torch.tensor([1, 2]), torch.tensor([3, -1])), id="negative-length"),
        pytest.param(lambda: he.Jagged.from_lists([1, 2, 3]), id="lists-not-nested"),
        pytest.param(lambda: he.Jagged.from_lists([[1, "a"]]), id="lists-str-id"),
        pytest.param(lambda: he.Jagged.from_lists([[1, None]]), id="lists-none-id"),
        pytest.param(lambda: he.Jagged.from_lists([[1, 2]], [[1.0]]), id="lists-weights-len"),
        pytest.param(lambda: he.Jagged.from_lists([[1], [2]], [[1.0]]), id="lists-weights-bags"),
        pytest.param(lambda: he.Jagged.from_sparse(torch.tensor([[1, 2]])), id="sparse-dense-tensor"),
        pytest.param(lambda: he.Jagged.from_sparse([[1, 2]]), id="sparse-list"),
        pytest.param(
            lambda: he.Jagged.from_sparse(coo_tensor(torch.tensor([[0, 1]]), torch.tensor([3, 4]), (2,))),
            id="sparse-1d",
        ),
        pytest.param(
            lambda: he.Jagged.from_sparse(coo_tensor(torch.tensor([[0], [0], [0]]), torch.tensor([3]), (1, 1, 1))),
            id="sparse-3d",
        ),
        pytest.param(
            lambda: he.Jagged.from_sparse(
                coo_tensor(torch.tensor([[0, 1], [0, 0]]), torch.tensor([3, 4]), (2, 2)),
                coo_tensor(torch.tensor([[0, 1], [0, 1]]), torch.tensor([1.0, 2.0]), (2, 2)),
            ),
            id="sparse-weights-other-indices",
        ),
    ],
)
def test_constructors_reject_bad_input(build):
    with pytest.raises(he.InvalidInputError):
        build()


def test_from_lists_rejects_float_ids():
    # torch.tensor([1.5], dtype=torch.int64) silently truncates to 1: a float id must be refused
    with pytest.raises(he.InvalidInputError):
        he.Jagged.from_lists([[1.5, 2]])


def test_from_sparse_rejects_duplicate_coordinates():
    # coalesce() would add the two ids at (0, 0) into one id, 3 + 4 = 7: a silently wrong row
    coo = coo_tensor(torch.tensor([[0, 0, 1], [0, 0, 0]]), torch.tensor([3, 4, 5]), (2, 1))
    with pytest.raises(he.InvalidInputError):
        he.Jagged.from_sparse(coo)


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda w: he.Jagged.from_tensor(torch.tensor([4, -1, 6]), weights=w), id="tensor-1d"),
        pytest.param(lambda w: he.Jagged.from_tensor(torch.tensor([[4], [-1], [6]]), weights=[[x] for x in w]), id="tensor-2d"),
        pytest.param(lambda w: he.Jagged.from_dense(torch.tensor([[4], [-1], [6]]), weights=[[x] for x in w]), id="dense"),
        pytest.param(lambda w: he.Jagged.from_lengths([4, 6], [1, 0, 1], weights=[w[0], w[2]]), id="lengths"),
    ],
)  # fmt: skip
def test_constructors_take_list_weights_as_float32(build):
    j = build([0.5, 9.0, 2.0])  # (the weight of the padded id is dropped with it)
    assert j.weights.dtype == torch.float32 and j.weights.tolist() == [0.5, 2.0]
    assert j.to_lists() == [[4], [], [6]]


@pytest.mark.parametrize(
    "build, needle",
    [
        (lambda: he.Jagged.from_tensor(torch.tensor([1, 2]), weights="ab"), "weights must be a float tensor or"),
        (lambda: he.Jagged.from_dense(torch.tensor([[1, 2]]), weights=[["a", "b"]]), "weights must be a float tensor or"),
        (lambda: he.Jagged.from_lengths(torch.tensor([1]), [1], weights={0: 1.0}), "weights must be a float tensor or"),
        (lambda: he.Jagged.from_lists([[1], [2]], weights=[1.0, 2.0]), "weights must be a list of lists of floats"),
        (lambda: he.Jagged.from_lists([[1]], weights=[["x"]]), "weights must be a list of lists of floats"),
        (lambda: he.Jagged.from_tensor("12"), "ids must be an integer tensor"),
        (lambda: he.Jagged.from_lengths("12", [2]), "values must be a 1-D integer tensor or a list of ints"),
        (lambda: he.Jagged.from_lengths([1, 2], "2"), "lengths must be a 1-D integer tensor or a list of ints"),
    ],
)  # fmt: skip
def test_constructors_refuse_what_is_no_number_naming_the_argument(build, needle):
    with pytest.raises(he.InvalidInputError, match=needle):  # (was AttributeError, TypeError or ValueError)
        build()


def test_from_sparse_rejects_dense_weights():
    coo = coo_tensor(torch.tensor([[0, 1], [0, 0]]), torch.tensor([3, 4]), (2, 2))
    with pytest.raises(he.InvalidInputError):
        he.Jagged.from_sparse(coo, torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("x", ["3,4", 3, None, {"a": 1}, 2.5, torch.ones(2, 2, 2, dtype=torch.int64)])
def test_as_jagged_rejects_unsupported_types_naming_the_feature(x):
    with pytest.raises(he.InvalidInputError) as info:
        as_jagged(x, feature=FEATURE)
    assert FEATURE in str(info.value)
    assert info.value.feature == FEATURE


@pytest.mark.parametrize(
    "x",
    [
        pytest.param(([1, 2, 3], torch.tensor([0, 2, 3])), id="ids-list-offsets-tensor"),
        pytest.param((torch.tensor([1, 2, 3]),), id="ids-alone"),
        pytest.param(([1, 2], [3]), id="tuple-of-lists"),
        pytest.param((torch.tensor([1, 2]), [0, 2]), id="offsets-list"),
        pytest.param((torch.tensor([1, 2]), torch.tensor([0, 2]), [1.0, 2.0]), id="weights-list"),
        pytest.param((torch.tensor([1]), torch.tensor([0, 1]), None, None), id="four"),
        pytest.param((), id="empty"),
    ],
)
def test_as_jagged_refuses_ambiguous_tuples_naming_the_spelling_to_use(x):
    """A tuple is (values, offsets[, weights]) tensors or nothing: ``(ids_list, offsets)``
    was read as two bags, ``(ids,)`` as one."""
    with pytest.raises(he.InvalidInputError) as info:
        as_jagged(x, feature=FEATURE)
    assert info.value.feature == FEATURE and FEATURE in str(info.value)
    assert "Jagged" in str(info.value) or "Tensor" in str(info.value)


def test_as_jagged_tuple_spelling_in_the_message():
    with pytest.raises(he.InvalidInputError, match=r"he\.Jagged\(values, offsets\).*list of lists"):
        as_jagged(([1, 2, 3], torch.tensor([0, 2, 3])))


def test_as_jagged_names_the_feature_for_constructor_errors():
    with pytest.raises(he.InvalidInputError) as info:
        as_jagged(torch.tensor([[1.0, 2.0]]), feature=FEATURE)
    assert FEATURE in str(info.value) and info.value.feature == FEATURE


# --- validate ------------------------------------------------------------------------------

T = torch.tensor
I32 = torch.int32


@pytest.mark.parametrize(
    "values, offsets, weights, num_embeddings, position",
    [
        pytest.param(T([1.0, 2.0]), T([0, 2]), None, 10, None, id="float-ids"),
        pytest.param(T([True, False]), T([0, 2]), None, 10, None, id="bool-ids"),
        pytest.param(T([1, 2]), T([0.0, 2.0]), None, 10, None, id="float-offsets"),
        pytest.param(T([1, 2]), T([0, 2]), T([1, 2]), 10, None, id="int-weights"),
        pytest.param(T([[1, 2]]), T([0, 2]), None, 10, None, id="2d-ids"),
        pytest.param(T(1), T([0, 1]), None, 10, None, id="0d-ids"),
        pytest.param(T([1, 2]), T([[0, 2]]), None, 10, None, id="2d-offsets"),
        pytest.param(T([1, 2]), T([], dtype=torch.int64), None, 10, None, id="empty-offsets"),
        pytest.param(T([1, 2, 3]), T([0, 3]), T([1.0, 2.0]), 10, 2, id="weights-short"),
        pytest.param(T([1, 2, 3]), T([0, 3]), T([1.0, 2.0, 3.0, 4.0]), 10, 3, id="weights-long"),
        pytest.param(T([1, 2]), T([0, 2]), T([[1.0, 2.0]]), 10, None, id="weights-2d"),
        pytest.param(T([1, 2, 3, 4]), T([0, 3, 1, 4]), None, 10, 2, id="offsets-decrease"),
        pytest.param(T([1, 2, 3, 4]), T([0, 1, 3, 2, 4]), None, 10, 3, id="offsets-decrease-late"),
        pytest.param(T([1, 2, 3]), T([1, 2, 3]), None, 10, 0, id="offsets0-positive"),
        pytest.param(T([1, 2, 3]), T([-1, 2, 3]), None, 10, 0, id="offsets0-negative"),
        pytest.param(T([1, 2, 3]), T([0, 1, 2]), None, 10, 2, id="offsets-last-short"),
        pytest.param(T([1, 2, 3]), T([0, 1, 4]), None, 10, 2, id="offsets-last-long"),
        pytest.param(T([1, 2, 3]), T([0]), None, 10, 0, id="no-bags-but-ids"),
        pytest.param(T([1, -1, 3, -2]), T([0, 2, 4]), None, 10, 1, id="negative-id"),
        pytest.param(T([1, 2, 10, 11]), T([0, 2, 4]), None, 10, 2, id="id-too-large"),
        pytest.param(T([1, 2, 10], dtype=I32), T([0, 2, 3], dtype=I32), None, 10, 2, id="id-too-large-int32"),
        pytest.param(T([0, 0, 99, 0, -3]), T([0, 5]), None, 10, 2, id="too-large-before-negative"),
        pytest.param(T([0, -3, 0, 99]), T([0, 4]), None, 10, 1, id="negative-before-too-large"),
    ],
)
def test_validate_rejects(values, offsets, weights, num_embeddings, position):
    j = he.Jagged(values, offsets, weights)
    with pytest.raises(he.InvalidInputError) as info:
        j.validate(feature=FEATURE, num_embeddings=num_embeddings)
    e = info.value
    assert isinstance(e, ValueError) and isinstance(e, he.HybridEmbedError)
    assert FEATURE in str(e)
    assert e.feature == FEATURE
    if position is not None:
        assert e.position == position, str(e)


def test_validate_without_num_embeddings_allows_any_nonnegative_id():
    he.Jagged(T([0, 2**40]), T([0, 2])).validate(FEATURE)
    with pytest.raises(he.InvalidInputError):
        he.Jagged(T([0, -5]), T([0, 2])).validate(FEATURE)


def test_validate_boundary_ids():
    he.Jagged(T([0, 9]), T([0, 1, 2])).validate(FEATURE, num_embeddings=10)
    with pytest.raises(he.InvalidInputError):
        he.Jagged(T([0, 10]), T([0, 1, 2])).validate(FEATURE, num_embeddings=10)


@given(
    bags=st.lists(st.lists(st.integers(0, 19), max_size=4), min_size=1, max_size=6),
    data=st.data(),
)
def test_validate_reports_the_first_bad_id(bags, data):
    values, offsets, _ = expected(bags)
    n = values.numel()
    if n == 0:
        return
    bad = data.draw(st.dictionaries(st.integers(0, n - 1), st.sampled_from([-1, -100, 20, 21, 10**9]), min_size=1))
    for pos, v in bad.items():
        values[pos] = v
    with pytest.raises(he.InvalidInputError) as info:
        he.Jagged(values, offsets).validate(FEATURE, num_embeddings=20)
    assert info.value.position == min(bad), str(info.value)
    assert info.value.feature == FEATURE and FEATURE in str(info.value)


@given(lengths=st.lists(st.integers(0, 4), min_size=2, max_size=8), data=st.data())
def test_validate_reports_the_first_decreasing_offset(lengths, data):
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    total = offsets[-1]
    i = data.draw(st.integers(1, len(offsets) - 2))  # an inner offset, so offsets[-1] stays right
    if offsets[i - 1] == 0:
        return
    offsets[i] = data.draw(st.integers(0, offsets[i - 1] - 1))
    j = he.Jagged(torch.zeros(total, dtype=torch.int64), torch.tensor(offsets))
    first = next(k for k in range(1, len(offsets)) if offsets[k] < offsets[k - 1])
    with pytest.raises(he.InvalidInputError) as info:
        j.validate(FEATURE, num_embeddings=1)
    assert info.value.position == first
    assert FEATURE in str(info.value)


@given(st.lists(st.integers(0, 6), max_size=12))
def test_run_index_searched_on_a_gpu_equals_repeat_interleave(lengths):
    """The GPU's form of run_index (a search per position) gives what repeat_interleave gives,
    empty runs, a run of all the ids and no runs included."""
    from hybridembed.input.jagged import _searched_run_index, run_index

    counts = torch.tensor(lengths, dtype=torch.int64)
    n = sum(lengths)
    want = torch.repeat_interleave(torch.arange(len(lengths)), counts)
    assert torch.equal(run_index(counts, n), want)
    assert torch.equal(_searched_run_index(counts, n), want)
