"""``benchmarks/bench_distributed.py --quick`` at world 2: it runs, its JSON holds every
contender's figures, the bytes it counted are at least the plan's minimum, and TorchRec is
skipped with a note where it does not import.

    python -m pytest -q tests/bench/test_bench_distributed.py

No timing is asserted: the figures only have to be positive and finite.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import hybridembed as he
from tests import warm

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_distributed.py"
SRC = str(Path(he.__file__).resolve().parents[1])  # the child imports the hybridembed under test


def _has_torchrec() -> bool:
    try:
        return importlib.util.find_spec("torchrec") is not None
    except (ImportError, ValueError):
        return False


def test_quick_world_2(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    argv = ["--quick", "--world", "2", "--contenders", "table_wise", "data_parallel", "torchrec_tw", "--json", str(out)]
    code, stdout, stderr = warm.run(SCRIPT, argv, env, cwd=tmp_path, timeout=120)
    assert code == 0, stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["failures"] == {}
    runs = {(r["contender"], r["world"]): r for r in res["runs"]}
    want = {("table_wise", 2), ("data_parallel", 2)} | ({("torchrec_tw", 2)} if _has_torchrec() else set())
    assert set(runs) == want
    if not _has_torchrec():
        assert "torchrec" in res["notes"] and "torchrec" in stdout.lower()
    for key, r in runs.items():
        assert len(r["times_ms"]) == 3 and all(math.isfinite(t) and t > 0 for t in r["times_ms"]), key
    tw = runs[("table_wise", 2)]
    assert tw["plan"] == {"table_wise": 26}
    # table-wise at world 2: half the tables' ids go out and rows come back; the runtime
    # cannot send less than the plan's minimum (and its lengths and headers add to it)
    for sent, least in zip(tw["bytes_per_rank"], tw["min_bytes_per_rank"]):
        assert least > 0 and sent >= least
    dp = runs[("data_parallel", 2)]
    assert dp["min_bytes_per_rank"] == [0, 0]  # nothing to exchange: every table is replicated
    # the replicas' row gradients: each rank's touched rows, one shared-memory gather a step
    if os.access("/dev/shm", os.W_OK):
        assert dp["bytes"]["all_gather"]["calls"] == 1 and dp["bytes"]["all_gather"]["bytes"] > 0
    assert {s["contender"] for s in res["summary"]} == {c for c, _ in want}
