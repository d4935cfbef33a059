"""K steps of wrapped optimizers on an EmbeddingCollection against independent references.

Batches hold repeated ids inside a bag and across bags, empty bags (padded rows of -1,
Jagged empty bags, a step where one feature is all empty), two features sharing a table,
one-hot ids, sum and mean combiners, and two storage groups (dims 4 and 3).
"""

import pytest
import torch

import hybridembed as he

from .common import (
    FEATURES,
    TABLES,
    Net,
    RefNet,
    assert_same_weights,
    full_hparams,
    make_steps,
    run_row_reference,
    touched_rows,
    train,
)

K = 5
FP = [pytest.param(torch.float32, 1e-6, id="float32"), pytest.param(torch.float64, 1e-12, id="float64")]


def test_batches_cover_the_cases():
    steps = make_steps(K, seed=1)
    bags0 = steps[0][0]
    assert bags0["f1"][0][0] == bags0["f1"][0][1]  # repeated inside a bag
    assert bags0["f1"][0][0] in bags0["f1"][1]  # and across bags
    assert all(b[-1] == [] for bags, _ in steps for f, b in bags.items() if f != "f4")
    assert all(b == [] for b in steps[2][0]["f3"])  # a step touching no row of table b
    for name, rows, _, _ in TABLES:  # the last row is first touched at step 2
        assert rows - 1 not in touched_rows(steps[0][0], FEATURES, name)
        assert rows - 1 in touched_rows(steps[1][0], FEATURES, name)
    untouched = [r for r in range(12) if r not in touched_rows(bags0, FEATURES, "a")]
    assert untouched  # lazy and dense differ only if some rows are left out


# --- equal to torch.optim on nn.EmbeddingBag(sparse=True) ---------------------------------------
TORCH_EXACT = [
    pytest.param(lambda p: torch.optim.SGD(p, lr=0.05), id="sgd"),
    pytest.param(lambda p: torch.optim.Adagrad(p, lr=0.2), id="adagrad"),
    pytest.param(
        lambda p: torch.optim.Adagrad(p, lr=0.2, lr_decay=0.3, initial_accumulator_value=0.4, eps=1e-6),
        id="adagrad-lr_decay-init_acc",
    ),
]


@pytest.mark.parametrize("dtype,atol", FP)
@pytest.mark.parametrize("make_opt", TORCH_EXACT)
def test_sgd_adagrad_equal_torch_on_embedding_bag(make_opt, dtype, atol):
    net = Net(dtype=dtype, heads=False)
    ref = RefNet(net, sparse=True)
    opt = he.wrap_optimizer(make_opt(net.parameters()), net)
    ref_opt = make_opt(ref.parameters())
    steps = make_steps(K, seed=1)
    initial = net.ec.weight("a").clone()
    train(net, opt, steps)
    train(ref, ref_opt, steps)
    assert not torch.equal(net.ec.weight("a"), initial)
    assert_same_weights(net, ref, atol=atol)


SPARSE_ADAM = [
    pytest.param(lambda p, **kw: torch.optim.Adam(p, **kw), id="Adam"),
    pytest.param(lambda p, **kw: torch.optim.SparseAdam(p, **kw), id="SparseAdam"),
]


@pytest.mark.parametrize("dtype,atol", FP)
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("make_opt", SPARSE_ADAM)
def test_adam_equals_torch_sparse_adam(make_opt, maximize, dtype, atol):
    kw = dict(lr=0.05, betas=(0.8, 0.95), eps=1e-3, maximize=maximize)
    net = Net(dtype=dtype, heads=False)
    ref = RefNet(net, sparse=True)
    opt = he.wrap_optimizer(make_opt(net.parameters(), **kw), net)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), **kw)
    steps = make_steps(K, seed=2)
    train(net, opt, steps)
    train(ref, ref_opt, steps)
    assert_same_weights(net, ref, atol=atol)


# --- every other optimizer against the per-row reference ----------------------------------------
TORCH_CLASSES = {
    "SGD": torch.optim.SGD,
    "Adagrad": torch.optim.Adagrad,
    "Adam": torch.optim.Adam,
    "AdamW": torch.optim.AdamW,
    "Adamax": torch.optim.Adamax,
    "Adadelta": torch.optim.Adadelta,
    "RMSprop": torch.optim.RMSprop,
}

# (reference name, hyper-parameters, built as torch.optim.X wrapped or passed as sparse=he.optim.X)
ROW_CASES = [
    ("SGD", dict(lr=0.1, momentum=0.9), "torch"),
    ("SGD", dict(lr=0.1, momentum=0.8, nesterov=True), "torch"),
    ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.3), "torch"),
    ("SGD", dict(lr=0.1, weight_decay=0.2), "torch"),
    ("SGD", dict(lr=0.05, maximize=True), "torch"),
    ("SGD", dict(lr=0.1, momentum=0.5, weight_decay=0.1, maximize=True), "sparse"),
    ("Adagrad", dict(lr=0.2, weight_decay=0.3), "torch"),
    ("Adagrad", dict(lr=0.2, lr_decay=0.1, weight_decay=0.1, initial_accumulator_value=0.2, maximize=True), "torch"),
    ("RowWiseAdagrad", dict(lr=0.1, eps=1e-8), "sparse"),
    ("RowWiseAdagrad", dict(lr=0.1, eps=1e-6, weight_decay=0.2, initial_accumulator_value=0.3), "sparse"),
    ("Adam", dict(lr=0.05, betas=(0.8, 0.95), eps=1e-4, weight_decay=0.3), "torch"),
    ("Adam", dict(lr=0.05, weight_decay=0.1, maximize=True), "torch"),
    ("AdamW", dict(lr=0.05, betas=(0.8, 0.95), eps=1e-4, weight_decay=0.5), "torch"),
    ("AdamW", dict(lr=0.05, weight_decay=0.1, maximize=True), "torch"),
    ("AdamW", dict(lr=0.03, betas=(0.7, 0.9), weight_decay=0.2), "sparse"),
    ("Adamax", dict(lr=0.05, betas=(0.8, 0.95)), "torch"),
    ("Adamax", dict(lr=0.05, weight_decay=0.2, maximize=True), "torch"),
    ("Adadelta", dict(lr=1.0), "torch"),
    ("Adadelta", dict(lr=0.5, rho=0.8, eps=1e-4, weight_decay=0.2), "torch"),
    ("RMSprop", dict(lr=0.01, alpha=0.9), "torch"),
    ("RMSprop", dict(lr=0.01, alpha=0.9, centered=True), "torch"),
    ("RMSprop", dict(lr=0.01, alpha=0.9, momentum=0.7), "torch"),
    ("RMSprop", dict(lr=0.01, alpha=0.8, centered=True, momentum=0.5, weight_decay=0.1, maximize=True), "torch"),
    ("RMSprop", dict(lr=0.02, centered=True, momentum=0.3), "sparse"),
    ("Ftrl", dict(lr=0.1), "sparse"),
    ("Ftrl", dict(lr=0.2, l1_regularization_strength=0.2, l2_regularization_strength=0.1), "sparse"),
    ("Ftrl", dict(lr=0.1, l2_shrinkage_regularization_strength=0.2, beta=0.5), "sparse"),
    (
        "Ftrl",
        dict(lr=0.3, learning_rate_power=-0.7, initial_accumulator_value=0.5, l1_regularization_strength=0.01),
        "sparse",
    ),
    ("Ftrl", dict(lr=0.1, learning_rate_power=0.0, l2_regularization_strength=0.3), "sparse"),
]


def _case_id(case):
    name, kw, via = case
    return f"{name}-{via}-" + ",".join(f"{k}={v}" for k, v in kw.items())


@pytest.mark.parametrize("case", ROW_CASES, ids=[_case_id(c) for c in ROW_CASES])
def test_lazy_optimizers_equal_per_row_reference(case):
    name, kw, via = case
    net = Net(heads=False)
    if via == "torch":
        opt = he.wrap_optimizer(TORCH_CLASSES[name](net.parameters(), **kw), net)
    else:
        opt = he.wrap_optimizer(torch.optim.SGD(net.parameters(), lr=1.0), net, sparse=getattr(he.optim, name)(**kw))
    assert {type(o).__name__ for o in opt.sparse_optimizers().values()} == {name}
    hp = full_hparams(name, kw)
    steps = make_steps(K, seed=3)
    ref = run_row_reference(net, steps, {t[0]: (name, hp) for t in TABLES})
    train(net, opt, steps)
    assert_same_weights(net, ref, atol=1e-6, rtol=1e-6)


def test_lazy_update_leaves_untouched_rows_alone():
    """AdamW with weight decay would move every row densely; lazily only touched rows move."""
    net = Net(heads=False)
    before = net.ec.weight("a").clone()
    opt = he.wrap_optimizer(torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.5), net)
    steps = make_steps(1, seed=4)
    train(net, opt, steps)
    touched = touched_rows(steps[0][0], net.feature_map, "a")
    untouched = [r for r in range(12) if r not in touched]
    assert untouched
    assert torch.equal(net.ec.weight("a")[untouched], before[untouched])
    assert not torch.equal(net.ec.weight("a")[touched], before[touched])
