"""Print the NCCL model's error against published nccl-tests results, point by point and per class.

    python bench/published/accuracy.py [--summary] [--tuning tuning.json] [--dataset FILE]

The dataset is tests/fixtures/published/nccl_allreduce.json; 'calibrate' points are the ones the shipped
constants were fitted to (bench/published/fit_nccl_model.py), 'validate' points were never fitted. Excluded points
are listed with the model's prediction and the reason they are not scored.
"""

from __future__ import annotations

import argparse
import pathlib

from gpucoll import _published as P


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--summary", action="store_true", help="only the per-class table")
    ap.add_argument("--tuning", metavar="FILE", help="a tuning JSON whose nccl_model parameters replace the defaults")
    ap.add_argument("--dataset", default=str(P.DATASET))
    args = ap.parse_args(argv)
    tuning = pathlib.Path(args.tuning).read_text() if args.tuning else ""
    rows = P.evaluate(P.load(args.dataset), tuning)
    print(P.format_table(rows, points=not args.summary))
    for r in rows:
        if r["role"] == "excluded":
            print(f"excluded {r['system']} {r['busbw']:g} GB/s (model {r['pred']:.1f}): {r['reason']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
