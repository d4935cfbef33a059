"""``benchmarks/fuzz_faults.py`` at a tiny size: every family runs end to end and every trial is
clear (none silent, crashed or hung), and planted failures are reported as what they are, so the
counts in docs/distributed.md ("Faults across ranks: fuzz counts") stay honest.

    python -m pytest -q tests/bench/test_fuzz_faults.py

Two runs of the script (jobs of fresh processes: ~10-25 s each here).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import hybridembed as he
from tests import warm

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "fuzz_faults.py"
SRC = str(Path(he.__file__).resolve().parents[1])  # the jobs import the hybridembed under test


def _fuzz(tmp_path: Path, argv: list[str], env: dict | None = None) -> dict:
    out = tmp_path / "fuzz.json"
    full = dict(os.environ)
    full["PYTHONPATH"] = os.pathsep.join([SRC, str(ROOT), full.get("PYTHONPATH", "")])
    full.update(env or {})
    rc, stdout, stderr = warm.run(SCRIPT, [*argv, "--json", str(out)], full, cwd=tmp_path, timeout=240)
    assert rc == 0, stdout[-2000:] + stderr[-3000:]
    return json.loads(out.read_text())


def test_the_other_families_run_end_to_end_and_every_trial_is_clear(tmp_path):
    """(The input family's clear trials run in the planted test below, and in
    tests/distributed/test_faults.py; the checkpoint races' other cases in tests/api.)"""
    res = _fuzz(tmp_path, ["--families", "ps", "ckpt", "--seed", "5", "--trials", "2", "--case", "ps", "kill"])
    for family in ("ps", "ckpt"):
        fam = res["families"][family]
        total = fam["counts"]["all"]
        assert total["tried"] == 2 and total["clear"] == 2, fam["counts"]
        assert not fam["not_clear"], json.dumps(fam["not_clear"], indent=1)[:4000]


def test_planted_failures_are_reported_as_silent_crash_and_hang(tmp_path):
    """The fuzzer is not vacuous: a reference that trains on the step every rank skipped is silent,
    a rank that exits is a crash, ranks that stop making progress are a hang; the trials around
    them (in new jobs) are clear."""
    env = {"FUZZ_INJECT": "ec2:1:silent,ec2:2:crash,ec2:3:hang", "FUZZ_STALL": "10"}
    res = _fuzz(tmp_path, ["--families", "input", "--case", "ec2", "--trials", "5"], env)
    fam = res["families"]["input"]
    assert fam["counts"]["ec2"] == {"tried": 5, "clear": 2, "silent": 1, "crash": 1, "hang": 1}, fam["counts"]
    outcome = {r["trial"]: r["outcome"] for r in fam["not_clear"]}
    assert outcome == {1: "silent", 2: "crash", 3: "hang"}, fam["not_clear"]
    silent = next(r for r in fam["not_clear"] if r["trial"] == 1)
    assert "tables differ from one process" in silent["why"], silent
