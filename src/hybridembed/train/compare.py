"""Plain PyTorch vs the same model after ``he.convert``, trained identically on UCI Adult.

    python benchmarks/adult_auc.py --data ../shared/data/adult.parquet --model wdl

The plain model holds one ``nn.Embedding`` per categorical feature over a vocabulary built
from the training split (index 0: unseen in training) and trains with ``torch.optim``. The
converted model is a copy of it (same initial weights) passed through ``he.convert`` with the
optimizer built by ``he.wrap_optimizer``; both see the same batches in the same order. The
figure compared is the test AUC. With SGD or Adagrad the two differ only by float summation
order (the sparse update equals the dense one: docs/optimizers.md), a difference of ~1e-6 after one
step that training amplifies through ReLU boundaries; with Adam the converted tables get
``SparseAdam``'s lazy update, a different optimizer for rows a batch does not touch.
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

from . import data as D
from . import models as M
from .loop import evaluate, train_epoch

__all__ = ["AdultComparison", "compare_adult"]

OPTIMIZERS = {"adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


@dataclass
class AdultComparison:
    model: str
    optimizer: str
    lr: float
    epochs: int
    batch_size: int
    train_rows: int
    test_rows: int
    plain_auc: float
    converted_auc: float
    plain_loss: float
    converted_loss: float
    plain_seconds: float
    converted_seconds: float
    max_abs_prob_diff: float  # between the two trained models' predicted probabilities on the test split
    mean_abs_prob_diff: float

    @property
    def auc_diff(self) -> float:
        return abs(self.plain_auc - self.converted_auc)

    def as_dict(self) -> dict:
        return {**asdict(self), "auc_diff": self.auc_diff}


def _fit(model: nn.Module, opt: torch.optim.Optimizer, data: D.AdultData, epochs: int, batch: int) -> float:
    t0 = time.perf_counter()
    for epoch in range(epochs):
        train_epoch(model, opt, data.train.batches(batch, epoch))
    return time.perf_counter() - t0


def compare_adult(
    path: str,
    model: str = "wdl",
    epochs: int = 5,
    batch_size: int = 256,
    optimizer: str = "adagrad",
    lr: float = 0.02,
    dim: int = 16,
    seed: int = 0,
    max_train_rows: int | None = None,
) -> AdultComparison:
    """Trains the plain and the converted model identically; returns both test AUCs.

    Raises ``NotImplementedError`` while ``he.convert`` is not available.
    """
    import hybridembed as he

    data = D.load_adult(path, ids="vocab", seed=0, shuffle_seed=seed)
    if max_train_rows is not None:  # a quicker run, for tests
        t = data.train
        data.train = D.TensorSource(
            t.dense[:max_train_rows], t.sparse[:max_train_rows], t.label[:max_train_rows], t.features, True, seed
        )
    plain = M.build(model, data.train.num_dense, data.train.features, dim=dim, vocab_sizes=data.vocab_sizes, seed=seed)
    twin = copy.deepcopy(plain)  # the same initial weights
    cls = OPTIMIZERS[optimizer]

    converted = he.convert(twin)
    conv_opt = he.wrap_optimizer(cls(converted.parameters(), lr=lr), converted)
    plain_opt = cls(plain.parameters(), lr=lr)

    plain_s = _fit(plain, plain_opt, data, epochs, batch_size)
    conv_s = _fit(converted, conv_opt, data, epochs, batch_size)
    ev_plain = evaluate(plain, data.test.batches(8192))
    ev_conv = evaluate(converted, data.test.batches(8192))
    with torch.no_grad():
        plain.eval()
        converted.eval()
        t = data.test
        diff = (torch.sigmoid(plain(t.dense, t.sparse)) - torch.sigmoid(converted(t.dense, t.sparse))).abs()
    return AdultComparison(
        model=model,
        optimizer=optimizer,
        lr=lr,
        epochs=epochs,
        batch_size=batch_size,
        train_rows=len(data.train),
        test_rows=len(data.test),
        plain_auc=ev_plain.auc,
        converted_auc=ev_conv.auc,
        plain_loss=ev_plain.loss,
        converted_loss=ev_conv.loss,
        plain_seconds=plain_s,
        converted_seconds=conv_s,
        max_abs_prob_diff=diff.max().item(),
        mean_abs_prob_diff=diff.mean().item(),
    )
