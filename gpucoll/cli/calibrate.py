"""``gpucoll-tune --calibrate -o tuning.json``: measure this machine for a minute, fit, say how much it fixed.

A topology tells the model which links there are, not what this machine's software and hardware make of them:
a driver, a BIOS setting, a busy CPU, NCCL's version, an emulated device. A short sweep (gpucoll/bench/sweep.py,
bounded by --seconds of wall time, process start-up included) measures the backends gpucoll would choose
between; gpucoll-tune's fit (cli/tune.py) turns each backend/algorithm's series into the a (per step) and
b (per byte) that replace the model's time for it, keyed by the link class the model gives that pattern on this
topology; the file also gets a "calibration" record: every measured size with the model's prediction before the
file and after it, and the wall time spent.

What the sweep can fix is what it measures: the backends, algorithms, collective and world size it ran, and sizes
inside its range (above it the b it fitted extrapolates). It cannot fix the topology itself (a wrong link
class stays wrong: the fit is stored under the class the model gives, and applies wherever the model gives it).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time

from gpucoll import config, topology
from gpucoll._native import _C
from gpucoll.bench import cli as bench_cli
from gpucoll.bench import harness, sweep
from gpucoll.bench.args import parse_args
from gpucoll.bench.usage import UsageError

FIT_RESERVE_S = 2.0  # of the budget, kept for the ranks' exit, the fit, the predictions and writing the file
BUDGET_FLOOR_S = 5.0  # below this the ranks' start-up alone can use the budget


def _params(args, backend: str, n: int) -> harness.Params:
    argv = [args.coll, "-b", str(args.min_bytes), "-e", str(args.max_bytes), "-f", "4", "-w", "1", "-c", "1",
            "--backend", backend, "--nranks", str(n), "--algo", "all" if backend == "custom" else "auto"]
    try:
        p = parse_args(argv)
    except SystemExit:
        raise UsageError(f"cannot sweep {' '.join(argv)}") from None
    (asked, q), = bench_cli.plan_backends(p)
    bench_cli.check_world(q, n)
    bench_cli.check_backend(q, n, asked)
    bench_cli._fit_memory(q, n)
    return q


def _backends(asked: str) -> list[str]:
    """--backend: nccl and/or custom (auto: both; those that cannot run here are skipped with the reason). The
    host backend is fitted from gpucoll-bench --backend host runs: it has no topology to get wrong."""
    out = ["nccl", "custom"] if asked == "auto" else [b.strip() for b in asked.split(",") if b.strip()]
    bad = [b for b in out if b not in ("nccl", "custom")]
    if bad:
        raise UsageError(f"--calibrate measures the GPU backends (nccl, custom), not {bad[0]!r}; the host backend is "
                         f"fitted from gpucoll-bench --backend host --json runs (gpucoll-tune FILE.json)")
    if _C.cuda_probe().get("device_count", 0) == 0:
        raise UsageError("--calibrate measures the GPU backends and this machine has no usable CUDA device")
    return out


def _candidates(topo, coll: str, n: int, nbytes: int, tuning: str = "") -> list:
    """The model's candidates for n ranks placed as the sweep placed them: rank r on GPU r mod (the topology's
    GPUs), so that ranks sharing a GPU (more ranks than GPUs, as on a one-GPU machine) are priced so."""
    gpus = [r % topo.num_gpus for r in range(n)]
    return _C.topo_candidates(topo, coll, nbytes, "float32", n, 1, True, True, True, tuning, gpus=gpus)


def _link_class(topo, coll: str, n: int, backend: str, algo: str, nbytes: int) -> str:
    """The class the model prices this backend/algorithm's pattern with on this topology: the fit's key."""
    want = "ring" if backend == "nccl" else algo
    for c in _candidates(topo, coll, n, nbytes):
        if c["backend"] == backend and c["algorithm"] == want and c["link_class"]:
            return c["link_class"]
    raise UsageError(f"the model has no {backend}:{want} on this topology for {n} ranks; give --link-class")


def _row_algo(tune, row: dict) -> tuple[str, str]:
    backend, algo = tune.row_algorithm(row, row.get("backend", ""))
    return backend, algo


def predict(topo, coll: str, n: int, backend: str, algo: str, nbytes: int, tuning: str) -> tuple[float, str]:
    """(seconds, model) the model gives the call the row measured: NCCL's own pick for NCCL rows, the named
    kernel for custom rows, the host algorithm for host rows."""
    for c in _candidates(topo, coll, n, nbytes, tuning):
        if not c["usable"] or c["backend"] != backend:
            continue
        if (backend == "nccl" and c.get("nccl_auto")) or (backend != "nccl" and c["algorithm"] == algo):
            # The model has no time for some layouts (NCCL's ranks sharing one GPU): None, not an infinity that
            # json would write as the non-JSON "Infinity" the selector's parser refuses.
            return (c["seconds"] if math.isfinite(c["seconds"]) else None), c["model"]
    return None, "not usable"


def _spread(samples: list) -> float:
    """Half the interquartile range of a size's rounds over their median: how far this machine's own repeats of
    the measurement stray from it (a busy machine's), below which no model can be asked to come."""
    if len(samples) < 4:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return (q3 - q1) / 2 / statistics.median(samples)


def _errors(points: list, key: str) -> dict:
    errs = [abs(p[key] / p["measured_s"] - 1) for p in points if p[key] is not None]
    return {"median": statistics.median(errs), "max": max(errs)} if errs else {"median": None, "max": None}


def calibrate(args, topo, backends: list, started: float, tune) -> dict:
    """Sweep, fit, predict: the tuning document, with its "calibration" record."""
    n = args.nranks or max(2, topo.num_gpus)
    docs, skipped = [], []
    for i, backend in enumerate(backends):
        # Each backend gets an equal share of what is left, its ranks' start-up included.
        left = started + args.seconds - FIT_RESERVE_S - time.time()
        deadline = time.time() + left / (len(backends) - i)
        try:
            q = _params(args, backend, n)
        except UsageError as e:
            skipped.append(f"{backend}: {e}")
            continue
        results = harness.run_local(sweep.run_rank, q, n, (q, deadline))
        results[0]["doc"]["sweep"]["ranks_done_past_deadline_s"] = round(time.time() - deadline, 3)
        docs.append(results[0]["doc"])
    out: dict = {"format": "gpucoll-tuning", "version": 1, "fits": {}, "rejected": {}, "skipped": skipped}
    for doc in docs:
        row = doc["results"][len(doc["results"]) // 2]
        backend, algo = _row_algo(tune, row)
        cls = args.link_class or _link_class(topo, args.coll, n, backend, algo, int(row["size"]))
        got = tune.fit([doc], cls, keep_poor=args.keep_poor_fits)
        for k in ("fits", "rejected"):
            out[k].update(got[k])
        out["skipped"] += got["skipped"]
    before_text = ""  # the model as it stands: GPUCOLL_TUNING_FILE if set, else the shipped defaults
    after_text = json.dumps({"fits": out["fits"]}) if out["fits"] else ""
    points = []
    for doc in docs:
        for row in doc["results"]:
            backend, algo = _row_algo(tune, row)
            measured = row["out_of_place"]["time"] * 1e-6
            before, _ = predict(topo, args.coll, n, backend, algo, int(row["size"]), before_text)
            after, model = predict(topo, args.coll, n, backend, algo, int(row["size"]), after_text or before_text)
            points.append({"backend": backend, "algorithm": algo or "auto", "bytes": int(row["size"]),
                           "measured_s": measured, "spread": _spread(row.get("samples_us", [])),
                           "rounds_us": row.get("samples_us", []), "before_s": before, "after_s": after,
                           "after_model": model})
    emulated = any(r.get("emulated") for d in docs for r in d["results"])
    out["calibration"] = {
        "collective": args.coll, "nranks": n, "topology": args.topology or config.get("GPUCOLL_TOPO_FILE") or
        "detected", "budget_s": args.seconds, "wall_s": round(time.time() - started, 3), "emulated": emulated,
        "rounds": {d["environment"]["backend"]: d["sweep"]["rounds"] for d in docs},
        "sweep": {d["environment"]["backend"]: d["sweep"] for d in docs},
        "error_before": _errors(points, "before_s"), "error_after": _errors(points, "after_s"), "points": points,
        "note": ("measured on gpucoll's emulated CUDA device: not GPU timings" if emulated else
                 "after: the tuned model on the sizes it was fitted to")}
    return out


def _us(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e6:.1f}"


def _err(p: dict, key: str) -> str:
    return "-" if p[key] is None else f"{(p[key] / p['measured_s'] - 1) * 100:+.0f}%"


def report(out: dict, stream=sys.stdout) -> None:
    cal = out["calibration"]
    if cal["emulated"]:
        print("# gpucoll's emulated CUDA device: these timings are not GPU timings (the calibration's mechanics only)",
              file=stream)
    print(f"{'backend:algorithm':<20} {'bytes':>10} {'measured us':>12} {'spread':>7} {'model us':>10} {'err':>7} "
          f"{'tuned us':>10} {'err':>7}", file=stream)
    for p in cal["points"]:
        print(f"{p['backend'] + ':' + p['algorithm']:<20} {p['bytes']:>10} {_us(p['measured_s']):>12} "
              f"{p['spread'] * 100:>6.0f}% {_us(p['before_s']):>10} {_err(p, 'before_s'):>7} {_us(p['after_s']):>10} "
              f"{_err(p, 'after_s'):>7}", file=stream)
    b, a = cal["error_before"], cal["error_after"]
    if b["median"] is not None:
        within = sum(p["after_s"] is not None and abs(p["after_s"] / p["measured_s"] - 1) <= 0.1 for p in cal["points"])
        print("# measured: the median of each size's rounds; spread: half their interquartile range, relative",
              file=stream)
        print(f"model error on the measured sizes: median {b['median'] * 100:.0f}%, worst {b['max'] * 100:.0f}% "
              f"before; median {a['median'] * 100:.1f}%, worst {a['max'] * 100:.1f}% with the tuning file, "
              f"{within} of {len(cal['points'])} sizes within 10% ({cal['wall_s']:.1f} s of {cal['budget_s']:g} s, "
              f"rounds {cal['rounds']})", file=stream)


def main(args, tune) -> int:
    """gpucoll-tune --calibrate: tune.main parsed the arguments and passes its fitting functions (`tune`: fit,
    row_algorithm, print_fits), so that this module, which tune imports, does not import tune back."""
    started = time.time()
    if args.seconds < BUDGET_FLOOR_S:
        print(f"gpucoll-tune: --seconds {args.seconds:g} leaves no time for a sweep: at least {BUDGET_FLOOR_S:g}",
              file=sys.stderr)
        return 2
    if not sweep.supported(args.coll):
        print(f"gpucoll-tune: --calibrate fits collectives with algorithms; {args.coll} has none", file=sys.stderr)
        return 2
    topo = topology.load(args.topology) if args.topology else topology.detect()
    if topo.num_hosts > 1:
        print(f"gpucoll-tune: --calibrate spawns its ranks on this machine; the topology has {topo.num_hosts} hosts: "
              f"give one node's (the network is fitted from gpucoll-bench runs across nodes, --topology)",
              file=sys.stderr)
        return 2
    try:
        backends = _backends(args.backend)
        out = calibrate(args, topo, backends, started, tune)
    except UsageError as e:
        print(f"gpucoll-tune: {e}", file=sys.stderr)
        return 2
    for line in out.pop("skipped"):
        print(f"gpucoll-tune: skipped {line}", file=sys.stderr)
    tune.print_fits(out)
    report(out)
    with open(args.output, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    return 0 if out["fits"] else 1
