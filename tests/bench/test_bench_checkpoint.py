"""``benchmarks/bench_checkpoint.py --quick`` at world 2: it runs, its JSON holds every figure
(save and load times, bytes per rank, the delta, the pause), and the bytes add up: every
rank writes its shards, the per-rank bytes sum to the total, and a delta holds fewer rows
and bytes than the full version it follows.

    python -m pytest -q tests/bench/test_bench_checkpoint.py

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
SCRIPT = ROOT / "benchmarks" / "bench_checkpoint.py"
SRC = str(Path(he.__file__).resolve().parents[1])  # the child imports the hybridembed under test


def _positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


def test_quick_world_2(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    argv = ["--quick", "--world", "2", "--dir", str(tmp_path), "--json", str(out)]
    code, stdout, stderr = warm.run(SCRIPT, argv, env, cwd=tmp_path, timeout=120)
    assert code == 0, stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["failures"] == {}
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]  # its checkpoints are removed
    (r,) = res["results"]
    assert r["world"] == 2 and r["plan"] == {"row_wise/hash": 26}
    cfg = res["config"]
    assert r["full_rows"] == 26 * cfg["rows"]  # the fill made every id of every table
    for key in ("save_s", "load_s", "fill_s"):
        assert _positive(r[key]), key
    assert len(r["save_runs_s"]) == len(r["load_runs_s"]) == cfg["repeats"]
    per = r["full_bytes_per_rank"]
    assert len(per) == 2 and all(b > 0 for b in per) and sum(per) == r["full_bytes"]
    (d,) = r["deltas"]
    assert d["steps"] == cfg["delta_steps"][0] and d["incremental"]
    assert 0 < d["rows"] < r["full_rows"] and 0 < d["bytes"] < r["full_bytes"]
    assert len(d["bytes_per_rank"]) == 2 and _positive(d["save_s"]) and _positive(d["load_chain_s"])
    p = r["pause"]
    for key in ("blocking_median_s", "background_return_median_s", "background_total_median_s"):
        assert _positive(p[key]), key
    assert len(p["steps_overlapped"]) == cfg["repeats"] and all(0 <= k <= p["steps"] for k in p["steps_overlapped"])
    assert _positive(p["step_before_median_s"]) and _positive(p["step_during_median_s"])
    assert "| world |" in res["markdown"] and "| world |" in stdout
