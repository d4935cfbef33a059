"""Parameter servers under faults (spawned gloo jobs: 2 trainers + 1 server): 1,000 malformed
requests over gloo, then training that equals one process; a server killed or hung mid-step
fails every trainer with ServerLost naming it (at once, or within ps_timeout); a restart from
the last checkpoint loses nothing committed; a refused push fails its trainer at its next wait.
Trainers report through files where the server's death fails the job as a whole."""

from __future__ import annotations

import math
import os
import pickle
import random
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hybridembed as he
from hybridembed.distributed import unwrap
from hybridembed.launch import SpawnError, spawn
from hybridembed.ps import ServerLost, transport, wire
from hybridembed.train.multiproc import _LOST_PEER
from tests.ps.test_wire import TABLES, _named_cases, _pull, _random_cases

T = 2  # trainers; rank 2 serves


class M(nn.Module):
    """The tables of test_wire (so its malformed requests address the same shards) and an MLP;
    ``poison``: the embeddings' gradient becomes nan (a diverged model)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ec = he.EmbeddingCollection(TABLES, seed=5)
        self.mlp = nn.Linear(16, 1)
        self.poison = False

    def forward(self, x):
        out = self.ec(x)
        emb = torch.cat([out["a"], out["b"], out["q"]], 1)  # (B, 16)
        if self.poison and emb.requires_grad:
            emb.register_hook(lambda g: torch.full_like(g, math.nan))
        return self.mlp(emb).squeeze(1)


def _batch(step: int, lo: int = 0, hi: int = 8):
    g = torch.Generator().manual_seed(100 + step)
    x = {
        "a": torch.randint(0, 100, (8, 2), generator=g),
        "b": torch.randint(0, 50, (8,), generator=g),
        "q": torch.randint(-5, 5, (8,), generator=g) * 1_000_003,
    }
    return {k: v[lo:hi] for k, v in x.items()}, torch.rand(8, generator=g)[lo:hi]


def _opt(model):
    return he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model)


def _step(model, opt, step: int, rank: int | None) -> None:
    x, y = _batch(step) if rank is None else _batch(step, 4 * rank, 4 * rank + 4)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _reference(steps: int) -> dict:
    model = M()
    opt = _opt(model)
    for s in range(steps):
        _step(model, opt, s, None)
    ids, rows = model.ec.dynamic_rows("q")
    o = torch.argsort(ids)
    return {"a": model.ec.weight("a"), "b": model.ec.weight("b"), "q": (ids[o], rows[o]), "mlp": model.mlp.weight}


def _tables(model) -> dict:
    ec = unwrap(model).ec
    return {n: ec.gather_table(n) for n in ("a", "b", "q")} | {"mlp": unwrap(model).mlp.weight.detach().clone()}


def _close(got: dict, want: dict) -> None:
    for k in ("a", "b", "mlp"):
        torch.testing.assert_close(got[k], want[k].detach(), atol=1e-5, rtol=1e-5, msg=k)
    assert torch.equal(got["q"][0], want["q"][0])
    torch.testing.assert_close(got["q"][1], want["q"][1].detach(), atol=1e-5, rtol=1e-5)


# --- (a) malformed requests over gloo -------------------------------------------------------------
def _frame(h: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
    """A request's frame as :func:`wire.frame` builds it, around any header and payload."""
    nonce = torch.tensor([random.getrandbits(62) + 1], dtype=torch.int64).view(torch.uint8)
    return torch.cat([nonce, h.contiguous().view(torch.uint8), *([] if p is None else [p]), nonce])


def _sendable(n: int):
    """(header, payload or None) of ``n`` malformed requests a trainer can put on the wire as the
    protocol frames them: 8 int64, then the payload the header declares (none if it fails its
    check). Frames of another size than declared are tested below and in one process (test_wire)."""
    out = []
    named = [(h, p) for _, src, h, p, _ in _named_cases(None) if src == 5]
    rng = random.Random(99)
    for h, p in named + [(h, p) for _, h, p in _random_cases(rng, 2 * n, done=0)]:
        if h.numel() * h.element_size() != 8 * wire.HEAD:
            continue
        h = h.contiguous().view(torch.int64)
        try:
            nbytes = wire.check_header(h, 1 << 16)
        except wire.WireError:
            out.append((h, None))
            continue
        if (
            nbytes == 0
            and p is None
            or p is not None
            and p.dim() == 1
            and p.dtype == torch.uint8
            and p.numel() == nbytes
        ):
            out.append((h, p))
    assert len(out) >= n
    return out[:n]


def _flood_then_train(rank: int, world: int, idle: float) -> dict:
    if rank == world - 1:  # the server: the most reply sends it ever held (memory stays bounded)
        reply, most = transport.ServerLink.reply, [0]

        def counted(self, dst, m):
            n = reply(self, dst, m)
            most[0] = max(most[0], max(map(len, self.sends.works.values())))
            return n

        transport.ServerLink.reply = counted
    model = he.distribute(M(), servers=1, server_exit=False, ps_timeout=idle - 1.5, max_request_bytes=1 << 16)
    if model is None:
        return {"server": True, "most_sends": most[0]}
    opt = _opt(model)
    ec = unwrap(model).ec
    out = {}
    if rank == 0:
        link = ec.client.links[2]
        t0 = time.monotonic()
        for h, p in _sendable(1000):
            dist.send(_frame(h, p), 2, group=link.group, tag=transport.REQ)
            r = link.recv()
            assert r.op == wire.ERROR and r.req == max(int(h[2]), 0), (h.tolist(), r)
            assert r.meta["error"].startswith("server rank 2: ")
        out["flood_s"] = time.monotonic() - t0
        # frames that do not end where their header says (gloo fills the buffer's head and says
        # nothing): a payload 8 bytes short, one 8 bytes long, a header of 9 int64, of 7, of none
        h, p = wire.pack(_pull(0, [(0, [1, 2]), (2, [7])], seen=[1]))
        longer = torch.cat([h, torch.tensor([wire.MAGIC])])
        frames = [_frame(h, p[:-8]), _frame(h, torch.cat([p, p[:8]])), _frame(longer, p), _frame(h[:7], p)]
        frames.append(torch.tensor([3], dtype=torch.int64).view(torch.uint8))
        # a goodbye whose payload does not parse: refused, and the trainer is still served
        bye = torch.tensor([wire.MAGIC, wire.BYE, 77, 0, 0, 0, 4, -1])
        frames.append(_frame(bye, torch.frombuffer(bytearray(b"{{{{"), dtype=torch.uint8)))
        out["framing"] = []
        for f in frames:
            dist.send(f, 2, group=link.group, tag=transport.REQ)
            out["framing"].append(link.recv().meta.get("error", ""))
        out["errors"] = ec.server_stats()[0]["errors"]
    dist.barrier(model.process_group)
    for s in range(10):
        _step(model, opt, s, rank)
    time.sleep(idle)  # (longer than ps_timeout without a request: the server waits on)
    for s in range(10, 20):
        _step(model, opt, s, rank)
    out["tables"] = _tables(model)
    out["sends"] = len(ec.client.links[2].sends)
    out["stash"] = len(ec.client._stash)
    out["errors_after"] = ec.server_stats()[0]["errors"]
    return out


def test_malformed_requests_over_gloo_then_training_equals_one_process():
    results = spawn(_flood_then_train, T + 1, 4.5, timeout=120)
    first, server = results[0], results[2]
    assert first["errors"] == 1006 and first["errors_after"] == 1006  # (1,000 malformed, 5 misframed, a bad bye)
    short, long, head9, head7, bare, bye = first["framing"]
    assert "meta is not JSON" in bye, bye
    for text in (short, long, head9):
        assert "does not end where its header says" in text, first["framing"]
    assert "bad magic" in head7 or "does not end" in head7, head7
    assert "bad magic" in bare, bare
    want = _reference(20)
    for r in results[:T]:
        _close(r["tables"], want)
        assert r["sends"] <= transport._Sends.KEEP and r["stash"] == 0  # (sends were 80 after 20 steps)
    assert 0 < server["most_sends"] <= transport._Sends.KEEP + 1  # (was every reply: 2,000 and more)


# --- (b) a server killed or hung mid-step ---------------------------------------------------------
def _stop_after(pushes: int, sig: int, path: str) -> None:
    """In the server: after ``pushes`` pushes, write (pid, time) and send itself ``sig``."""
    from hybridembed.ps.server import TableServer

    handle, seen = TableServer.handle, [0]

    def stopping(self, src, header, payload):
        if header.numel() == wire.HEAD and int(header[1]) == wire.PUSH:
            seen[0] += 1
            if seen[0] == pushes:
                Path(path, "server").write_bytes(pickle.dumps((os.getpid(), time.time())))
                os.kill(os.getpid(), sig)
        return handle(self, src, header, payload)

    TableServer.handle = stopping


def _report(path: str, rank: int, e: BaseException) -> None:
    Path(path, f"trainer{rank}").write_bytes(
        pickle.dumps({"type": type(e).__name__, "lost": isinstance(e, ServerLost), "text": str(e), "t": time.time()})
    )


def _lose_server(rank: int, world: int, path: str, sig: int, timeout: float) -> dict:
    if rank == world - 1:
        _stop_after(3, sig, path)  # (the first push of step 1)
    model = he.distribute(M(), servers=1, server_exit=False, ps_timeout=timeout)
    if model is None:
        return {"server": True}
    opt = _opt(model)
    try:
        for s in range(5):
            _step(model, opt, s, rank)
    except Exception as e:
        _report(path, rank, e)
        if sig == signal.SIGSTOP and rank == 0:  # (a hung server is ended by hand)
            os.kill(pickle.loads(Path(path, "server").read_bytes())[0], signal.SIGKILL)
        return {}
    raise AssertionError("training went on without its server")


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_lost_server_fails_every_trainer_naming_it(tmp_path, how):
    sig, timeout = (signal.SIGKILL, 60.0) if how == "killed" else (signal.SIGSTOP, 3.0)
    with pytest.raises(SpawnError, match="rank 2 died"):
        spawn(_lose_server, T + 1, str(tmp_path), sig, timeout, timeout=60, grace=5)
    _, stopped = pickle.loads((tmp_path / "server").read_bytes())
    for r in range(T):
        got = pickle.loads((tmp_path / f"trainer{r}").read_bytes())
        assert got["lost"], got
        assert "parameter server rank 2" in got["text"] and "ps_timeout" in got["text"]
        waited = got["t"] - stopped
        if how == "killed":  # a dead server fails the wait at once, long before ps_timeout
            assert "is gone" in got["text"] and waited < 10, got
        else:
            assert "did not answer within the timeout" in got["text"], got
            assert timeout - 0.5 < waited < timeout + 10, got


# --- (c) a restart from the last checkpoint -------------------------------------------------------
def _train_save_die(rank: int, world: int, path: str) -> dict:
    if rank == world - 1:
        _stop_after(7, signal.SIGKILL, path)  # (the first push of step 3)
    model = he.distribute(M(), servers=1, server_exit=False, ps_timeout=60.0)
    if model is None:
        return {"server": True}
    opt = _opt(model)
    try:
        for s in range(2):
            _step(model, opt, s, rank)
        he.save(os.path.join(path, "ckpt"), model, opt)
        dist.barrier(model.process_group)
        for s in range(2, 5):
            _step(model, opt, s, rank)
    except Exception as e:
        _report(path, rank, e)
        return {}
    raise AssertionError("training went on without its server")


def _resume(rank: int, world: int, path: str) -> dict:
    model = he.distribute(M(), servers=1, server_exit=False)
    if model is None:
        return {"server": True}
    opt = _opt(model)
    he.load(os.path.join(path, "ckpt"), model, opt)
    dist.barrier(model.process_group)
    for s in range(2, 4):
        _step(model, opt, s, rank)
    return _tables(model)


def test_a_restart_from_the_last_checkpoint_loses_nothing_committed(tmp_path):
    with pytest.raises(SpawnError, match="rank 2 died"):
        spawn(_train_save_die, T + 1, str(tmp_path), timeout=60, grace=5)
    assert all(pickle.loads((tmp_path / f"trainer{r}").read_bytes())["lost"] for r in range(T))
    want = _reference(4)
    for r in spawn(_resume, T + 1, str(tmp_path), timeout=60)[:T]:
        _close(r, want)


# --- (d) a push the server refuses ----------------------------------------------------------------
def _diverge(rank: int, world: int) -> dict:
    model = he.distribute(M(), servers=1, server_exit=False, ps_timeout=60.0)
    if model is None:
        return {"server": True}
    opt = _opt(model)
    try:
        for s in range(4):
            unwrap(model).poison = rank == 0 and s == 1
            _step(model, opt, s, rank)
    except Exception as e:
        return {"step": s, "type": type(e).__name__, "text": str(e)}
    return {"step": None}


def test_a_refused_push_fails_its_trainer_at_its_next_wait():
    t0 = time.monotonic()
    first, second, _ = spawn(_diverge, T + 1, timeout=60)
    assert time.monotonic() - t0 < 50  # (nobody waited for ps_timeout)
    assert first["step"] == 2 and first["type"] == "HybridEmbedError", first  # (the push of step 1 was refused)
    assert "server rank 2: trainer 0's push of step 1 holds non-finite gradients" in first["text"]
    # trainer 1 fails at the same step, told by the server why, or by its DDP all-reduce with the
    # departed trainer 0 (whichever comes first: both end it without waiting; gloo says "closed" or
    # "reset" as the departed process's socket had data left unread or not)
    assert second["step"] == 2, second
    assert any(m in second["text"] for m in ("trainer 0 left the job", *_LOST_PEER)), second
