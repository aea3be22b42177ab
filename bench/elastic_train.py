"""Elastic training without a restart: 4 ranks fit a small linear model with data-parallel SGD (gradients averaged
by all_reduce on the host backend); at step --at rank --kill is killed with SIGKILL while the others wait for it
inside that step's all_reduce; the other 3 shrink their communicator, take rank 0's parameters, re-shard the data over 3
ranks and train to the end (gpucoll.elastic.run). The output shows the failure, the time to recover and the loss
curve; every survivor ends with the same parameters.

    python bench/elastic_train.py                     # 4 ranks, kill rank 2 at step 40 of 120
    python bench/elastic_train.py --ranks 5 --kill 3 --at 10 --steps 60 --json out.json

Rank 0 serves the rendezvous store, so it is not the one killed. Growing the job back (a new rank joining) is not
supported yet.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import numpy as np

import gpucoll
from gpucoll import elastic
from gpucoll.errors import RemoteError

FEATURES, SAMPLES, LR = 16, 4096, 0.1


def _data():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((SAMPLES, FEATURES)).astype(np.float64)
    w_true = np.arange(1, FEATURES + 1, dtype=np.float64) / FEATURES
    y = x @ w_true + 0.01 * rng.standard_normal(SAMPLES)
    return x, y


def _rank(comm, kill_rank: int, kill_at: int, steps: int):
    x, y = _data()
    me = comm.rank  # the original rank: the one that --kill names
    state = {"w": np.zeros(FEATURES, np.float64)}
    events, losses = [], []

    def step(c, st, i):
        # This rank's shard under the current communicator: after a shrink the 3 survivors split all the data.
        lo, hi = SAMPLES * c.rank // c.world_size, SAMPLES * (c.rank + 1) // c.world_size
        err = x[lo:hi] @ st["w"] - y[lo:hi]
        grad_loss = np.concatenate([x[lo:hi].T @ err, [err @ err, hi - lo]])
        if i == kill_at and me == kill_rank:
            time.sleep(0.05)  # the others are inside this step's all_reduce by now, waiting for this rank
            os.kill(os.getpid(), signal.SIGKILL)
        c.all_reduce(grad_loss)
        n = grad_loss[-1]
        st["w"] -= LR * grad_loss[:FEATURES] / n
        losses.append((i, c.world_size, float(grad_loss[FEATURES] / n)))

    def on_event(kind, info):
        events.append({"kind": kind, **{k: (str(v) if k == "error" else v) for k, v in info.items()}})

    comm, state = elastic.run(comm, step, state, steps=steps, on_event=on_event)
    comm.close()
    return {"w": state["w"].tolist(), "events": events, "losses": losses}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--kill", type=int, default=2, help="the rank killed (not 0: it serves the store)")
    ap.add_argument("--at", type=int, default=40, help="the step at which it is killed")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not 0 < args.kill < args.ranks:
        ap.error("--kill must name a rank other than 0")
    try:
        results = gpucoll.spawn(_rank, args.ranks, args=(args.kill, args.at, args.steps), backend="host",
                                timeout=args.timeout, elastic=True)
    except RemoteError as e:  # the killed rank returns nothing
        results = e.results
    survivors = [r for r, res in enumerate(results) if res is not None]
    first = results[survivors[0]]
    for ev in first["events"]:
        if ev["kind"] == "failure":
            print(f"step {ev['step']}: rank {ev['rank']} of {ev['world_size']} saw the failure: {ev['error']}")
        else:
            print(f"step {ev['step']}: recovered on {ev['world_size']} ranks (from {ev['old_size']}) in "
                  f"{ev['seconds'] * 1e3:.0f} ms")
    print("step  ranks  loss")
    for i, size, loss in first["losses"]:
        if i % 10 == 0 or i == args.steps - 1 or abs(i - args.at) <= 1:
            print(f"{i:4d}  {size:5d}  {loss:.6f}")
    same = all(results[r]["w"] == first["w"] for r in survivors)
    print(f"survivors {survivors}: {len(first['losses'])} steps each, same final parameters on every survivor: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "survivors": survivors, "results": results}, f, indent=1)
    return 0 if same and len(survivors) == args.ranks - 1 else 1


if __name__ == "__main__":
    sys.exit(main())
