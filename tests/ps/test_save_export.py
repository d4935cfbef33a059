"""A parameter-server job (2 trainers + 1 server, spawned) saves in the background and exports:
the background save commits (its second process group is made by trainers and servers alike)
and loads in one process; ``he.export`` on the trainers writes a file that serves the trained
model (the servers take no part in its report)."""

from __future__ import annotations

import torch

import hybridembed as he
from hybridembed.launch import spawn
from tests.distributed.test_checkpoint import _close, _snapshot
from tests.ps.test_sync import Shared, T, _shared_batch, _train_shared


def _train_save_export(rank: int, world: int, path: str, export: str) -> dict:
    model = he.distribute(Shared(), servers=world - T, server_exit=False)
    if model is None:
        return {"server": True}
    opt = _train_shared(model, 3, rank * 4, rank * 4 + 4)
    he.save(path, model, opt, incremental=True, background=True).wait()
    snapshot = _snapshot(model)
    x, _ = _shared_batch(7, 0, 8)
    he.export(model, export, (x,))
    return snapshot


def test_a_background_save_and_an_export_of_a_parameter_server_job(tmp_path):
    path, export = str(tmp_path / "ckpt"), str(tmp_path / "model.pt")
    trained, _, server = spawn(_train_save_export, T + 1, path, export, timeout=120, pg_timeout=30)
    assert server == {"server": True}
    model = Shared()
    he.load(path, model)
    _close(_snapshot(model), trained, 1e-6)
    x, _ = _shared_batch(7, 0, 8)
    with torch.no_grad():
        want = model.eval()(x)
    torch.testing.assert_close(torch.jit.load(export)(x), want, atol=1e-5, rtol=1e-5)
