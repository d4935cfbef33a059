"""``benchmarks/bench_openmp.py`` at a tiny size: every case runs and gives sane figures (no
timing is asserted: times only have to be positive and finite)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_openmp.py"


def test_every_case_is_timed(capsys):
    spec = importlib.util.spec_from_file_location("bench_openmp", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.main(["--rounds", "2", "--work", "1000", "--rows", "8192", "--table-rows", "20000"])
    assert set(out) == {"spinning", "released", "asleep", "one_thread_alone_ms", "sequences"}
    (seq,) = out["sequences"]
    assert seq["rows"] == 8192 and all(math.isfinite(seq[k]) and seq[k] > 0 for k in ("released_ms", "spinning_ms"))
    for case in ("spinning", "released", "asleep"):
        assert set(out[case]) == {"op", "release", "two_threads"}
        assert all(math.isfinite(v) and v >= 0 for v in out[case].values()), case
    assert "released" in capsys.readouterr().out
