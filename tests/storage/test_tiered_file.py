"""A tiered table's file (``storage.tiered._File``): scattered rows and runs read and written, runs
longer than one call cut, reads of runs far apart sliced over threads (in a forked child too), a
truncated file a clear error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import hybridembed as he


@pytest.mark.parametrize("numba", [True, False, "parallel"], ids=["numba", "python", "parallel"])
def test_a_file_reads_and_writes_scattered_rows_and_runs_and_a_truncated_file_is_a_clear_error(
    tmp_path, monkeypatch, numba
):
    """``_File``: one call a run of consecutive rows, in Numba's loop or (without Numba) Python's;
    a run longer than one call's bytes is cut; a short read raises, naming the file. ``parallel``:
    every read of 2+ runs cut into slices read by several threads (as runs far apart are)."""
    from hybridembed.storage import tiered as T

    if numba and T._io() is None:
        pytest.skip("Numba does not import here")
    if not numba:
        monkeypatch.setattr(T, "_io", lambda: None)
    if numba == "parallel":
        monkeypatch.setattr(T, "_PARALLEL_RUNS", 2)
        monkeypatch.setattr(T, "_SPARSE_GAP", 0)
        monkeypatch.setattr(T, "_READERS", 3)
        monkeypatch.setattr(T, "_readers", None)
        calls = []
        real = T._io().pread_runs
        monkeypatch.setattr(T._io(), "pread_runs", lambda *a: calls.append(a[2].size) or real(*a))
    monkeypatch.setattr(T, "_CALL_BYTES", 3 * 5 * 4)  # (three rows of 5 float32 per call)
    f = T._File(tmp_path / "f.rows", 64, 5, torch.float32)
    g = torch.Generator().manual_seed(0)
    want = torch.zeros(64, 5)
    for rows in (torch.tensor([9, 3, 4, 5, 6, 7, 8, 40, 63]), torch.randperm(64, generator=g)[:20], torch.arange(2)):
        data = torch.randn(rows.numel(), 5, generator=g)
        f.write(rows, data)
        want[rows] = data
        assert torch.equal(f.read(rows), data)
    assert torch.equal(f.read(torch.arange(64).flip(0)), want.flip(0))
    assert f.read(torch.zeros(0, dtype=torch.int64)).shape == (0, 5)
    if numba == "parallel":
        assert len(calls) > 3 and max(calls) < 20, calls  # (sliced: no call read every run)
    os.truncate(f.path, 40 * 5 * 4)
    with pytest.raises(he.HybridEmbedError, match=r"f\.rows: a short read \(the file was truncated\?\)"):
        f.read(torch.tensor([2, 39, 41]))
    with pytest.raises(he.HybridEmbedError, match="a short read"):  # (the failing run in a later slice)
        f.read(torch.tensor([2, 9, 12, 20, 25, 30, 33, 41, 50]))


_FORKED_READ = r"""
import os, signal, sys, torch
from pathlib import Path
from hybridembed.storage import tiered as T
T._PARALLEL_RUNS, T._SPARSE_GAP = 2, 0
f = T._File(Path(sys.argv[1]), 64, 5, torch.float32)
f.write(torch.arange(64), torch.arange(320.0).view(64, 5))
assert torch.equal(f.read(torch.arange(0, 64, 2)), torch.arange(320.0).view(64, 5)[::2])  # (the pool made)
pid = os.fork()
if pid == 0:
    signal.alarm(30)  # (a hung child ends itself)
    ok = torch.equal(f.read(torch.arange(1, 64, 2)), torch.arange(320.0).view(64, 5)[1::2])
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_reads_on_threads_of_its_own(tmp_path):
    """Sliced reads in a process forked after the readers' pool was made: the child makes its own
    (the parent's has no threads there, and a read sent to it would wait forever)."""
    from hybridembed.storage import tiered as T

    if T._io() is None:
        pytest.skip("Numba does not import here")
    r = subprocess.run(
        [sys.executable, "-c", _FORKED_READ, str(tmp_path / "f")], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr[-2000:]
