"""``gpucoll-tune RESULTS.json... -o tuning.json``: fit the cost model to measurements.

Reads gpucoll-bench ``--json`` documents (gpucoll/bench/report.py), groups rows by (backend, algorithm, link
class, collective, ranks), and fits ``time = steps * a + bytes * b`` by least squares over message sizes, with
steps and bytes per rank from the same schedule counts the selector uses (``_C.topo_model_terms``). It prints
each fit's quality (R^2 and the worst relative error) and writes ``{"fits": {"backend:algo@CLASS": {"a_s",
"b_s_per_byte", "source"}}}``, which the selector reads from GPUCOLL_TUNING_FILE. A fit below MIN_R2 or above
MAX_REL_ERROR is rejected with a warning: it goes under ``"rejected"``, which nothing reads, unless
--keep-poor-fits (then it stays in "fits", marked ``"poor"``). Exit status 1 when every fit was rejected.

The link class is not in a bench document: host-backend runs are SHM; for GPU runs pass ``--link-class NVL``
(or PIX, PXB, ...) as shown by gpucoll-topo on that machine.

Runs of NCCL across nodes (``--topology FILE`` of one node; the nodes are the documents' distinct hostnames) also
fit the NCCL model's network: the latency each inter-node step adds and the NICs' achieved fraction of line rate,
written as ``"nccl_model": {"net_latency_s", "eta_net"}`` (csrc/select/nccl_model.h).
"""

from __future__ import annotations

import argparse
import json
import sys
import types

import numpy as np

from gpucoll import topology
from gpucoll._help import HelpFormatter, reader_may_leave
from gpucoll._native import _C
from gpucoll.cli import calibrate

# A fit below either bar is left out of "fits" (kept under "rejected"), where the selector would read it.
# The selector picks the algorithm with the lowest predicted time, and near a crossover the candidates differ by
# well under 2x: a fit off by more than half at a size it was fitted on can put a slower algorithm first there.
# An R^2 below 0.9 says the line steps * a + bytes * b does not describe the series at all (a busy machine,
# a protocol switch inside the sweep), so its a and b are not the machine's numbers even where the error is small.
# For scale: on the recorded 4-rank host sweep of bench/results/cpu-2core-2026-11-21 (1K to 64M), tree fits with
# R^2 0.99 and a worst error of 24%; ring (0.73, 54%) and twoshot (0.87, 40%) do not, their largest sizes bending
# away from the line on that 2-core machine.
MIN_R2 = 0.9
MAX_REL_ERROR = 0.5


def quality_problem(fit: dict) -> str | None:
    """Why a fit would mislead the selector ("R^2 0.39 < 0.9, max err 88% > 50%"), or None when it is good."""
    why = []
    if fit["r2"] < MIN_R2:
        why.append(f"R^2 {fit['r2']:.2f} < {MIN_R2:g}")
    if fit["max_rel_error"] > MAX_REL_ERROR:
        why.append(f"max err {fit['max_rel_error'] * 100:.0f}% > {MAX_REL_ERROR * 100:.0f}%")
    return ", ".join(why) or None


def _row_algorithm(row: dict, backend: str) -> tuple[str, str]:
    """(backend, algorithm) a row measured: what "auto" resolved to where the row records it (gpucoll-bench's
    "algo_resolved": a host schedule, "custom:<kernel>" or "nccl"), else the algorithm it names."""
    algo = row.get("algo", "")
    resolved = row.get("algo_resolved") or ""
    if algo in ("", "auto") and resolved:
        if resolved == "nccl":
            return "nccl", ""
        return ("custom", resolved[7:]) if resolved.startswith("custom:") else (backend, resolved)
    return backend, algo


def _rows(doc: dict):
    env = doc.get("environment", {})
    backend = env.get("backend", "host")
    nranks = int(env.get("nranks", 0))
    coll = doc.get("config", {}).get("collective", "")
    for r in doc.get("results", []):
        for place in ("out_of_place", "in_place"):
            res = r.get(place) or {}
            if res.get("time") is not None and r.get("size"):
                # a row names its backend (a merged --backend a,b sweep joins the names in environment.backend)
                row_backend, algo = _row_algorithm(r, r.get("backend") or backend)
                yield row_backend, algo, r.get("collective") or coll, nranks, int(r["size"]), float(res["time"]) * 1e-6


# A series whose one line misses a size by more than this is split into size ranges with a line each (the tuning
# file's "pieces", cost.h Fit): NCCL switches protocol with size (LL, LL128, Simple: each its own latency and
# bandwidth) and a CPU's caches overflow, so one line from 4 KiB to 256 MiB leaves the middle sizes 10-30% off
# (the emulated device's NCCL stand-in: 13% at 16 MiB, 2026-11-28). Each range needs MIN_PIECE_SIZES sizes, so
# that its line is fitted, not drawn through two points. Noise is not a regime, and splitting it would pass a fit
# that should be rejected: where the one line does not describe the series (R^2 < MIN_R2), a split must at least
# halve the worst error (a regime change does, scattered points do not).
SPLIT_ABOVE = 0.1
MIN_PIECE_SIZES = 3
MAX_PIECES = 3


def _line(A, times):
    """(a, b, predictions): steps * a + bytes * b by least squares relative to each time, so that small and large
    messages count alike (otherwise the largest sizes alone decide the line)."""
    w = 1.0 / times
    coef, *_ = np.linalg.lstsq(A * w[:, None], times * w, rcond=None)
    a, b = float(max(coef[0], 0.0)), float(max(coef[1], 1e-15))
    return a, b, A @ np.array([a, b])


def _predict(A, sizes, pieces):
    """Each point's time under pieces [(from_bytes, a, b), ...], ascending: a size takes the last piece it reaches,
    and the first piece holds below its own from_bytes too (as cost.h Fit::at)."""
    out = np.empty(len(sizes))
    for i, s in enumerate(sizes):
        chosen = pieces[0]
        for p in pieces:
            if s >= p[0]:
                chosen = p
        out[i] = A[i] @ np.array(chosen[1:])
    return out


def _pieces(A, sizes, times, pieces, gain: float):
    """Split the worst range in two where that lowers the worst error most (to below `gain` times what it was),
    while a range misses by more than SPLIT_ABOVE and MAX_PIECES allows; the first piece's from_bytes is reported
    as 0 (it holds below too)."""
    while len(pieces) < MAX_PIECES:
        bounds = [p[0] for p in pieces] + [float("inf")]
        worst_i, worst_err = None, SPLIT_ABOVE
        for i in range(len(pieces)):
            m = (sizes >= bounds[i]) & (sizes < bounds[i + 1])
            err = float(np.max(np.abs(_predict(A[m], sizes[m], [pieces[i]]) - times[m]) / times[m]))
            if err > worst_err and len(set(sizes[m])) >= 2 * MIN_PIECE_SIZES:
                worst_i, worst_err = i, err
        if worst_i is None:
            break
        m = (sizes >= bounds[worst_i]) & (sizes < bounds[worst_i + 1])
        distinct = sorted(set(sizes[m]))
        best = None
        for cut in distinct[MIN_PIECE_SIZES:len(distinct) - MIN_PIECE_SIZES + 1]:
            lo, hi = m & (sizes < cut), m & (sizes >= cut)
            (a0, b0, p0), (a1, b1, p1) = _line(A[lo], times[lo]), _line(A[hi], times[hi])
            err = max(float(np.max(np.abs(p0 - times[lo]) / times[lo])), float(np.max(np.abs(p1 - times[hi]) / times[hi])))
            if best is None or err < best[0]:
                best = (err, (bounds[worst_i], a0, b0), (float(cut), a1, b1))
        if best is None or best[0] >= gain * worst_err:
            break
        pieces = pieces[:worst_i] + [best[1], best[2]] + pieces[worst_i + 1:]
    return [(0.0, pieces[0][1], pieces[0][2])] + pieces[1:]


def fit(docs, link_class: str = "", local: int = 0, keep_poor: bool = False) -> dict:
    """{"fits": ..., "rejected": ..., "skipped": [...]}: fits that fail MIN_R2 or MAX_REL_ERROR go to "rejected"
    (with "problem"), or with keep_poor stay in "fits" marked "poor"."""
    groups: dict = {}
    for doc in docs:
        for backend, algo, coll, nranks, size, t in _rows(doc):
            cls = link_class or ("SHM" if backend == "host" else "")
            if not cls:
                raise SystemExit(f"gpucoll-tune: backend {backend!r} results need --link-class (e.g. NVL, PIX)")
            model_backend = "custom" if backend == "custom" else "nccl" if backend == "nccl" else "host"
            groups.setdefault((model_backend, algo, cls, coll, nranks), []).append((size, t))
    fits, rejected, skipped = {}, {}, []
    for (backend, algo, cls, coll, nranks), pts in sorted(groups.items()):
        if backend == "nccl" and algo in ("", "auto", "nccl"):
            # NCCL picks its own algorithm (gpucoll-bench runs it as auto): fit the pattern the model prices
            # NCCL with for this collective (a ring, or send/recv for all_to_all, gather and scatter).
            algo = "ring" if _C.topo_model_terms("nccl", "ring", coll, nranks, local) else "direct"
        if algo in ("", "auto"):
            skipped.append(f"{backend}:auto {coll} {nranks} ranks: the rows do not say which algorithm auto ran "
                           f"(a gpucoll-bench without 'algo_resolved'); rerun the benchmark, or with --algo all")
            continue
        terms = _C.topo_model_terms(backend if backend != "host" else "custom", algo, coll, nranks, local)
        if terms is None or len({size for size, _ in pts}) < 2:  # in and out of place give two points per size
            why = "fewer than two sizes" if terms is not None else f"the model has no {algo!r} for {coll}"
            skipped.append(f"{backend}:{algo} {coll} {nranks} ranks: {why}")
            continue
        steps, per_byte = terms
        sizes = np.array([p[0] for p in pts], dtype=float)
        times = np.array([p[1] for p in pts], dtype=float)
        # Columns: steps (latency term) and bytes moved per rank (bandwidth term).
        A = np.stack([np.full_like(sizes, steps), sizes * per_byte], axis=1)
        a, b, pred = _line(A, times)
        ss_tot = float(np.sum((times - times.mean()) ** 2)) or 1.0
        line_r2 = 1 - float(np.sum((times - pred) ** 2)) / ss_tot
        pieces = _pieces(A, sizes, times, [(float(sizes.min()), a, b)], 1.0 if line_r2 >= MIN_R2 else 0.5)
        pred = _predict(A, sizes, pieces)
        worst = float(np.max(np.abs(pred - times) / times))
        key = f"{backend}:{algo}@{cls}"
        entry = {"a_s": pieces[0][1], "b_s_per_byte": pieces[0][2], "collective": coll, "nranks": nranks,
                 "points": len(pts), "r2": 1 - float(np.sum((times - pred) ** 2)) / ss_tot, "max_rel_error": worst,
                 "source": f"gpucoll-tune fit of {len(pts)} points ({coll}, {nranks} ranks)"}
        if len(pieces) > 1:
            entry["pieces"] = [{"from_bytes": lo, "a_s": pa, "b_s_per_byte": pb} for lo, pa, pb in pieces[1:]]
            entry["one_line_max_rel_error"] = float(np.max(np.abs(A @ np.array([a, b]) - times) / times))
        problem = quality_problem(entry)
        if problem and keep_poor:
            fits[key] = dict(entry, poor=True, problem=problem)
        elif problem:
            rejected[key] = dict(entry, problem=problem)
        else:
            fits[key] = entry
    return {"format": "gpucoll-tuning", "version": 1, "fits": fits, "rejected": rejected, "skipped": skipped}


def fit_network(docs, topo) -> dict | None:
    """NCCL's network terms from multi-node NCCL runs: per row, the model's time of NCCL's pick is
    base + steps * latency + net_s / eta (nccl_model.h NetTerms); latency and 1/eta by relative least squares."""
    A, y = [], []
    for doc in docs:
        hosts = sorted({d.get("hostname", "") for d in doc.get("devices") or []})
        nranks = int(doc.get("environment", {}).get("nranks", 0))
        if len(hosts) < 2 or nranks % len(hosts):
            continue
        nodes = len(hosts)
        t = topology.replicate(topo, nodes) if topo.num_hosts == 1 else topo
        for backend, _algo, coll, _n, size, secs in _rows(doc):
            if backend != "nccl" or not coll:
                continue
            terms = _C.topo_nccl_net_terms(t, coll, size, nranks_per_node=nranks // nodes, nodes=nodes)
            A.append([terms["net_steps"] / secs, terms["net_s"] / secs])
            y.append((secs - terms["base_s"]) / secs)
    if len(y) < 2:
        return None
    A, y = np.array(A), np.array(y)
    cols = [j for j in range(2) if np.any(A[:, j] > 0)]
    coef, *_ = np.linalg.lstsq(A[:, cols], y, rcond=None)
    got = dict(zip(cols, coef))
    out = {"points": len(y), "net_latency_s": float(max(got.get(0, 0.0), 0.0))}
    if 1 in got and got[1] > 0:
        out["eta_net"] = float(min(1.0 / got[1], 1.0))
    return out


def print_fits(out: dict) -> None:
    """The fit table on stdout, and one warning on stderr per fit that would mislead auto."""
    print(f"{'entry':<32} {'a (us/step)':>12} {'b (ns/B)':>10} {'GB/s':>8} {'points':>7} {'R^2':>7} {'max err':>8}  "
          f"fit")
    entries = [(k, f, "POOR (kept: --keep-poor-fits)" if f.get("poor") else "good") for k, f in out["fits"].items()]
    entries += [(k, f, "REJECTED") for k, f in out["rejected"].items()]
    for key, f, verdict in entries:
        print(f"{key:<32} {f['a_s'] * 1e6:>12.3f} {f['b_s_per_byte'] * 1e9:>10.4f} {1 / f['b_s_per_byte'] / 1e9:>8.2f} "
              f"{f['points']:>7} {f['r2']:>7.4f} {f['max_rel_error'] * 100:>7.1f}%  {verdict}")
    for key, f, verdict in entries:
        if verdict != "good":
            what = ("written to \"fits\" anyway: auto will use it" if f.get("poor") else
                    "kept under \"rejected\", not \"fits\": auto keeps its default model for it")
            print(f"gpucoll-tune: warning: {key} fits badly ({f['problem']}): {what}", file=sys.stderr)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpucoll-tune", formatter_class=HelpFormatter, description=(
        "Fit the cost model to measurements: time = steps * a + bytes * b per (backend, algorithm, link class),\n"
        "from gpucoll-bench --json runs; the tuning file it writes is read through GPUCOLL_TUNING_FILE."))
    p.add_argument("results", nargs="*", help="gpucoll-bench --json files (none with --calibrate)")
    p.add_argument("-o", "--output", required=True, help="tuning JSON to write (use with GPUCOLL_TUNING_FILE)")
    p.add_argument("--link-class", default="", help="link class of GPU runs (NVL, PIX, PXB, PHB, NODE, SYS, NET, "
                   "as gpucoll-topo shows them); host runs are SHM")
    p.add_argument("--local-size", type=int, default=0, help="ranks per node of hierarchical runs (0: one node)")
    p.add_argument("--topology", metavar="FILE", help="one node's topology (any gpucoll-topo input): fit the NCCL "
                   "model's network latency and efficiency from NCCL runs across nodes; with --calibrate, the "
                   "machine the model describes (default: detected, or GPUCOLL_TOPO_FILE)")
    p.add_argument("--keep-poor-fits", action="store_true", help=f"write fits below R^2 {MIN_R2:g} or above "
                   f"{MAX_REL_ERROR * 100:.0f}%% max error into \"fits\" too, marked \"poor\" (auto then uses them); "
                   "without it they go to \"rejected\", which nothing reads")
    c = p.add_argument_group("calibration", (
        "  gpucoll-tune --calibrate -o tuning.json: measure this machine for --seconds (a short sweep of each\n"
        "  backend), fit it, and print each measured size's time as the model predicted it before and after"))
    c.add_argument("--calibrate", action="store_true", help="run the sweep here instead of reading results")
    c.add_argument("--seconds", type=float, default=60.0, help="wall-time budget of the whole calibration, "
                   "the ranks' start-up included (default: 60)")
    c.add_argument("--nranks", type=int, default=0, help="ranks to spawn (default: the topology's GPUs, at least 2)")
    c.add_argument("--backend", default="auto", help="comma list of nccl, custom, host (default auto: nccl and "
                   "custom where a GPU is usable, else host)")
    c.add_argument("--coll", default="all_reduce", help="collective to sweep (default: all_reduce)")
    c.add_argument("--min-bytes", default="4K", help="smallest size (default: 4K)")
    c.add_argument("--max-bytes", default="256M", help="largest size; the sweep stops earlier where one call "
                   "would take more than a sixtieth of the budget (default: 256M)")
    return p


@reader_may_leave
def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.calibrate:
        if args.results:
            parser.error("--calibrate measures this machine: give no results files")
        return calibrate.main(args, types.SimpleNamespace(fit=fit, row_algorithm=_row_algorithm,
                                                          print_fits=print_fits))
    if not args.results:
        parser.error("give gpucoll-bench --json files, or --calibrate to measure this machine")
    docs = []
    for path in args.results:
        with open(path) as f:
            docs.append(json.load(f))
    out = fit(docs, args.link_class, args.local_size, args.keep_poor_fits)
    if args.topology:
        net = fit_network(docs, topology.load(args.topology))
        if net is None:
            print("gpucoll-tune: --topology given but no NCCL run spans two or more hosts", file=sys.stderr)
        else:
            out["nccl_model"] = {k: v for k, v in net.items() if k != "points"}
            print(f"NCCL network from {net['points']} points: latency {net['net_latency_s'] * 1e6:.1f} us/step"
                  + (f", NICs at {net['eta_net'] * 100:.0f}% of line rate" if "eta_net" in net else ""))
    for line in out.pop("skipped"):
        print(f"gpucoll-tune: skipped {line}", file=sys.stderr)
    if not out["fits"] and not out["rejected"] and "nccl_model" not in out:
        print("gpucoll-tune: no (algorithm, size) series with at least two sizes in the input. Rows run as 'auto' "
              "count under the algorithm auto picked at each size, so a sweep where auto changes its pick gives each "
              "algorithm only some sizes: rerun gpucoll-bench with --algo all (every algorithm at every size)",
              file=sys.stderr)
        return 2
    print_fits(out)
    if any(f.get("poor") for f in out["fits"].values()) or out["rejected"]:
        print(f"gpucoll-tune: a fit needs R^2 >= {MIN_R2:g} and a max error <= {MAX_REL_ERROR * 100:.0f}%, or it would "
              f"mislead auto; for better fits, rerun gpucoll-bench on an idle machine with more iterations (-n 50) and "
              f"--algo all" + ("" if args.keep_poor_fits else " (--keep-poor-fits writes poor ones anyway)"),
              file=sys.stderr)
    with open(args.output, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    if not out["fits"] and "nccl_model" not in out:
        print(f"gpucoll-tune: every fit was rejected: {args.output} holds none that auto would use", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
