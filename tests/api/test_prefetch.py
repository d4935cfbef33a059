"""``he.prefetch(model, {layer: next input})`` in one process: a converted model's tiered tables read
the next batch's rows ahead (the lookup then reads nothing from disk), in-memory tables ignore it,
what the model's queue held stays, and what is not a converted layer is refused. (A sharded model's
prefetch: tests/distributed/test_pipeline.py.)"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from torch import nn

import hybridembed as he


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.user = nn.Embedding(400, 8)
        self.items = nn.EmbeddingBag(300, 8, mode="mean", padding_idx=0)
        self.head = nn.Linear(16, 1)

    def forward(self, user: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.user(user), self.items(items)], 1)).squeeze(1)


def _batches(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(9)
    return [(torch.randint(0, 400, (16,), generator=g), torch.randint(0, 300, (16, 3), generator=g)) for _ in range(n)]


def _train(model: nn.Module, pipelined: bool) -> nn.Module:
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    if not isinstance(model.user, nn.Embedding):  # (converted)
        opt = he.wrap_optimizer(opt, model)
    batches = _batches()
    if pipelined:
        he.prefetch(model, {"user": batches[0][0], "items": batches[0][1]})
    for i, (u, items) in enumerate(batches):
        loss = model(u, items).pow(2).mean()
        if pipelined and i + 1 < len(batches):
            he.prefetch(model, {"user": batches[i + 1][0], "items": batches[i + 1][1]})
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def test_tiered_tables_read_the_next_batch_ahead_and_train_as_in_memory(tmp_path):
    ref = _train(Two(), pipelined=False)
    for pipelined in (False, True):
        tiered = he.Tiered(tmp_path / str(pipelined), cache_rows=120, mapped=False)  # (mapped: no prefetch)
        model = _train(he.convert(Two(), tiered=tiered), pipelined)
        ec = model.user.collection
        stats = ec.storage_of(model.user.table).stats()
        if pipelined:  # (every row the lookups needed from disk came from the prefetch)
            assert stats["prefetched"] > 0 and stats["disk_reads"] == 0, stats
        else:
            assert stats["disk_reads"] > 0, stats
        for name in ("user", "items"):
            torch.testing.assert_close(ec.weight(getattr(model, name).table), getattr(ref, name).weight.detach())


def test_a_failing_prefetch_is_counted_logged_once_and_the_lookups_read_their_rows(tmp_path, monkeypatch, caplog):
    """A prefetch whose read fails (a disk error in its thread) changes nothing: the lookups read
    their rows themselves (training equals the model in memory), ``stats()["prefetch_failed"]``
    counts the failures, and the first one is logged once."""
    from hybridembed.storage import tiered as T

    read = T._File.read

    def failing(self, rows):
        if threading.current_thread() is not threading.main_thread():
            raise OSError(5, "Input/output error")
        return read(self, rows)

    monkeypatch.setattr(T._File, "read", failing)
    ref = _train(Two(), pipelined=False)
    with caplog.at_level(logging.WARNING, logger="hybridembed"):
        model = _train(he.convert(Two(), tiered=he.Tiered(tmp_path, cache_rows=120, mapped=False)), pipelined=True)
    ec = model.user.collection
    stats = [st.stats() for st in ec.storages]
    assert sum(s["prefetch_failed"] for s in stats) > 0 and sum(s["prefetched"] for s in stats) == 0, stats
    assert sum(s["disk_reads"] for s in stats) > 0, stats
    lines = [r.getMessage() for r in caplog.records if "a prefetch failed" in r.getMessage()]
    assert 1 <= len(lines) <= len(stats) and all("OSError" in x for x in lines), lines
    for name in ("user", "items"):
        torch.testing.assert_close(ec.weight(getattr(model, name).table), getattr(ref, name).weight.detach())


def test_in_memory_tables_ignore_it_and_a_queue_keeps_what_it_held():
    model = he.convert(Two())
    ref = _train(Two(), pipelined=False)
    _train(model, pipelined=True)
    torch.testing.assert_close(model.user.weight, ref.user.weight)
    queue = model.user.collection.lookup_queue
    queue.enter()
    try:  # (inside a forward: a lookup queued, then a prefetch records its own and leaves it queued)
        pending = model.user(torch.tensor([1, 2]))
        he.prefetch(model, {"items": torch.tensor([[1, 2]])})
        assert len(queue) == 1
        torch.testing.assert_close(pending * 1, ref.user.weight[[1, 2]])
    finally:
        queue.exit()


@pytest.mark.parametrize(
    "inputs, match",
    [
        ({"nope": torch.tensor([1])}, "the model has no layer 'nope'"),
        ({"head": torch.tensor([1])}, "'head' is a Linear, not a converted embedding layer"),
        ([("user", torch.tensor([1]))], "inputs must map layer paths"),
    ],
)
def test_what_is_not_a_converted_layer_is_refused(inputs, match):
    with pytest.raises(he.ConfigError, match=match):
        he.prefetch(he.convert(Two()), inputs)


def test_a_bad_next_input_raises_as_the_layer_would():
    with pytest.raises(he.InvalidInputError, match="items"):
        he.prefetch(he.convert(Two()), {"items": torch.tensor([[0.5, 1.0]])})
