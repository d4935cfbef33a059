"""``hybridembed train`` flags and errors: --help documents every flag; bad flags, missing files and
malformed rows end with one ``error:`` line, exit code 2, and no traceback.

    python -m pytest -q tests/train/test_cli.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from hybridembed import cli as top
from hybridembed.train import cli
from hybridembed.train import job as train_job
from tests import warm

PROG = "hybridembed train"


def _run(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    """The command as a user runs it: a fresh process (the installed script when present)."""
    script = shutil.which("hybridembed", path=os.path.dirname(sys.executable))
    cmd = [script, "train"] if script else [sys.executable, "-m", "hybridembed.cli", "train"]
    return subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=120, cwd=cwd)


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{PROG}: error: ") and "Traceback" not in err
    return lines[0]


def test_help_documents_every_flag(capsys):
    parser = cli.build_parser()
    with pytest.raises(SystemExit) as e:
        top.main(["train", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    flags = [s for a in parser._actions for s in a.option_strings]
    assert len(flags) >= 30
    for a in parser._actions:
        assert a.help, f"{a.option_strings} has no help"
        for s in a.option_strings:
            assert s in text, f"{s} missing from --help"
    for word in ("dlrm", "wdl", "deepfm", "dcnv2", "torchscript", "onnx", "adult", "criteo"):
        assert word in text


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--model", "xgboost"], "invalid choice: 'xgboost'"),
        (["--holdout", "1.5"], "--holdout"),
        (["--mlp", "64,0"], "each an int >= 1, like 128,64; got '64,0' (width '0')"),
        (["--mlp", "1,,2"], "got '1,,2' (an empty width)"),  # (was read as 1,2)
        (["--mlp", "16,"], "got '16,' (an empty width)"),
        (["--mlp", ","], "got ',' (an empty width)"),
        (["--mlp", "8,1.5"], "got '8,1.5' (width '1.5')"),
        (["--bottom-mlp", "4,,4"], "argument --bottom-mlp: expected comma-separated layer widths"),
        (["--bottom-mlp", "4,-2"], "got '4,-2' (width '-2')"),
        (["--timeout", "0"], "argument --timeout: expected a float > 0.0, got '0'"),
        (["--timeout", "-5"], "argument --timeout: expected a float > 0.0, got '-5'"),
        (["--timeout", "nan"], "argument --timeout: expected a float > 0.0, got 'nan'"),
        (["--timeout", "soon"], "argument --timeout: expected a number, got 'soon'"),
        (["--epochs", "0"], "--epochs"),
        (["--data"], "expected at least one argument"),
    ],
)
def test_bad_flags(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert needle in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (
            ["--dataset", "adult"],
            "--dataset adult needs --data FILE... (UCI Adult (Census Income) is at https://archive.ics.uci.edu",
        ),
        (["--data", "/nonexistent/day_0.tsv"], "/nonexistent/day_0.tsv: no such file"),
        (["--val-data", "/nonexistent/day_23.tsv"], "/nonexistent/day_23.tsv: no such file"),
        (["--resume", "/nonexistent/ckpt"], "no such checkpoint directory"),
    ],
)
def test_usage_errors_in_process(argv, needle, tmp_path, capsys):
    assert cli.main([*argv, "--workdir", str(tmp_path), "--no-progress"]) == 2
    assert needle in _one_error_line(capsys.readouterr().err)
    assert not any(tmp_path.iterdir())  # refused before generating or writing anything


def test_console_errors_have_no_traceback(criteo_sample, tmp_path):
    r = _run("--model", "nope")  # (the installed script, a fresh process)
    assert r.returncode == 2 and "invalid choice" in _one_error_line(r.stderr)
    rc, _, err = warm.run_module("hybridembed.cli", ["train", "--data", str(tmp_path / "missing.tsv")], dict(os.environ),
                                 cwd=tmp_path, timeout=120)  # fmt: skip
    assert rc == 2 and "missing.tsv: no such file" in _one_error_line(err)
    lines = criteo_sample.read_text().splitlines()[:40]
    lines[30] += "\textra"  # 41 columns
    bad = tmp_path / "bad.tsv"
    bad.write_text("\n".join(lines) + "\n")
    argv = ["train", "--data", str(bad), "--workdir", str(tmp_path / "w"), "--no-progress"]
    rc, _, err = warm.run_module("hybridembed.cli", argv, dict(os.environ), cwd=tmp_path, timeout=120)
    line = _one_error_line(err)
    assert rc == 2 and "bad.tsv" in line and "line 31" in line and "got 41" in line


def test_resume_from_a_directory_that_is_no_checkpoint(tmp_path, capsys):
    (tmp_path / "ckpt").mkdir()
    assert cli.main(["--resume", str(tmp_path / "ckpt"), "--workdir", str(tmp_path)]) == 2
    assert "not a hybridembed train checkpoint" in _one_error_line(capsys.readouterr().err)


def test_dispatcher_lists_train(capsys):
    assert top.main([]) == 2
    assert "train" in capsys.readouterr().out


def _train_checkpoint(path, **state) -> None:
    """A checkpoint as hybridembed train writes it (its run state in the manifest), of a tiny model."""
    import torch

    import hybridembed as he

    run = {"format": cli.STATE_FORMAT, "arch": dict(cli.ARCH_DEFAULTS), "epoch": 3, "batches_done": 0, "step": 90}
    run["complete"] = True
    run.update(state)
    he.save(path / cli.MODEL_DIR, torch.nn.Linear(2, 1), extra={cli.STATE_KEY: run})


def test_resume_from_a_damaged_manifest_fails_before_training(tmp_path, capsys):
    _train_checkpoint(tmp_path / "ckpt")
    (manifest,) = (tmp_path / "ckpt" / cli.MODEL_DIR).glob("v-*/manifest.json")
    text = manifest.read_text()
    manifest.write_text(text.replace('"epoch": 3', '"epoch": 7'))  # a flipped digit: resume at the wrong epoch
    assert cli.main(["--resume", str(tmp_path / "ckpt"), "--workdir", str(tmp_path / "w")]) == 2
    assert "manifest.json does not match its checksum" in _one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize(
    "state, needle",
    [
        ({"epoch": "3"}, "hybridembed_train.epoch is '3', expected an int >= 0"),
        ({"step": -1}, "hybridembed_train.step is -1"),
        ({"complete": 1}, "hybridembed_train.complete is 1, expected true or false"),
        ({"arch": {"mlp": "128,64"}}, "hybridembed_train.arch.mlp is '128,64', expected a list of ints"),
        ({"arch": {"width": 3}}, "unknown flag 'width'"),
    ],
)
def test_resume_from_a_malformed_run_state_is_one_line(state, needle, tmp_path, capsys):
    _train_checkpoint(tmp_path / "ckpt", **state)
    assert cli.main(["--resume", str(tmp_path / "ckpt"), "--workdir", str(tmp_path / "w")]) == 2
    assert needle in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    "flag, target, needle",
    [
        ("--checkpoint", "file", "exists and is not a directory"),
        ("--checkpoint", "file/sub", "is a file, not a directory"),
        ("--export", "dir", "is a directory; give a file name"),
        ("--export", "file/m.pt", "is a file, not a directory"),
        ("--workdir", "file", "exists and is not a directory"),
        ("--checkpoint", "readonly/ckpt", "readonly is not writable"),
    ],
)
def test_outputs_that_cannot_be_written_fail_before_training(flag, target, needle, tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    (tmp_path / "readonly").mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: not str(p).endswith("readonly") and real_access(p, mode))

    def no_training(*a, **k):
        raise AssertionError("trained before checking the outputs")

    monkeypatch.setattr(train_job, "load_data", no_training)
    monkeypatch.setattr(train_job, "train_epoch", no_training)
    data = [] if flag == "--workdir" else ["--data", str(tmp_path / "day_0.tsv")]
    given = str(tmp_path / target)
    workdir = given if flag == "--workdir" else str(tmp_path / "w")
    argv = [*data, "--workdir", workdir, "--no-progress"] + ([flag, given] if flag != "--workdir" else [])
    assert cli.main(argv) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"{flag} {given}" in line and needle in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "file", "readonly"]  # nothing written


def test_a_held_out_set_of_one_class_says_why_the_auc_is_undefined(tmp_path, capsys):
    # 30 generated rows: 3 held out, all negative (seed 0)
    assert cli.main(["--rows", "30", "--workdir", str(tmp_path), "--no-progress", "--no-export"]) == 0
    out = capsys.readouterr().out
    assert "AUC undefined (all 3 held-out rows are negative: more --rows or another --seed)" in out
    assert "AUC nan" not in out and "done in" in out


def test_onnx_export_without_its_packages_fails_before_training(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxscript" else real(name, *a))

    def no_training(*a, **k):
        raise AssertionError("trained before checking the export's packages")

    monkeypatch.setattr(train_job, "load_data", no_training)
    assert cli.main(["--rows", "30", "--workdir", str(tmp_path / "w"), "--export-format", "onnx"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--export-format onnx needs the onnxscript package" in line and "--no-export" in line
    assert not (tmp_path / "w").exists() or not any((tmp_path / "w").iterdir())


def test_a_second_run_in_the_same_workdir_says_what_it_replaces(tmp_path, capsys):
    argv = ["--rows", "200", "--workdir", str(tmp_path), "--no-progress", "--export", str(tmp_path / "m.pt")]
    assert cli.main(argv) == 0
    assert "note:" not in capsys.readouterr().out
    assert cli.main(argv) == 0
    notes = [x for x in capsys.readouterr().out.splitlines() if x.startswith("note:")]
    assert len(notes) == 2
    assert "holds an earlier run's checkpoint; this run replaces it" in notes[0] and "--resume" in notes[0]
    assert "m.pt exists; this run replaces it" in notes[1]
    assert cli.main([*argv[:-2], "--no-export", "--resume", str(tmp_path / "checkpoint"), "--epochs", "2"]) == 0
    out = capsys.readouterr().out  # (continuing its own checkpoint: nothing of it is replaced)
    assert "earlier run's checkpoint" not in out
