"""he.optim refuses the hyper-parameters torch.optim refuses (and wrongly typed ones) with a
``ConfigError`` naming the value, instead of writing NaN into the rows later.

Run: python -m pytest -q tests/optim/test_hyperparameters.py
"""

import pytest
import torch

import hybridembed as he
from hybridembed import optim as ho

INF, NAN = float("inf"), float("nan")

# (optimizer, hyper-parameters, text the message must hold): torch.optim refuses each
# (its own ValueError) or would write NaN / divide by zero
BAD = {
    "adagrad-negative-initial-accumulator": (ho.Adagrad, {"initial_accumulator_value": -1.0}, "-1.0"),
    "adagrad-negative-lr-decay": (ho.Adagrad, {"lr_decay": -0.5}, "lr_decay"),
    "adagrad-negative-eps": (ho.Adagrad, {"eps": -1e-10}, "eps"),
    "rowwise-negative-initial-accumulator": (ho.RowWiseAdagrad, {"initial_accumulator_value": -0.1}, "-0.1"),
    "adadelta-rho-above-one": (ho.Adadelta, {"rho": 1.5}, "1.5"),
    "adadelta-negative-rho": (ho.Adadelta, {"rho": -0.1}, "rho"),
    "rmsprop-negative-alpha": (ho.RMSprop, {"alpha": -0.5}, "alpha"),
    "rmsprop-negative-momentum": (ho.RMSprop, {"momentum": -0.9}, "momentum"),
    "sgd-negative-momentum": (ho.SGD, {"momentum": -0.9}, "momentum"),
    "sgd-negative-weight-decay": (ho.SGD, {"weight_decay": -1e-4}, "weight_decay"),
    "sgd-negative-lr": (ho.SGD, {"lr": -0.1}, "lr"),
    "ftrl-zero-lr": (ho.Ftrl, {"lr": 0.0}, "lr"),
    "ftrl-negative-initial-accumulator": (ho.Ftrl, {"initial_accumulator_value": -0.1}, "-0.1"),
    "adam-beta-one": (ho.Adam, {"betas": (0.9, 1.0)}, "betas"),
    "adam-negative-beta": (ho.Adam, {"betas": (-0.1, 0.999)}, "betas"),
    "adamax-beta-above-one": (ho.Adamax, {"betas": (1.5, 0.999)}, "betas"),
    "adamw-negative-eps": (ho.AdamW, {"eps": -1e-8}, "eps"),
    "adam-nan-lr": (ho.Adam, {"lr": NAN}, "nan"),
    "sgd-inf-lr": (ho.SGD, {"lr": INF}, "inf"),
    # wrongly typed: TypeError / torch errors before
    "adam-betas-scalar": (ho.Adam, {"betas": 0.9}, "0.9"),
    "adam-betas-three": (ho.Adam, {"betas": (0.9, 0.99, 0.999)}, "betas"),
    "adam-betas-str": (ho.Adam, {"betas": ("0.9", "0.999")}, "betas"),
    "adagrad-lr-str": (ho.Adagrad, {"lr": "0.1"}, "'0.1'"),
    "rmsprop-alpha-none": (ho.RMSprop, {"alpha": None}, "None"),
    "sgd-momentum-bool": (ho.SGD, {"momentum": True}, "True"),
    "sgd-nesterov-str": (ho.SGD, {"nesterov": "yes"}, "'yes'"),
    "rmsprop-centered-int": (ho.RMSprop, {"centered": 1}, "centered"),
    "adam-maximize-none": (ho.Adam, {"maximize": None}, "maximize"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_hyper_parameters_raise_config_error_naming_the_value(case):
    cls, hp, text = BAD[case]
    with pytest.raises(he.ConfigError) as info:
        cls(**hp)
    assert isinstance(info.value, ValueError)
    assert text in str(info.value) and cls.__name__ in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "make",
    [
        lambda: ho.Adagrad(initial_accumulator_value=0.0, lr_decay=0.0, eps=0.0),
        lambda: ho.Adadelta(rho=1.0),
        lambda: ho.Adadelta(rho=0.0),
        lambda: ho.RMSprop(alpha=0.0, momentum=0.0),
        lambda: ho.SGD(lr=0, momentum=0.9, nesterov=True),
        lambda: ho.Adam(betas=[0.0, 0.5]),
        lambda: ho.Ftrl(lr=1e-9, initial_accumulator_value=0.0),
    ],
)
def test_edge_values_torch_accepts_are_accepted(make):
    make()


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.Adam(p, lr=torch.tensor(0.01), betas=(torch.tensor(0.8), torch.tensor(0.9))),
        lambda p: torch.optim.Adagrad(p, lr=torch.tensor(0.1)),
    ],
)
def test_wrap_optimizer_takes_torch_tensor_hyper_parameters(make):
    ec = he.EmbeddingCollection([he.TableConfig("a", 5, 4)])
    opt = he.wrap_optimizer(make(ec.parameters()), ec)
    hp = opt.sparse_optimizers()["a"].hparams
    assert all(type(v) is float for v in [hp["lr"], *hp.get("betas", ())])
    ec({"a": torch.tensor([1, 2])})["a"].sum().backward()
    opt.step()
    assert bool(torch.isfinite(ec.weight("a")).all())
