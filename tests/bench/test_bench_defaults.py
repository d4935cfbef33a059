"""``benchmarks/bench_defaults.py`` at a tiny size: bench_step.py in a fresh process, its summary
printed (the byte floor's fields are not taken for a contender; no timing is asserted)."""

from __future__ import annotations

from tests.bench import load_script


def test_a_round_runs_and_sums_up(capsys):
    mod = load_script("bench_defaults")
    step = ["--tables", "2", "--rows", "300", "--dim", "8", "--batch", "16", "--steps", "1"]
    runs = mod.main(["--settings", "default", "--rounds", "1", "--", *step])
    out = capsys.readouterr().out
    assert len(runs["default"]) == 1 and len(runs["default"][0]["runs"]) == 4
    assert "vs per_table" in out and "of its byte floor" in out and "vs floor" not in out
