"""``hybridembed bench``: runs on tiny configurations, JSON shape, memory accounting, flag errors.

    python -m pytest -q tests/bench

No timing is asserted: the figures only have to be positive and finite.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from hybridembed import cli as top
from hybridembed.bench import cli, models
from hybridembed.bench.models import MODELS, SamePool1d, default_batch, expand, memory, scale, workloads

# NVIDIA's synthetic models page: (tables, GiB of rows, ids per sample or None where not published)
PUBLISHED = {
    "tiny": (55, 4.2, 85),
    "small": (107, 26.3, 377),
    "medium": (311, 206.2, 1611),
    "large": (612, 773.8, 6312),
    "jumbo": (1022, 3109.5, 16022),
    "colossal": (2002, 22327.4, None),
}
# one thread: a second one that waits on a core another process holds can slow a step many-fold
TINY_RUN = [
    "--max-rows",
    "1000",
    "--batch",
    "64",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--threads",
    "1",
    "--no-tune-allocator",
]


def _finite_positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _run(tmp_path, *argv: str) -> dict:
    out = tmp_path / "bench.json"
    assert cli.main([*argv, "--json", str(out), "--png", str(tmp_path / "bench.png")]) == 0
    return json.loads(out.read_text())


def _check_run(run: dict, anchors: list[str]) -> None:
    assert {"hybridembed", *[a for a in anchors if a != "floor"]} == set(run["contenders"])
    for name, c in run["contenders"].items():
        assert _finite_positive(c["median_ms"]) and _finite_positive(c["samples_per_s"]), name
        assert all(_finite_positive(t) for t in c["times_ms"]) and len(c["times_ms"]) == 2
        assert math.isfinite(c["spread_ms"]) and c["spread_ms"] >= 0
        assert c["state_bytes"] > 0 and c["peak_bytes"] >= c["state_bytes"]
        # same initial weights and batch: the contenders compute the same model, before and after training
        assert c["max_abs_diff_vs_hybridembed"]["before"] < 1e-4, name
        assert c["max_abs_diff_vs_hybridembed"]["after"] < 1e-3, name
    floor = run["floor"]
    assert _finite_positive(floor["median_ms"]) and _finite_positive(floor["rows_ms"])
    assert 0 < run["distinct_rows_per_step"] <= run["ids_per_step"]
    for name in run["contenders"]:  # every contender against every anchor that ran, itself excepted
        assert set(run["ratios"][name]) == {a for a in anchors if a != name}
        assert all(_finite_positive(r) for r in run["ratios"][name].values())
    assert run["full_size"]["total_bytes"] == 2 * run["full_size"]["weight_bytes"]  # Adagrad: same again


def test_tiny_quick_writes_well_formed_json(tmp_path, capsys):
    threads = torch.get_num_threads()
    results = _run(tmp_path, "--model", "tiny", "--quick", *TINY_RUN)
    torchrec = models.torchrec_status() is None
    anchors = ["per_table", "torchrec", "floor"] if torchrec else ["per_table", "floor"]
    assert results["settings"]["model"] == "tiny" and results["machine"]["cores"] >= 1
    assert results["settings"]["threads"] == 1 and torch.get_num_threads() == threads  # restored after the run
    assert ("torchrec" in results["skipped"]) is not torchrec
    assert set(results["cpu_busy_by_others"]) == {"start", "end"}
    (run,) = results["runs"]
    assert run["workload"] == "tiny" and run["batch"] == 64 and run["tables"] == 55 and run["inputs"] == 58
    assert run["ids_per_step"] == 64 * 85
    assert run["floor"]["dense_ms"] > 0  # a model with an MLP: the floor includes the dense part
    _check_run(run, anchors)
    text = capsys.readouterr().out
    assert "vs per_table" in text and "vs floor" in text and ("vs torchrec" in text) is torchrec
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    assert (tmp_path / "bench.png").exists() is has_mpl
    assert has_mpl or "chart skipped: matplotlib is not installed" in text


def test_embedding_step_runs_one_and_multi_hot(tmp_path):
    argv = ["--model", "embedding-step", "--anchors", "per_table,floor", *TINY_RUN]
    results = _run(tmp_path, *argv)
    assert [r["workload"] for r in results["runs"]] == ["embedding-step/one-hot", "embedding-step/multi-hot"]
    for run in results["runs"]:
        assert run["floor"]["dense_ms"] is None  # embedding-only: no MLP
        _check_run(run, ["per_table", "floor"])
    one, multi = results["runs"]
    assert one["ids_per_step"] == 64 * 26 and multi["ids_per_step"] > one["ids_per_step"]


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_full_size_accounting_matches_the_published_sizes(name):
    tables, gib, ids = PUBLISHED[name]
    m = memory(MODELS[name])
    assert m.tables == tables
    assert round(m.weight_bytes / 2**30, 1) == gib
    assert m.optimizer_bytes == m.weight_bytes and m.total_bytes == 2 * m.weight_bytes
    if ids is not None:
        assert m.ids_per_sample == ids


def test_accounting_of_the_other_workloads():
    dlrm = memory(MODELS["criteo-dlrm-like"])
    assert (dlrm.tables, dlrm.weight_bytes, dlrm.ids_per_sample) == (26, 26 * 100_000 * 128 * 4, 26)
    one, multi = (memory(s) for s in workloads("embedding-step"))
    assert one.weight_bytes == multi.weight_bytes == 26 * 200_000 * 64 * 4
    assert (one.ids_per_sample, multi.ids_per_sample) == (26, 260)
    assert memory(MODELS["tiny"], "sgd").optimizer_bytes == 0


def test_memory_only_allocates_nothing_and_lists_every_model(capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("--memory-only must not build a model")

    monkeypatch.setattr(models, "build_model", refuse)
    assert cli.main(["--memory-only"]) == 0
    text = capsys.readouterr().out
    for name in [*MODELS, "embedding-step/multi-hot"]:
        assert name in text
    assert "22,327.4" in text  # colossal's rows, GiB


def test_scaling_keeps_tables_widths_hotness_and_sharing():
    for spec in MODELS.values():
        small = scale(spec, 1000)
        assert [(e.num_tables, e.nnz, e.width, e.shared) for e in small.embeddings] == [
            (e.num_tables, e.nnz, e.width, e.shared) for e in spec.embeddings
        ]
        assert all(e.rows == min(o.rows, 1000) for e, o in zip(small.embeddings, spec.embeddings))
    tables, inputs = expand(scale(MODELS["tiny"], 1000))
    shared = [i.table for i in inputs if i.table == "t0"]
    assert len(tables) == 55 and shared == ["t0", "t0"]  # one table read by a one-hot and a 10-hot input
    assert [i.hotness for i in inputs if i.table == "t0"] == [1, 10]
    assert default_batch(MODELS["tiny"]) == 8192 and default_batch(MODELS["tiny"], quick=True) == 2048
    assert default_batch(workloads("embedding-step")[1]) == 8192


def test_same_padding_average_pool_matches_keras():
    # width 10, stride 3: TF pads 1 before and 1 after; windows average real elements only
    x = torch.arange(10, dtype=torch.float32).unsqueeze(0)
    torch.testing.assert_close(SamePool1d(10, 3)(x), torch.tensor([[0.5, 3.0, 6.0, 8.5]]))
    torch.testing.assert_close(SamePool1d(6, 3)(x[:, :6]), torch.tensor([[1.0, 4.0]]))


@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "huge"],
        ["--steps", "0"],
        ["--batch", "many"],
        ["--anchors", "per_table,tensorflow"],
        ["--lr", "-1"],
        ["--no-such-flag"],
    ],
)
def test_bad_flags_exit_2_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "error:" in err


def test_a_run_that_does_not_fit_is_refused_before_allocating(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "meminfo", lambda key: 2**30)  # 1 GiB available
    assert cli.main(["--model", "small", "--json", str(tmp_path / "x.json"), "--no-tune-allocator"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--max-rows" in err[0]
    assert not (tmp_path / "x.json").exists()


def test_console_script_dispatch(capsys, monkeypatch):
    assert top.main([]) == 2 and "bench" in capsys.readouterr().out
    assert top.main(["--help"]) == 0
    monkeypatch.setattr(top, "PLANNED", ("serve",))  # a command named in the design, not built yet
    assert top.main(["serve"]) == 2
    assert "not yet available" in capsys.readouterr().err
    assert top.main(["frobnicate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown command 'frobnicate'; available commands: bench" in err[0]
    assert top.main(["trian"]) == 2  # a typo: the command it was probably meant to be
    assert "unknown command 'trian' (did you mean 'train'?)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        top.main(["bench", "--model", "huge"])
    assert e.value.code == 2
