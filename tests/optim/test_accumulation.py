"""Gradient accumulation over several backward passes, and ``he.clip_grad_norm_`` over dense
and sparse gradients, against plain torch references."""

import math

import pytest
import torch

import hybridembed as he

from .common import Net, RefNet, assert_same_weights, concat_steps, make_steps, table_grad


class _Both:
    """Two torch optimizers stepped together (dense heads + sparse tables)."""

    def __init__(self, *opts):
        self.opts = opts

    def zero_grad(self):
        for o in self.opts:
            o.zero_grad()

    def step(self):
        for o in self.opts:
            o.step()


# (wrapped torch optimizer, reference optimizer on RefNet(sparse=True))
ACCUMULATE = {
    "SGD": (lambda p: torch.optim.SGD(p, lr=0.03), lambda ref: torch.optim.SGD(ref.parameters(), lr=0.03)),
    "Adagrad": (
        lambda p: torch.optim.Adagrad(p, lr=0.2, lr_decay=0.1),
        lambda ref: torch.optim.Adagrad(ref.parameters(), lr=0.2, lr_decay=0.1),
    ),
    "Adam": (
        lambda p: torch.optim.Adam(p, lr=0.05, betas=(0.8, 0.9)),
        lambda ref: _Both(
            torch.optim.Adam(ref.heads.parameters(), lr=0.05, betas=(0.8, 0.9)),
            torch.optim.SparseAdam(ref.bags.parameters(), lr=0.05, betas=(0.8, 0.9)),
        ),
    ),
}


@pytest.mark.parametrize("micro", [2, 3])
@pytest.mark.parametrize("name", sorted(ACCUMULATE))
def test_accumulated_micro_batches_equal_one_step_on_the_concatenated_batch(name, micro):
    make, make_ref = ACCUMULATE[name]
    net = Net()
    ref = RefNet(net, sparse=True)
    opt = he.wrap_optimizer(make(net.parameters()), net)
    ref_opt = make_ref(ref)
    batches = make_steps(2 * micro, seed=31)
    for k in range(2):  # two optimizer steps
        group = batches[k * micro : (k + 1) * micro]
        opt.zero_grad()
        for bags, targets in group:
            net.loss(bags, targets).backward()
        opt.step()
        ref_opt.zero_grad()
        ref.loss(*concat_steps(group)).backward()
        ref_opt.step()
    assert_same_weights(net, ref, atol=1e-6, rtol=1e-6)


# --- clip_grad_norm_ -----------------------------------------------------------------------------
def _backward(net, ref, passes, seed):
    for bags, targets in make_steps(passes, seed=seed):
        net.loss(bags, targets).backward()
        ref.loss(bags, targets).backward()


def _assert_same_grads(net, ref, atol, rtol):
    for name in net.ec.tables:
        torch.testing.assert_close(table_grad(net, name), ref.bags[name].weight.grad, atol=atol, rtol=rtol)
    for p, q in zip(net.heads.parameters(), ref.heads.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=atol, rtol=rtol)


@pytest.mark.parametrize("form", ["module", "params"])
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_grad_norm_equals_torch_on_a_dense_model(norm_type, max_norm, passes, form):
    net = Net()
    ref = RefNet(net, sparse=False)  # same weights, dense gradients
    _backward(net, ref, passes, seed=32)
    if passes == 2:  # two backward passes: the sparse gradient holds duplicated rows
        grad = net.ec.storage_of("a").weight.grad
        assert grad.is_sparse and not grad.is_coalesced()
    total = he.clip_grad_norm_(net if form == "module" else list(net.parameters()), max_norm, norm_type)
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
    torch.testing.assert_close(total, ref_total, atol=0, rtol=1e-6)
    if max_norm < 1e6:
        assert float(ref_total) > max_norm  # the case really clips
    _assert_same_grads(net, ref, atol=1e-7, rtol=1e-6)


def test_clip_grad_norm_float64():
    net = Net(dtype=torch.float64)
    ref = RefNet(net, sparse=False)
    _backward(net, ref, 2, seed=33)
    total = he.clip_grad_norm_(net, 0.5)
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    assert float(total) == pytest.approx(float(ref_total), rel=1e-12, abs=0)
    _assert_same_grads(net, ref, atol=1e-14, rtol=1e-12)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda p: torch.optim.SGD(p, lr=0.05), id="SGD"),
        pytest.param(lambda p: torch.optim.Adagrad(p, lr=0.1), id="Adagrad"),
    ],
)
def test_step_after_clipping_equals_torch(make):
    net = Net()
    ref = RefNet(net, sparse=False)
    opt = he.wrap_optimizer(make(net.parameters()), net)
    ref_opt = make(ref.parameters())  # dense: untouched rows have gradient 0 and do not move
    for k in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        _backward(net, ref, 2, seed=40 + k)
        he.clip_grad_norm_(net, 1.0)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        ref_opt.step()
    assert_same_weights(net, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("max_norm", [-1.0, float("inf"), float("nan"), "1"])
def test_clip_grad_norm_refuses_a_bad_max_norm(max_norm):
    with pytest.raises(he.ConfigError):
        he.clip_grad_norm_(torch.nn.Linear(2, 2), max_norm)
