"""The training and evaluation loops of ``hybridembed train`` (plain PyTorch, any model and optimizer).

    python -m pytest -q tests/train/test_models.py

Shape legend: ``B`` batch, ``N`` evaluated examples.

``train_epoch`` runs forward, BCE-with-logits loss, backward and ``optimizer.step`` over
batches; ``evaluate`` returns log loss and AUC. Both take any ``(dense, sparse) -> logits``
model, so the plain-PyTorch baseline and the hybridembed model share them. Batches are read
on the CPU; ``pinned`` (in the reader's thread) and ``to_device`` bring them to the model's
device (``--device cuda``: page-locked, copied with ``non_blocking=True``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .data import Batch
from .metrics import auc, log_loss
from .parallel import ONE, Job

__all__ = ["EpochStats", "EvalStats", "train_epoch", "evaluate", "predict", "pinned", "to_device"]


def pinned(batches: Iterable[Batch]) -> Iterator[Batch]:
    """``batches`` in page-locked memory (run it in the reader's thread, :func:`~.data.prefetch`):
    their copies to a GPU then overlap the step. Needs CUDA."""
    for b in batches:
        yield Batch(b.dense.pin_memory(), b.sparse.pin_memory(), b.label.pin_memory())


def to_device(batches: Iterable[Batch], device: torch.device | str) -> Iterator[Batch]:
    """``batches`` on ``device`` (as they are when already there); pinned ones are copied with
    ``non_blocking=True``."""
    device = torch.device(device)
    for b in batches:
        if b.dense.device == device or (device.index is None and b.dense.device.type == device.type):
            yield b
            continue
        yield Batch(*(t.to(device, non_blocking=t.is_pinned()) for t in (b.dense, b.sparse, b.label)))


@dataclass
class EpochStats:
    loss: float  # mean training loss over the epoch's samples
    rows: int
    steps: int
    seconds: float  # wall time of the loop, reading included

    @property
    def samples_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else float("nan")


@dataclass
class EvalStats:
    loss: float
    auc: float
    rows: int
    seconds: float
    positives: int = 0  # held-out rows labelled 1 (AUC is undefined when none, or all, are)


def train_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Batch],
    on_step: Callable[[int, float | torch.Tensor], None] | None = None,
    job: Job = ONE,
    prefetch: Callable[[Batch], None] | None = None,
    pipeline: Callable[[Batch], None] | None = None,
) -> EpochStats:
    """One pass of ``model`` over ``batches``; ``on_step(rows, loss)`` after every step (``loss``: a
    float, or in one process a 0-d tensor on the model's device, read only when shown).

    In a job of N ranks every rank gets the same global batches and trains on its slice
    (:meth:`Job.part`) with the loss ``sum over the slice * N / B``: averaged over the ranks
    (DDP, the sharded tables), the step is world 1's on the whole batch. ``on_step`` then
    gets the global rows and this rank's loss; the returned loss, rows and time are global.

    ``prefetch(batch)`` gets this rank's part of the next batch before ``optimizer.step``
    (parameter servers: its rows are pulled while this step's gradients are pushed);
    ``pipeline(batch)`` gets it right after this step's forward (sharded tables: its ids are sent
    to their owners while this step's backward and optimizer step run).
    """
    model.train()
    t0 = time.perf_counter()
    loss_sum, rows, steps = 0.0, 0, 0
    loss_acc = None  # one process: the summed loss, on the device
    for b, following in _with_next(batches, prefetch is not None or pipeline is not None):
        if not job.parallel:
            logits = model(b.dense, b.sparse)  # (B,)
            loss = F.binary_cross_entropy_with_logits(logits, b.label)
            value = None
        else:
            mine = job.part(b)  # (B / N) rows
            logits = model(mine.dense, mine.sparse)  # (B / N,)
            total = F.binary_cross_entropy_with_logits(logits, mine.label, reduction="sum")
            loss = total * (job.world / len(b))
            if pipeline is not None and following is not None:
                pipeline(job.part(following))
            value = total.item() / max(len(mine), 1)
        optimizer.zero_grad()
        loss.backward()
        if prefetch is not None and following is not None:
            prefetch(job.part(following))
        optimizer.step()
        if value is None:  # (kept on the device: read only when shown, so a GPU step does not wait for it)
            value = loss.detach()
            loss_acc = value * len(b) if loss_acc is None else loss_acc + value * len(b)
        else:
            loss_sum += value * len(mine)
        rows += len(b)
        steps += 1
        if on_step is not None:
            on_step(len(b), value)
    if loss_acc is not None:
        loss_sum = float(loss_acc)
    seconds = time.perf_counter() - t0
    if job.parallel:
        (loss_sum,) = job.sum(loss_sum)
        (seconds,) = job.max(seconds)
    return EpochStats(loss_sum / rows if rows else float("nan"), rows, steps, seconds)


def _with_next(batches: Iterable[Batch], ahead: bool) -> Iterator[tuple[Batch, Batch | None]]:
    """(batch, the one after it or None); ``ahead`` False: (batch, None), reading no further."""
    if not ahead:
        yield from ((b, None) for b in batches)
        return
    it = iter(batches)
    b = next(it, None)
    while b is not None:
        following = next(it, None)
        yield b, following
        b = following


@torch.no_grad()
def predict(model: nn.Module, batches: Iterable[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (N,), labels (N,)) of ``model`` in eval mode over ``batches``."""
    was_training = model.training
    model.eval()
    logits, labels = [], []
    try:
        for b in batches:
            logits.append(model(b.dense, b.sparse))
            labels.append(b.label)
    finally:
        model.train(was_training)
    if not logits:
        return torch.zeros(0), torch.zeros(0)
    return torch.cat(logits), torch.cat(labels)


def evaluate(model: nn.Module, batches: Iterable[Batch], job: Job = ONE) -> EvalStats:
    """Log loss and AUC of ``model`` over ``batches`` (NaN when there are none).

    In a job of N ranks each predicts its slice of every batch and the predictions of all
    ranks are gathered: the figures are those of the whole ``batches``, on every rank.
    """
    t0 = time.perf_counter()
    logits, labels = predict(model, (job.part(b) for b in batches))  # (E_r,), (E_r,)
    if job.parallel:
        logits, labels = job.gather(logits.float(), labels.float())  # (E,), (E,)
    n = labels.numel()
    loss = log_loss(logits, labels) if n else float("nan")
    positives = int(labels.sum().item()) if n else 0
    return EvalStats(loss, auc(logits, labels) if n else float("nan"), n, time.perf_counter() - t0, positives)
