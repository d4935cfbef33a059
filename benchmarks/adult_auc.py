"""UCI Adult: test AUC of a plain PyTorch model vs the same model after ``he.convert``, trained identically.

    python benchmarks/adult_auc.py --data ../shared/data/adult.parquet                # wdl, Adagrad, 5 epochs
    python benchmarks/adult_auc.py --data ../shared/data/adult.parquet --model all --json bench_out/adult_auc.json

Split: a fixed permutation (seed 0) of the 48,842 rows, 39,074 train / 9,768 test; numeric
features standardised with the training split's statistics; one ``nn.Embedding`` per
categorical feature over the training split's vocabulary (0: unseen). The converted model
starts from a copy of the plain one's weights and sees the same batches in the same order.
Exit code 1 when any AUC differs by more than ``--tolerance`` (0.003).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from hybridembed.train.compare import OPTIMIZERS, compare_adult
from hybridembed.train.models import MODELS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=os.path.join("..", "shared", "data", "adult.parquet"), help="adult.parquet")
    p.add_argument("--model", default="wdl", choices=[*MODELS, "all"])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--optimizer", default="adagrad", choices=list(OPTIMIZERS))
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tolerance", type=float, default=0.003)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    kinds = list(MODELS) if args.model == "all" else [args.model]
    print(f"{'model':<7} {'plain AUC':>10} {'converted AUC':>14} {'|diff|':>8} {'max |p diff|':>13} {'mean |p diff|':>14} "
          f"{'plain s':>8} {'converted s':>12}")  # fmt: skip
    results, worst = [], 0.0
    for kind in kinds:
        r = compare_adult(args.data, kind, args.epochs, args.batch_size, args.optimizer, args.lr, seed=args.seed)
        results.append(r.as_dict())
        worst = max(worst, r.auc_diff)
        print(f"{kind:<7} {r.plain_auc:>10.4f} {r.converted_auc:>14.4f} {r.auc_diff:>8.4f} {r.max_abs_prob_diff:>13.2e} {r.mean_abs_prob_diff:>14.2e} "
              f"{r.plain_seconds:>8.1f} {r.converted_seconds:>12.1f}", flush=True)  # fmt: skip
    first = results[0]
    print(f"{args.optimizer} lr {args.lr:g}, {args.epochs} epochs, batch {args.batch_size}; "
          f"train {first['train_rows']:,} / test {first['test_rows']:,} rows")  # fmt: skip
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                {"command": " ".join(["python", "benchmarks/adult_auc.py", *sys.argv[1:]]), "results": results},
                f,
                indent=1,
            )
    ok = worst <= args.tolerance
    print(f"largest |AUC difference| {worst:.4f} {'<=' if ok else '>'} {args.tolerance}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
