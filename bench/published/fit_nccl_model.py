"""Fit the NCCL execution model's efficiencies (csrc/topo/nccl_model.cc kDefaults) to the dataset's calibrate points.

    python bench/published/fit_nccl_model.py [--dataset tests/fixtures/published/nccl_allreduce.json]

Least squares on log(predicted / published busbw) over the points whose role is "calibrate" - validation points
never enter the fit. Prints the fitted parameters (paste them into kDefaults) and the error table they give.
Deterministic: Levenberg-Marquardt from the shipped defaults (gpucoll/_loso.py's, parameters in log space so they
stay positive). net_latency_s is not fitted here (no published small-message multi-node point calibrates it);
gpucoll-tune fits it from a cluster's own gpucoll-bench runs.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

from gpucoll import _C
from gpucoll import _loso as L
from gpucoll import _published as P

FITTED = L.FITTED


def residuals(doc: dict, params: dict) -> np.ndarray:
    tuning = json.dumps({"nccl_model": params})
    rows = [r for r in P.evaluate(doc, tuning) if r["role"] == "calibrate"]
    return np.array([math.log(r["pred"] / r["busbw"]) for r in rows])


def fit(doc: dict, iters: int = 60) -> dict:
    return L.levenberg_marquardt(lambda params: residuals(doc, params), dict(_C.topo_nccl_params("")), iters)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default=str(P.DATASET))
    args = ap.parse_args(argv)
    doc = P.load(args.dataset)
    fitted = fit(doc)
    print("fitted parameters (calibrate points only):")
    for k in FITTED:
        print(f"  {k:<14} {fitted[k]:.4g}")
    print(P.format_table(P.evaluate(doc, json.dumps({"nccl_model": fitted})), points=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
