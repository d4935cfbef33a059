"""``hybridembed bench --model train-e2e`` on a tiny generated file: JSON keys, positive
samples/s, finite losses. No timing is asserted.

    python -m pytest -q tests/bench/test_e2e.py
"""

from __future__ import annotations

import json
import math

from hybridembed.bench import cli


def test_train_e2e_tiny(tmp_path):
    out = tmp_path / "e2e.json"
    argv = ["--model", "train-e2e", "--rows", "600", "--batch", "64", "--steps", "3", "--warmup", "1"]
    argv += ["--threads", "1", "--no-tune-allocator", "--json", str(out), "--png", str(tmp_path / "e2e.png")]
    assert cli.main(argv) == 0
    res = json.loads(out.read_text())
    assert not (tmp_path / "e2e.png").exists()
    (run,) = res["runs"]
    assert run["workload"] == "train-e2e" and run["batch"] == 64 and run["data"]["rows"] == 600
    assert set(run["contenders"]) == {"hybridembed", "plain_torch"}
    for name, c in run["contenders"].items():
        assert c["samples_per_s"] > 0 and math.isfinite(c["samples_per_s"]), name
        assert len(c["times_ms"]) == 3
        assert math.isfinite(c["final_loss"]) and math.isfinite(c["mean_loss"]), name
    assert run["contenders"]["hybridembed"]["one_time_s"] == 0.0
    assert run["contenders"]["plain_torch"]["one_time_s"] > 0
    assert run["ratios"]["hybridembed"]["plain_torch"] > 0
    assert len(run["data"]["vocab_sizes"]) == 26


def test_train_e2e_memory_only_refused(capsys):
    try:
        cli.main(["--model", "train-e2e", "--memory-only"])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("expected exit 2")
