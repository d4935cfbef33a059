"""``benchmarks/bench_ps.py --quick``: it runs end to end (2 trainers + 1 server, synchronous,
and asynchronous with the hot-row cache), and its JSON holds every contender's figures with
sane values. (Each contender is a job of fresh processes: a few seconds each; the collective
contender is left to the full runs to keep this under half a minute.)

    python -m pytest -q tests/bench/test_bench_ps.py

No timing is asserted: step times only have to be positive and finite.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import hybridembed as he
from tests import warm

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_ps.py"
SRC = str(Path(he.__file__).resolve().parents[1])  # the child imports the hybridembed under test


def test_quick_sync_and_async_cache(tmp_path):
    out = tmp_path / "ps.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    argv = ["--quick", "--contenders", "sync_1", "async_cache", "--json", str(out)]
    code, stdout, stderr = warm.run(SCRIPT, argv, env, cwd=tmp_path, timeout=120)
    assert code == 0, stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["failures"] == {}
    runs = {r["contender"]: r for r in res["runs"]}
    assert set(runs) == {"sync_1", "async_cache"}
    for name, r in runs.items():
        steps = res["config"]["steps"]
        assert len(r["step_ms"]) == steps and all(math.isfinite(t) and t > 0 for t in r["step_ms"]), name
        assert r["median_ms"] > 0 and len(r["cpu_ms_per_step_by_rank"]) == 2 + r["servers"], name
        assert len(r["bytes_sent_per_trainer"]) == 2, name
        assert all(b > 0 for b in r["bytes_sent_per_trainer"] + r["bytes_received_per_trainer"]), name
    sync = runs["sync_1"]
    assert (sync["servers"], sync["mode"]) == (1, "sync")
    (server,) = sync["server_stats"]
    # the server answered every row both trainers pulled (and received their gradients)
    assert math.isclose(server["pulled_rows"], sum(sync["pulled_rows"])) and server["pulled_rows"] > 0
    assert server["pushed_rows"] > 0
    assert server["bytes_in"] >= sum(sync["bytes_sent_per_trainer"]) * 0.99
    # what the server sent is what the trainers received, plus the replies to the stats requests
    received = sum(sync["bytes_received_per_trainer"])
    assert received * 0.99 <= server["bytes_out"] < received * 1.3
    cache = runs["async_cache"]
    assert cache["mode"] == "async" and all(0.0 <= h <= 1.0 for h in cache["cache_hit_rate"])
    assert all(p < n for p, n in zip(cache["pulled_rows"], cache["lookups"]))  # the cache served some rows
    assert {s["contender"] for s in res["summary"]} == set(runs)
