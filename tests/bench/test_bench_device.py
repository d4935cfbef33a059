"""``hybridembed bench --device``, ``--kernels`` and ``--full-size``: refused clearly where they cannot
run, passed to every contender where they can (the CUDA run skips without a GPU).

    python -m pytest -q tests/bench/test_bench_device.py
"""

from __future__ import annotations

import json

import pytest
import torch

from hybridembed.bench import cli, models, timing
from hybridembed.kernels import backend

TINY_RUN = ["--max-rows", "1000", "--batch", "64", "--steps", "2", "--warmup", "1", "--threads", "1"]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hybridembed bench: error: "), err
    return err[0]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--device", "mps"], "--device mps: expected cpu, cuda or cuda:N"),
        (["--full-size", "--quick"], "--full-size runs without a row cap; drop --quick"),
        (["--full-size", "--max-rows", "10"], "--full-size runs without a row cap; drop --max-rows"),
        (["--model", "train-e2e", "--full-size"], "--full-size applies to the synthetic models"),
    ],
)
def test_flags_that_cannot_run_exit_2_with_one_line(argv, needle, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_bench_model", lambda *a: pytest.fail("ran"))
    assert cli.main([*argv, "--json", str(tmp_path / "b.json")]) == 2
    assert needle in _error(capsys)
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_cuda_without_cuda_is_refused(tmp_path, capsys):
    assert cli.main(["--device", "cuda", "--json", str(tmp_path / "b.json")]) == 2
    assert "--device cuda: CUDA is not available" in _error(capsys)


def test_triton_kernels_without_triton_are_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    assert cli.main(["--kernels", "triton", "--json", str(tmp_path / "b.json")]) == 2
    assert "--kernels triton" in _error(capsys) and not any(tmp_path.iterdir())


def test_full_size_runs_uncapped_at_the_published_batch(tmp_path, monkeypatch):
    seen = {}

    def bench_model(name, args, anchors, notes):
        seen.update(name=name, max_rows=args.max_rows, batch=cli._batch_size(models.workloads(name)[0], args))
        return []

    monkeypatch.setattr(cli, "_bench_model", bench_model)
    monkeypatch.setattr(cli, "_check_fits", lambda *a: None)
    monkeypatch.setattr(cli, "cpu_busy", lambda: None)
    assert cli.main(["--model", "tiny", "--full-size", "--json", str(tmp_path / "b.json")]) == 0
    assert seen == {"name": "tiny", "max_rows": None, "batch": 65_536}


def test_full_size_tiny_that_does_not_fit_is_refused_naming_its_size(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "meminfo", lambda key: 8 * 2**30)
    monkeypatch.setattr(models, "build_model", lambda *a, **k: pytest.fail("allocated"))
    assert cli.main(["--model", "tiny", "--full-size", "--anchors", "floor", "--json", str(tmp_path / "b.json")]) == 2
    line = _error(capsys)
    assert "tiny at full size needs ~12.6 GiB" in line  # rows and Adagrad state 8.4, the floor's rows 4.2
    assert "use --max-rows 3125000 (without --full-size)" in line


def test_cuda_timing_synchronizes_around_every_call(monkeypatch):
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    timing.time_interleaved({"a": lambda: events.append("a")}, steps=2, warmup=1, device="cuda:0")
    assert events == ["a", "sync", "a", "sync", "sync", "a", "sync"]
    events.clear()
    timing.time_interleaved({"a": lambda: events.append("a")}, steps=1, warmup=0, device="cpu")
    assert events == ["a"]


def test_cpu_run_records_its_device_and_kernels(tmp_path):
    out = tmp_path / "b.json"
    argv = ["--model", "tiny", "--quick", *TINY_RUN, "--device", "cpu", "--kernels", "eager", "--anchors", "floor"]
    assert cli.main([*argv, "--json", str(out), "--png", str(tmp_path / "b.png")]) == 0
    results = json.loads(out.read_text())
    s = results["settings"]
    assert (s["device"], s["kernels"], s["kernels_resolved"], s["full_size"]) == ("cpu", "eager", "eager", False)
    assert results["runs"][0]["device"] == "cpu" and "gpu" not in results["machine"]


@cuda
def test_cuda_run_times_every_contender_on_the_gpu(tmp_path):
    out = tmp_path / "b.json"
    argv = ["--model", "tiny", "--quick", *TINY_RUN, "--device", "cuda", "--anchors", "per_table,torchrec,floor"]
    assert cli.main([*argv, "--json", str(out), "--png", str(tmp_path / "b.png")]) == 0
    results = json.loads(out.read_text())
    (run,) = results["runs"]
    assert set(run["contenders"]) == {"hybridembed", "per_table"} and "torchrec" in results["skipped"]
    assert results["machine"]["gpu"] and run["contenders"]["per_table"]["max_abs_diff_vs_hybridembed"]["after"] < 1e-3
