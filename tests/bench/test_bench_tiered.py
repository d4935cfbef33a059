"""``benchmarks/bench_tiered.py --quick``: every part runs end to end (the tiered tables equal to
the tables in memory, the memory part's peak read from a fresh process, its table saved and
loaded back equal). No timing is asserted.

    python -m pytest -q tests/bench/test_bench_tiered.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import hybridembed as he
from tests import warm

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_tiered.py"
SRC = str(Path(he.__file__).resolve().parents[1])  # the child imports the hybridembed under test


def test_quick(tmp_path):
    out = tmp_path / "tiered.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    argv = ["--quick", "--checkpoint", "--dir", str(tmp_path), "--json", str(out)]
    rc, _, stderr = warm.run(SCRIPT, argv, env, cwd=tmp_path, timeout=300)
    assert rc == 0, stderr[-3000:]
    res = json.loads(out.read_text())
    speed, memory = res["speed"], res["memory"]
    assert speed["equal_to_memory"] is True and speed["tiered_ms"] > 0 and speed["memory_ms"] > 0
    assert 0 < speed["hit_rate"] < 1 and speed["disk_writes"] >= 0
    assert memory["peak"] > 0 and memory["stats"]["evictions"] > 0
    assert memory["loaded_equal"] is True and memory["save_peak"] > 0 and memory["load_peak"] > 0
    assert memory["files"] >= 1 and memory["save3_s"] > 0  # (the saves again, the last one linking)
    pf = memory["prefetch"]  # (its steps without and with ec.prefetch, a block each)
    assert pf["plain"]["steps"] == pf["prefetch"]["steps"] == 5, pf
    assert (memory["stats"]["prefetched"] > 0) != memory["mapped"], memory  # (a mapped file is not read ahead)
    for name in ("windows", "one pass"):  # (the records index: 300k records, 2^22 positions, 80 windows or one)
        assert res["index"][name]["found"] is True and res["index"][name]["positions"] == 1 << 22, res["index"]
    assert memory["behind"]["behind_ms"] > 0 and memory["behind"]["in_step_ms"] > 0, memory  # (the memory part's too)
    assert memory["asked"]["asked_ms"] > 0 and memory["asked"]["not_asked_ms"] > 0, memory
    rd = res["reads"][0]  # (the reads part: each way's cold reads and writes)
    ways = ("one thread", "slices", "asked", "write, one thread", "write, asked", "warm", "warm, not probed")
    assert all(rd[k] > 0 for k in (*ways, "warm write", "warm write, not probed")), rd
    b = res["behind"]  # (spills written behind the step, and in it)
    assert b["behind_ms"] > 0 and b["in_step_ms"] > 0 and b["spilled"] > 0, b
    for part in ("prefetch", "dynamic-prefetch"):  # (cold rows read back: by the step, or by the prefetch)
        r = res[part]
        assert r["plain"]["read_ms"] > 0 and r["prefetch"]["step_ms"] > 0, (part, r)
        assert r["stats"]["prefetched"] > 0 and r["stats"]["rows"] == 40_000, (part, r["stats"])
    assert list(tmp_path.iterdir()) == [out]  # (the tables' files removed)
