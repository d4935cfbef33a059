"""``wrap_optimizer`` / ``HybridOptimizer``: schedulers, param groups, checkpoints, choice of
the sparse optimizer."""

import copy

import pytest
import torch

import hybridembed as he

from .common import (
    TABLES,
    Net,
    RefNet,
    assert_same_weights,
    full_hparams,
    make_steps,
    run_row_reference,
    table_grad,
    train,
)

SUPPORTED = ("SGD", "Adagrad", "Adam", "AdamW", "Adamax", "Adadelta", "RMSprop", "SparseAdam")


def _storage_weights(net):
    return [s.weight for s in net.ec.storages]


def _contains(params, p):
    return any(q is p for q in params)


# --- LR schedulers --------------------------------------------------------------------------------
def test_step_lr_changes_the_embedding_update():
    net = Net()
    ref = RefNet(net, sparse=True)
    opt = he.wrap_optimizer(torch.optim.SGD(net.parameters(), lr=0.05), net)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.1)
    steps = make_steps(5, seed=11)
    for t, (bags, targets) in enumerate(steps):
        lr = 0.05 * 0.1 ** (t // 2)
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([lr] * len(opt.param_groups))
        opt.zero_grad()
        net.loss(bags, targets).backward()
        before = {n: net.ec.weight(n).clone() for n in net.ec.tables}
        grads = {n: table_grad(net, n) for n in net.ec.tables}
        opt.step()
        sched.step()
        for n in net.ec.tables:  # SGD: the change is exactly the scheduled lr times the gradient
            torch.testing.assert_close(before[n] - net.ec.weight(n), lr * grads[n], atol=1e-6, rtol=0)
        train(ref, ref_opt, [(bags, targets)], ref_sched)
        assert_same_weights(net, ref, atol=1e-6)


def test_lambda_lr_adagrad_equals_torch():
    net = Net()
    ref = RefNet(net, sparse=True)
    opt = he.wrap_optimizer(torch.optim.Adagrad(net.parameters(), lr=0.3), net)
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.3)
    steps = make_steps(5, seed=12)
    train(net, opt, steps, torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1 + 2 * e)))
    train(ref, ref_opt, steps, torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda e: 1.0 / (1 + 2 * e)))
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.3 / 11] * 3)
    assert_same_weights(net, ref, atol=1e-6)


# --- param groups -----------------------------------------------------------------------------------
def test_embedding_rows_leave_the_torch_optimizer_and_dense_part_is_plain_torch():
    net = Net()
    ref = RefNet(net, sparse=True)
    torch_opt = torch.optim.Adam(net.parameters(), lr=0.05)
    opt = he.wrap_optimizer(torch_opt, net)
    dense_params = [p for g in torch_opt.param_groups for p in g["params"]]
    for w in _storage_weights(net):
        assert not _contains(dense_params, w)
        assert w not in torch_opt.state
    assert all(_contains(dense_params, p) for p in net.heads.parameters())
    assert len(opt.param_groups) == len(torch_opt.param_groups) + len(net.ec.storages)
    assert all(
        a is b for a, b in zip(opt.param_groups[: len(torch_opt.param_groups)], torch_opt.param_groups, strict=True)
    )
    # reference: torch.optim.Adam on the heads, SparseAdam on nn.EmbeddingBag tables
    ref_dense = torch.optim.Adam(ref.heads.parameters(), lr=0.05)
    ref_sparse = torch.optim.SparseAdam(ref.bags.parameters(), lr=0.05)
    for bags, targets in make_steps(4, seed=13):
        opt.zero_grad()
        net.loss(bags, targets).backward()
        opt.step()
        ref_dense.zero_grad()
        ref_sparse.zero_grad()
        ref.loss(bags, targets).backward()
        ref_dense.step()
        ref_sparse.step()
    assert_same_weights(net, ref, atol=1e-6)


def test_embedding_groups_inherit_the_hyper_parameters_of_their_torch_group():
    net = Net()
    a_weight, c_weight = net.ec.storage_of("a").weight, net.ec.storage_of("c").weight
    torch_opt = torch.optim.SGD(
        [
            {"params": net.heads.parameters(), "lr": 0.02},
            {"params": [a_weight], "lr": 0.1, "momentum": 0.5},
            {"params": [c_weight], "lr": 0.05},
        ],
        lr=0.001,
    )
    opt = he.wrap_optimizer(torch_opt, net)
    got = {n: (o.hparams["lr"], o.hparams["momentum"]) for n, o in opt.sparse_optimizers().items()}
    assert got == {"a": (0.1, 0.5), "b": (0.1, 0.5), "c": (0.05, 0.0)}
    assert [g["lr"] for g in torch_opt.param_groups] == [0.02, 0.1, 0.05]
    assert [len(g["params"]) for g in torch_opt.param_groups] == [4, 0, 0]
    sgd = lambda **kw: ("SGD", full_hparams("SGD", kw))  # noqa: E731
    steps = make_steps(4, seed=14)
    ref = run_row_reference(
        net,
        steps,
        {"a": sgd(lr=0.1, momentum=0.5), "b": sgd(lr=0.1, momentum=0.5), "c": sgd(lr=0.05)},
        dense_opt=lambda p: torch.optim.SGD(p, lr=0.02),
    )
    train(net, opt, steps)
    assert_same_weights(net, ref, atol=1e-6, rtol=1e-6)


def test_sparse_argument_picks_the_table_optimizer():
    net = Net()
    opt = he.wrap_optimizer(torch.optim.Adam(net.parameters(), lr=0.01), net, sparse=he.optim.RowWiseAdagrad(lr=0.05))
    assert {n: type(o).__name__ for n, o in opt.sparse_optimizers().items()} == dict.fromkeys("abc", "RowWiseAdagrad")
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.05, 0.05]
    steps = make_steps(4, seed=15)
    rw = ("RowWiseAdagrad", full_hparams("RowWiseAdagrad", dict(lr=0.05)))
    ref = run_row_reference(net, steps, dict.fromkeys("abc", rw), dense_opt=lambda p: torch.optim.Adam(p, lr=0.01))
    train(net, opt, steps)
    assert_same_weights(net, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("with_sparse", [False, True])
def test_table_config_optimizer_wins_and_gets_its_own_group(with_sparse):
    ftrl_kw = dict(lr=0.1, l1_regularization_strength=0.01, beta=0.2)
    assert Net().ec.groups == [["a", "b"], ["c"]]
    net = Net(optimizers={"a": he.optim.Ftrl(**ftrl_kw)})
    assert net.ec.groups == [["a"], ["b"], ["c"]]
    sparse = he.optim.RowWiseAdagrad(lr=0.05) if with_sparse else None
    opt = he.wrap_optimizer(torch.optim.Adagrad(net.parameters(), lr=0.1), net, sparse=sparse)
    others = ("RowWiseAdagrad", dict(lr=0.05)) if with_sparse else ("Adagrad", dict(lr=0.1))
    assert {n: type(o).__name__ for n, o in opt.sparse_optimizers().items()} == {
        "a": "Ftrl",
        "b": others[0],
        "c": others[0],
    }
    ftrl_group = [g for g in opt.param_groups if g.get("sparse_optimizer") == "Ftrl"]
    assert len(ftrl_group) == 1 and ftrl_group[0]["lr"] == 0.1 and ftrl_group[0]["beta"] == 0.2
    steps = make_steps(4, seed=16)
    table_opts = {
        "a": ("Ftrl", full_hparams("Ftrl", ftrl_kw)),
        "b": (others[0], full_hparams(*others)),
        "c": (others[0], full_hparams(*others)),
    }
    ref = run_row_reference(net, steps, table_opts, dense_opt=lambda p: torch.optim.Adagrad(p, lr=0.1))
    train(net, opt, steps)
    assert_same_weights(net, ref, atol=1e-6, rtol=1e-6)


# --- refused optimizers -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda p: torch.optim.LBFGS(p), id="LBFGS"),
        pytest.param(lambda p: torch.optim.NAdam(p), id="NAdam"),
    ],
)
def test_unsupported_optimizer_is_refused_with_the_supported_list(make):
    net = Net()
    torch_opt = make(net.parameters())
    with pytest.raises(he.ConfigError) as info:
        he.wrap_optimizer(torch_opt, net)
    msg = str(info.value)
    assert type(torch_opt).__name__ in msg
    for name in SUPPORTED:
        assert name in msg
    params = [p for g in torch_opt.param_groups for p in g["params"]]  # nothing was removed
    assert all(_contains(params, w) for w in _storage_weights(net))


def test_amsgrad_is_refused():
    net = Net()
    torch_opt = torch.optim.Adam(net.parameters(), amsgrad=True)
    with pytest.raises(he.ConfigError, match="amsgrad") as info:
        he.wrap_optimizer(torch_opt, net)
    assert "sparse=" in str(info.value)
    params = [p for g in torch_opt.param_groups for p in g["params"]]
    assert all(_contains(params, w) for w in _storage_weights(net))


def test_adam_with_decoupled_weight_decay_is_adamw_or_refused():
    """``torch.optim.Adam(decoupled_weight_decay=True)`` is AdamW; treating it as L2 Adam is wrong."""
    net = Net(heads=False)
    kw = dict(lr=0.05, weight_decay=0.5)
    try:
        opt = he.wrap_optimizer(torch.optim.Adam(net.parameters(), decoupled_weight_decay=True, **kw), net)
    except he.ConfigError:
        return
    steps = make_steps(3, seed=17)
    ref = run_row_reference(net, steps, {t[0]: ("AdamW", full_hparams("AdamW", kw)) for t in TABLES})
    train(net, opt, steps)
    assert_same_weights(net, ref, atol=1e-6, rtol=1e-6)


# --- state_dict ------------------------------------------------------------------------------------
OPTS = {
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.1),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.05, betas=(0.8, 0.9)),
}


@pytest.mark.parametrize("via_file", [False, True])
@pytest.mark.parametrize("name", sorted(OPTS))
def test_checkpoint_resume_is_bit_identical(name, via_file, tmp_path):
    steps = make_steps(6, seed=21)
    whole = Net()
    train(whole, he.wrap_optimizer(OPTS[name](whole.parameters()), whole), steps)

    first = Net()
    opt = he.wrap_optimizer(OPTS[name](first.parameters()), first)
    train(first, opt, steps[:3])
    ckpt = {"model": first.state_dict(), "opt": opt.state_dict()}
    if via_file:
        torch.save(ckpt, tmp_path / "ckpt.pt")
        ckpt = torch.load(tmp_path / "ckpt.pt")
    resumed = Net(seed=5)  # different initial weights: everything must come from the checkpoint
    resumed_opt = he.wrap_optimizer(OPTS[name](resumed.parameters()), resumed)
    resumed.load_state_dict(ckpt["model"])
    resumed_opt.load_state_dict(ckpt["opt"])
    train(resumed, resumed_opt, steps[3:])
    assert_same_weights(resumed, RefNet(whole, sparse=False), atol=0)


def test_state_dict_holds_hyper_parameters_and_restores_a_scheduled_lr():
    steps = make_steps(6, seed=22)
    make = lambda p: torch.optim.SGD(p, lr=0.08, momentum=0.9)  # noqa: E731
    whole = Net()
    whole_opt = he.wrap_optimizer(make(whole.parameters()), whole)
    train(whole, whole_opt, steps, torch.optim.lr_scheduler.StepLR(whole_opt, step_size=2, gamma=0.5))

    first = Net()
    opt = he.wrap_optimizer(make(first.parameters()), first)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    train(first, opt, steps[:3], sched)
    sd = opt.state_dict()
    for t in ("a", "b", "c"):
        assert sd["sparse"][t]["hparams"]["lr"] == pytest.approx(0.04)
        assert sd["sparse"][t]["hparams"]["momentum"] == 0.9
    resumed = Net(seed=5)
    resumed_opt = he.wrap_optimizer(make(resumed.parameters()), resumed)
    resumed.load_state_dict(first.state_dict())
    resumed_opt.load_state_dict(copy.deepcopy(sd))
    assert [g["lr"] for g in resumed_opt.param_groups] == pytest.approx([0.04] * 3)
    assert [g["lr"] for g in resumed_opt.dense.param_groups] == pytest.approx([0.04])
    resumed_sched = torch.optim.lr_scheduler.StepLR(resumed_opt, step_size=2, gamma=0.5)
    resumed_sched.load_state_dict(sched.state_dict())
    train(resumed, resumed_opt, steps[3:], resumed_sched)
    assert [g["lr"] for g in resumed_opt.dense.param_groups] == pytest.approx([0.01])
    assert_same_weights(resumed, RefNet(whole, sparse=False), atol=0)


def test_param_groups_still_drive_the_dense_optimizer_after_load_state_dict():
    net = Net()
    opt = he.wrap_optimizer(torch.optim.SGD(net.parameters(), lr=0.1), net)
    train(net, opt, make_steps(1, seed=23))
    opt.load_state_dict(opt.state_dict())
    for group in opt.param_groups:  # what an LR scheduler does
        group["lr"] = 0.0
    before = RefNet(net, sparse=False)
    train(net, opt, make_steps(1, seed=24))
    assert_same_weights(net, before, atol=0)  # lr 0: nothing may move


def _snapshot(net, opt):
    return (
        {n: p.detach().clone() for n, p in net.state_dict().items()},
        copy.deepcopy(opt.state_dict()),
        [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in opt.param_groups],
    )


def _assert_equal_nested(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_equal_nested(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_equal_nested(x, y)
    else:
        assert a == b


_A, _B, _C = TABLES
MISMATCHED = {
    "missing-table": dict(tables=(_A, _B), features={"f1": "a", "f2": "a", "f3": "b"}),
    "extra-table": dict(
        tables=(*TABLES, ("d", 5, 4, "sum")), features={"f1": "a", "f2": "a", "f3": "b", "f4": "c", "f5": "d"}
    ),
    "different-dim": dict(tables=(("a", 12, 5, "sum"), _B, _C)),
    "different-rows": dict(tables=(("a", 13, 4, "sum"), _B, _C)),
    "different-optimizer": dict(optimizer="Adam"),
}


@pytest.mark.parametrize("case", sorted(MISMATCHED))
def test_load_state_dict_of_a_mismatched_model_raises_and_changes_nothing(case):
    source = Net(heads=False)
    source_opt = he.wrap_optimizer(torch.optim.Adagrad(source.parameters(), lr=0.1), source)
    train(source, source_opt, make_steps(2, seed=25))
    sd = source_opt.state_dict()

    spec = dict(MISMATCHED[case])
    kind = spec.pop("optimizer", "Adagrad")
    target = Net(heads=False, seed=3, **spec)
    target_opt = he.wrap_optimizer(getattr(torch.optim, kind)(target.parameters(), lr=0.3), target)
    train(target, target_opt, make_steps(1, seed=26, **spec))
    before = _snapshot(target, target_opt)
    with pytest.raises(he.HybridEmbedError):
        target_opt.load_state_dict(sd)
    _assert_equal_nested(_snapshot(target, target_opt), before)


def test_wrap_optimizer_refuses_a_model_that_is_not_a_module():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(he.ConfigError, match="nn.Module"):
        he.wrap_optimizer(opt, "model")


def test_the_wrapped_optimizer_s_state_dict_has_torch_optim_s_shape():
    from tests.optim.test_clip_interop import Tower, _batch

    torch.manual_seed(0)
    model = he.convert(Tower())
    opt = he.wrap_optimizer(torch.optim.Adam(model.parameters(), lr=0.01), model)
    for s in range(2):
        users, items, y = _batch(s)
        opt.zero_grad()
        ((model(users, items) - y) ** 2).sum().backward()
        opt.step()
    sd = opt.state_dict()
    assert {"state", "param_groups", "sparse"} <= set(sd)
    assert [g["lr"] for g in sd["param_groups"]] == [0.01] and sd["param_groups"][0]["params"] == [0, 1]
    assert set(sd["state"]) == {0, 1} and set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}  # the dense Linear
    assert set(sd["sparse"]) == {"user", "item"}
    # it loads into a fresh wrapped optimizer (and the earlier shape, checkpoints', still loads)
    again = he.wrap_optimizer(torch.optim.Adam(model.parameters(), lr=0.5), model)
    again.load_state_dict(sd)
    assert again.param_groups[0]["lr"] == 0.01
    torch.testing.assert_close(again.state_dict()["sparse"]["user"]["state"], sd["sparse"]["user"]["state"])
    older = {"dense": {"state": sd["state"], "param_groups": sd["param_groups"]}, "sparse": sd["sparse"], "format": 1}
    he.wrap_optimizer(torch.optim.Adam(model.parameters(), lr=0.5), model).load_state_dict(older)
    # a plain optimizer's state_dict is refused with what to do instead
    with pytest.raises(he.HybridEmbedError, match="opt.dense"):
        again.load_state_dict(torch.optim.Adam(model.parameters()).state_dict())
