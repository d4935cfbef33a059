"""``benchmarks/bench_gpu.py`` at a tiny scale on the CPU: every workload of issue 14's table runs,
eager against the per-table baseline, and its JSON holds the timings, the ratios and a byte
floor that adds up (Triton is skipped on the CPU unless TRITON_INTERPRET=1, which this test
does not set: interpreted kernels are slow).

    python -m pytest -q tests/bench/test_bench_gpu.py

No timing is asserted: the figures only have to be positive and finite.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import hybridembed as he
from tests import warm

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_gpu.py"
SRC = str(Path(he.__file__).resolve().parents[1])  # the child imports the hybridembed under test


def _positive(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_tiny_scale_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    argv = ["--device", "cpu", "--scale", "0.0005", "--rounds", "1", "--warmup", "0", "--copy-mib", "8"]
    code, stdout, stderr = warm.run(SCRIPT, [*argv, "--json", str(out)], env, cwd=tmp_path, timeout=120)
    assert code == 0, stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and "CUDA" in res["triton_skipped"]
    assert _positive(res["copy_bandwidth_bytes_per_s"])
    names = [r["workload"] for r in res["runs"]]
    assert names == ["one-hot/sgd", "one-hot/adagrad", "multi-hot/sgd", "multi-hot/adagrad", "dynamic/one-hot/sgd"]
    for r in res["runs"]:
        t, b, d, by = r["tables"], r["batch"], r["dim"], r["bytes"]
        assert (t, r["rows"], d, b) == (26, 500, 128, 8)
        assert set(r["contenders"]) == {"eager", "baseline"}
        n, u = by["ids"], by["distinct_rows"]
        assert 0 < u <= n and (n == t * b if r["workload"].startswith(("one", "dynamic")) else n > 0)
        state = 1 if r["optimizer"] == "adagrad" else 0
        index = 16 * u if r["dynamic"] else 0
        assert by["forward"] == 8 * n + 8 * t * (b + 1) + 4 * d * u + 4 * d * t * b + index
        assert by["update"] == 8 * n + 4 * d * t * b + (2 + 2 * state) * 4 * d * u + index
        assert by["step"] == by["forward"] + by["update"]
        assert math.isclose(r["floor_ms"], by["step"] / res["copy_bandwidth_bytes_per_s"] * 1e3)
        base = r["contenders"]["baseline"]["median_ms"]
        for name, c in r["contenders"].items():
            for key in ("median_ms", "forward_ms", "vs_baseline", "fraction_of_floor"):
                assert _positive(c[key]), (r["workload"], name, key)
            assert math.isclose(c["vs_baseline"], base / c["median_ms"])
            assert math.isclose(c["fraction_of_floor"], r["floor_ms"] / c["median_ms"])
    assert "one-hot/sgd: 26 x 500 x 128, batch 8" in stdout
