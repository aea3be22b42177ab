"""What the flight recorder costs: the same all_reduce on two communicators of the same ranks, recorder on and off.

    python bench/trace_overhead.py                            # 2 ranks, 8 B float32 all_reduce, 9 rounds
    python bench/trace_overhead.py --nranks 4 --bytes 64K --rounds 15 --json out.json

Host backend, P ranks (gpucoll.spawn). Every rank splits three communicators from one, built alike but for
GPUCOLL_TRACE_BUFFER: "on" and "control" record (2000 entries), "off" does not (0). Each round times `calls` in-place
sum all_reduces on each, in turn, after a barrier (the order rotates every round); a round's time is the slowest
rank's. Taken in turn, the three see the same drift of a shared machine's speed. Reported: the median per-call time
of each, and the medians over rounds of on/off (the overhead) and on/control (the noise floor: two identical
communicators). On a shared 2-core machine the other tenants move every figure: compare the ratios of one run, and
run it twice.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

import gpucoll
from gpucoll._help import HelpFormatter


def _bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _time(comm, x, calls: int) -> float:
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        comm.all_reduce(x)
    return (time.perf_counter() - t0) / calls * 1e6


def _rank(comm, rounds: int, calls: int, nbytes: int) -> dict:
    comms = {}
    # Three communicators split from the same one (same processes, region size and algorithm), built the same way,
    # so they differ only in the recorder: "on" and "control" record, "off" does not. on/control is the noise floor
    # of the comparison on this machine at this moment.
    for name, entries in (("on", "2000"), ("control", "2000"), ("off", "0")):
        os.environ["GPUCOLL_TRACE_BUFFER"] = entries  # read when the split builds its HostComm
        comms[name] = comm.split(0)
    assert comms["off"].trace()["capacity"] == 0 and comms["on"].trace()["capacity"] == 2000
    x = np.full(max(1, nbytes // 4), 1.0, np.float32)
    for c in comms.values():
        for _ in range(max(10, calls // 10)):
            c.all_reduce(x)
    out = {name: [] for name in comms}
    names = list(comms)
    for r in range(rounds):
        for name in names[r % 3:] + names[:r % 3]:  # each takes each place in the order equally often
            out[name].append(_time(comms[name], x, calls))
    out["recorded"] = comms["on"].trace()["recorded"]
    for c in comms.values():
        c.close()
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    ap.add_argument("--nranks", type=int, default=2, help="ranks (processes on this machine)")
    ap.add_argument("--bytes", default="8", help="message size (8, 64K, 1M)")
    ap.add_argument("--rounds", type=int, default=9, help="rounds; each times every communicator once")
    ap.add_argument("--calls", type=int, default=20000, help="calls per timed block")
    ap.add_argument("--json", default=None, help="write the figures here")
    return ap


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    nbytes = _bytes(a.bytes)
    res = gpucoll.spawn(_rank, a.nranks, args=(a.rounds, a.calls, nbytes), backend="host", timeout=300)
    worst = {k: [max(r[k][i] for r in res) for i in range(a.rounds)] for k in ("on", "control", "off")}
    ratio = [x / y for x, y in zip(worst["on"], worst["off"])]
    floor = [x / y for x, y in zip(worst["on"], worst["control"])]
    med = {k: statistics.median(v) for k, v in worst.items()}
    report = {"nranks": a.nranks, "bytes": nbytes, "rounds": a.rounds, "calls": a.calls, "us": worst,
              "median_us": med, "median_on_off": statistics.median(ratio), "overhead": statistics.median(ratio) - 1,
              "median_on_control": statistics.median(floor), "recorded": res[0]["recorded"],
              "loadavg": os.getloadavg()}
    print(f"{a.nranks} ranks, {nbytes} B all_reduce, {a.rounds} rounds x {a.calls} calls, median us/call: recorder on "
          f"{med['on']:.3f}, on (control) {med['control']:.3f}, off {med['off']:.3f}; per round, median on/off "
          f"{report['median_on_off']:.4f} (the overhead), on/control {report['median_on_control']:.4f} (the noise "
          f"floor); load average {report['loadavg'][0]:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
