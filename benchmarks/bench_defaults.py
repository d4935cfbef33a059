"""The embedding training step as a user's own script meets it: fresh processes, nothing tuned.

    python benchmarks/bench_defaults.py                          # defaults, then glibc's allocator, 2 rounds
    python benchmarks/bench_defaults.py --settings default --rounds 3 -- --optimizers sgd
    python benchmarks/bench_defaults.py --rounds 1 -- --tables 4 --rows 1000 --batch 256 --steps 3   # smoke

Each round runs ``benchmarks/bench_step.py`` once per setting, each in a fresh Python process
that does nothing about the allocator beyond what ``import hybridembed`` does:

- ``default``: no ``HYBRIDEMBED_*`` variable set (what a user's training script gets);
- ``off``: ``HYBRIDEMBED_TUNE_ALLOCATOR=0`` (glibc's own thresholds: the opt-out);
- ``on``: ``HYBRIDEMBED_TUNE_ALLOCATOR=1``.

Inside a process the contenders (hybridembed, per-table ``nn.EmbeddingBag(sparse=True)`` +
``torch.optim``, FBGEMM's TBE when fbgemm-gpu-cpu imports) alternate step by step; settings
alternate round by round. Arguments after ``--`` go to bench_step.py. Prints, per setting,
optimizer and hotness, the median over rounds of each contender's median step time and the
range of the ratios over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

STEP = Path(__file__).with_name("bench_step.py")
SETTINGS = {"default": None, "off": "0", "on": "1"}


def run_once(setting: str, extra: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDEMBED_")}
    if SETTINGS[setting] is not None:
        env["HYBRIDEMBED_TUNE_ALLOCATOR"] = SETTINGS[setting]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "step.json"
        subprocess.run([sys.executable, str(STEP), *extra, "--json", str(out)], env=env, check=True)
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", nargs="+", default=["default", "off"], choices=list(SETTINGS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", help="write every run's results here")
    p.add_argument("step_args", nargs="*", help="after --: arguments for bench_step.py")
    args = p.parse_args(argv)
    runs: dict[str, list[dict]] = {s: [] for s in args.settings}
    for r in range(args.rounds):
        for s in args.settings:
            print(f"--- round {r + 1}/{args.rounds}, setting {s}", flush=True)
            runs[s].append(run_once(s, args.step_args))
    print("\nsetting  optimizer        hotness  contender medians over rounds (ms)     ratios to hybridembed (range)")
    for s, results in runs.items():
        for i, first in enumerate(results[0]["runs"]):
            rs = [res["runs"][i] for res in results]
            names = [
                k[: -len("_ms")] for k in first if k.endswith("_ms") and not k.endswith("spread_ms") and k != "floor_ms"
            ]
            ms = {n: statistics.median(r[f"{n}_ms"] for r in rs) for n in names}
            line = f"{s:8s} {first['optimizer']:16s} {first['hotness']:8s} "
            line += " ".join(f"{n} {v:6.1f}" for n, v in ms.items())
            for n in names[1:]:
                ratios = [r[f"speedup_vs_{n}"] for r in rs]
                line += f" | vs {n} {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
            if "floor_ms" in first:  # (the step's byte floor, bench_step.py)
                fr = [r["hybridembed_fraction_of_floor"] for r in rs]
                line += f" | at {statistics.median(fr):.2f} of its byte floor ({min(fr):.2f}-{max(fr):.2f})"
            tuned = {res["allocator_tuned"] for res in results}
            print(line + f"  [allocator tuned: {'/'.join(map(str, sorted(tuned)))}]")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2))
    return runs


if __name__ == "__main__":
    main()
