"""A distributed training script as users write it, with one fault planted, for the fault tests.

    RANK=r WORLD_SIZE=w MASTER_ADDR=127.0.0.1 MASTER_PORT=p python job_script.py SERVERS FAULTS VICTIM STEP

Each rank trains a small model (two tables, an MLP: ``JOB_MODEL=plain`` for plain torch layers
that ``he.distribute`` converts) for ``JOB_STEPS`` steps (default 6), with the last ``SERVERS``
ranks as parameter servers (0: collective, sharded tables), DDP on (``JOB_DDP=0``: off) and a
job timeout of ``JOB_TIMEOUT`` seconds (default 10), every exchange through shared memory with
``JOB_SHARED=1`` (rows however small), every one through gloo with ``JOB_SHARED=0``. From step ``STEP`` on, rank ``VICTIM``
(a comma-separated list of ranks) meets the comma-separated ``FAULTS``, one per step:

- ``none``: nothing; ``destroy``: every rank ends with ``dist.destroy_process_group()``;
- ``raise``: an unhandled exception; ``kill``: SIGKILL; ``stop``: SIGSTOP (the test kills it);
- ``bad-dtype``, ``bad-missing``, ``bad-extra``, ``bad-weights``, ``bad-type``, ``bad-meta``,
  ``bad-range``, ``bad-offsets``: that rank's batch is malformed; every rank's loop skips a batch
  that raises ``ValueError``.

A rank that ends prints ``RESULT {json}`` (its skipped steps and its tables, gathered); one that
fails leaves its traceback on stderr, as any script. Test code only.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import hybridembed as he
from hybridembed.distributed import unwrap

STEPS = int(os.environ.get("JOB_STEPS", "6"))


class Model(nn.Module):
    """Two tables in an EmbeddingCollection, and an MLP."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ec = he.EmbeddingCollection(
            [he.TableConfig("a", 40, 4), he.TableConfig("b", 30, 4, combiner="mean")], seed=3
        )
        self.mlp = nn.Linear(8, 1)

    def forward(self, x):
        out = self.ec(x)
        return self.mlp(torch.cat([out["a"], out["b"]], 1)).squeeze(1)


class Plain(nn.Module):
    """The same with plain torch layers (converted by he.distribute: their lookups deferred, grouped)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Embedding(40, 4)
        self.b = nn.EmbeddingBag(30, 4, mode="mean")
        self.mlp = nn.Linear(8, 1)

    def forward(self, x):
        b = x["b"]
        return self.mlp(torch.cat([self.a(x["a"]), self.b(b.values, b.offsets[:-1])], 1)).squeeze(1)


def batch(step: int, rank: int) -> tuple[dict, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step``: 4 samples (``a``: one id; ``b``: a bag)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    a = torch.randint(0, 40, (4,), generator=g)
    bags = [torch.randint(0, 30, (n,), generator=g).tolist() for n in (2, 1, 0, 3)]
    return {"a": a, "b": he.Jagged.from_lists(bags)}, torch.rand(4, generator=g)


def malformed(kind: str, x: dict):
    if kind == "bad-dtype":
        return {**x, "a": x["a"].float()}
    if kind == "bad-missing":
        return {"a": x["a"]}
    if kind == "bad-extra":
        return {**x, "c": torch.tensor([1, 2, 3, 4])}
    if kind == "bad-weights":
        b = x["b"]
        return {**x, "b": he.Jagged(b.values, b.offsets, torch.ones(b.values.numel() + 1))}
    if kind == "bad-type":
        return [x["a"], x["b"]]
    if kind == "bad-meta":
        return {**x, "a": torch.empty(4, dtype=torch.int64, device="meta")}
    if kind == "bad-range":
        return {**x, "a": x["a"] + 1000}
    if kind == "bad-offsets":  # (for Plain: offsets past the ids)
        b = x["b"]
        return {**x, "b": he.Jagged(b.values, b.offsets + 100)}
    raise SystemExit(f"unknown fault {kind}")


def main() -> None:
    servers, faults, at = int(sys.argv[1]), sys.argv[2].split(","), int(sys.argv[4])
    victims = {int(v) for v in sys.argv[3].split(",")}
    rank = int(os.environ["RANK"])
    if os.environ.get("JOB_EXIT_CHECK") == "1":  # (runs after the library's own exit handlers: registered first)
        import atexit

        atexit.register(lambda: print(f"AT EXIT initialized={dist.is_initialized()}", flush=True))
    if os.environ.get("JOB_SHARED") == "1":
        from hybridembed.distributed import runtime

        runtime.FOLD_ROWS = 0
    elif os.environ.get("JOB_SHARED") == "0":
        from hybridembed.distributed import shm

        os.environ[shm.ENV] = "0"
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("JOB_TIMEOUT", "10"))))
    ddp = os.environ.get("JOB_DDP", "1") == "1"
    plain = os.environ.get("JOB_MODEL") == "plain"
    model = he.distribute(Plain() if plain else Model(), servers=servers or None, ddp=ddp)
    opt = he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model)
    skipped = []
    for step in range(STEPS):
        x, y = batch(step, rank)
        fault = faults[step - at] if rank in victims and 0 <= step - at < len(faults) else "none"
        if fault == "raise":
            raise RuntimeError("boom in the training loop")
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "stop":
            print(f"STOPPED {time.time()}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        if fault.startswith("bad-"):
            x = malformed(fault, x)
        try:
            loss = nn.functional.mse_loss(model(x), y)
        except ValueError as e:  # (a bad batch is skipped: on every rank, since every rank raises)
            skipped.append([step, type(e).__name__, str(e)[:300]])
            continue
        opt.zero_grad()
        loss.backward()
        opt.step()
    inner = unwrap(model)
    ec = inner.ec if not plain else inner.hybridembed
    names = list(ec.tables)
    tables = {n: ec.gather_table(n).tolist() for n in names}
    print("RESULT " + json.dumps({"rank": rank, "skipped": skipped, "tables": tables}), flush=True)
    if "destroy" in faults:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
