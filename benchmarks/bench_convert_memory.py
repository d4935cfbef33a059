"""``he.convert``'s memory: peak and steady RSS of converting a DLRM-sized model, against the
model's own bytes (issue 24's target: peak <= 1.15x the model's tables).

    python benchmarks/bench_convert_memory.py                 # Criteo Kaggle's 26 tables, <= 2M rows, dim 64
    python benchmarks/bench_convert_memory.py --max-rows 100000 --dim 16   # smoke

The model is 26 ``nn.EmbeddingBag(rows, D)`` layers with the row counts of Criteo Kaggle's 26
categorical features (as facebookresearch/dlrm reads them), each capped at ``--max-rows`` (dlrm's
``--max-ind-range``), and a small MLP. It is built and touched in a fresh process (the rows
resident, as after ``torch.manual_seed``-initialised construction), then converted; RSS is read
from ``/proc/self/status`` (VmRSS, and VmHWM for the peak; Linux).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

KAGGLE = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
          5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]  # fmt: skip

_CHILD = """
import json, sys, torch
from torch import nn
import hybridembed as he
rows, dim = json.loads(sys.argv[1]), int(sys.argv[2])
def status(key):  # this process's own VmRSS / VmHWM (getrusage's ru_maxrss keeps the parent's across exec)
    line = next(x for x in open("/proc/self/status") if x.startswith(key))
    return int(line.split()[1]) * 1024
def rss():
    return status("VmRSS:")
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb_l = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum") for n in rows)
        self.top = nn.Sequential(nn.Linear(dim * len(rows), 512), nn.ReLU(), nn.Linear(512, 1))
model = Model()
tables = sum(n * dim * 4 for n in rows)
before = rss()
peak_before = status("VmHWM:")
he.convert(model)
after = rss()
peak = status("VmHWM:")
print(json.dumps({"tables_bytes": tables, "rss_before": before, "rss_after": after, "peak": peak,
                  "peak_before": peak_before}))
"""


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-rows", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    rows = [min(n, args.max_rows) for n in KAGGLE]
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(rows), str(args.dim)], capture_output=True, text=True, check=False
    )
    if out.returncode:
        sys.exit(out.stderr)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    size, base = r["tables_bytes"], r["rss_before"] - r["tables_bytes"]  # (the process without its tables)
    r["peak_vs_tables"] = (r["peak"] - base) / size
    r["after_vs_tables"] = (r["rss_after"] - base) / size
    gib = 2**30
    print(
        f"26 tables, {sum(rows):,} rows x {args.dim}: {size / gib:.2f} GiB; process before convert "
        f"{r['rss_before'] / gib:.2f} GiB, peak {r['peak'] / gib:.2f} GiB, after {r['rss_after'] / gib:.2f} GiB; "
        f"convert's peak = {r['peak_vs_tables']:.2f}x the tables (target <= 1.15x), after {r['after_vs_tables']:.2f}x"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), **r}, f, indent=2)
    return r


if __name__ == "__main__":
    main()
