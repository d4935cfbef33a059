"""``benchmarks/bench_openmp.py`` at a tiny size: every case runs and gives sane figures (no
timing is asserted: times only have to be positive and finite)."""

from __future__ import annotations

import math

from tests.bench import load_script


def test_every_case_is_timed(capsys):
    mod = load_script("bench_openmp")
    out = mod.main(["--rounds", "2", "--work", "1000", "--rows", "8192", "--table-rows", "20000"])
    assert set(out) == {"spinning", "released", "asleep", "one_thread_alone_ms", "sequences"}
    (seq,) = out["sequences"]
    assert seq["rows"] == 8192 and all(math.isfinite(seq[k]) and seq[k] > 0 for k in ("released_ms", "spinning_ms"))
    for case in ("spinning", "released", "asleep"):
        assert set(out[case]) == {"op", "release", "two_threads"}
        assert all(math.isfinite(v) and v >= 0 for v in out[case].values()), case
    assert "released" in capsys.readouterr().out
