"""Print how well the NCCL model predicts systems it was not fitted to: leave-one-system-out (the headline), then
the shipped model's error point by point.

    python bench/published/accuracy.py [--summary] [--tuning tuning.json] [--dataset FILE] [--write-table]

Leave-one-system-out (gpucoll/_loso.py): for each system of tests/fixtures/published/nccl_allreduce.json, the
execution model's efficiencies are refitted on every other system and the left-out one is predicted; the table
gives the median and worst |error| per class and per path kind, and says which classes have one source only
(those cannot be validated this way). Then the intervals (csrc/select/nccl_interval.cc) scored the same way:
how often a left-out point lies inside the interval built without its system, and how wide it is.
--write-table regenerates bench/published/loso_table.json and, from it, csrc/select/nccl_evidence.inc (the
intervals' evidence); tests/topo/test_loso.py checks both against the dataset.

The point-by-point table below it is the shipped model ('calibrate' points are the ones its constants were
fitted to, bench/published/fit_nccl_model.py); excluded points are listed with the reason they are not scored.
"""

from __future__ import annotations

import argparse
import pathlib

from gpucoll import _loso as L
from gpucoll import _published as P

TABLE = pathlib.Path(__file__).resolve().parent / "loso_table.json"
EVIDENCE = pathlib.Path(__file__).resolve().parents[2] / "csrc" / "select" / "nccl_evidence.inc"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--summary", action="store_true", help="only the per-class tables")
    ap.add_argument("--tuning", metavar="FILE", help="a tuning JSON whose nccl_model parameters replace the defaults")
    ap.add_argument("--dataset", default=str(P.DATASET))
    ap.add_argument("--iters", type=int, default=25, help="Levenberg-Marquardt iterations per fold")
    ap.add_argument("--write-table", action="store_true", help=f"write the leave-one-system-out rows to {TABLE}")
    args = ap.parse_args(argv)
    doc = P.load(args.dataset)
    rows = L.loso(doc, args.iters)
    print("# leave-one-system-out: each system predicted by the model refitted on all the others")
    print(L.format_loso(rows, doc))
    print("\n# intervals on left-out systems: each built from the other systems' evidence only")
    print(L.format_coverage(L.coverage(rows, doc)))
    if args.write_table:
        L.write_table(rows, TABLE)
        EVIDENCE.write_text(L.evidence_inc(L.evidence(rows, doc)))
        print(f"# wrote {TABLE} and {EVIDENCE} (rebuild the C++ to ship it)")
    tuning = pathlib.Path(args.tuning).read_text() if args.tuning else ""
    shipped = P.evaluate(doc, tuning)
    print("\n# the shipped model (its constants fitted to the calibrate points)")
    print(P.format_table(shipped, points=not args.summary))
    for r in shipped:
        if r["role"] == "excluded":
            print(f"excluded {r['system']} {r['busbw']:g} GB/s (model {r['pred']:.1f}): {r['reason']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
