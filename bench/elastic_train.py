"""Elastic training without a restart: 4 ranks fit a small linear model with data-parallel SGD (gradients averaged
by all_reduce on the host backend); at step --at rank --kill is killed with SIGKILL while the others wait for it
inside that step's all_reduce; the other 3 shrink their communicator, take rank 0's parameters, re-shard the data over 3
ranks and train on (gpucoll.elastic.run); at step --join-at a new process joins (gpucoll.elastic.join_run: the
launcher starts it when rank 0 says where the job's store is), is admitted at that step boundary, receives the
parameters and the job ends with 4 ranks again. The output shows the failure, the time to recover and to admit,
and the loss curve; every rank ends with the same parameters.

    python bench/elastic_train.py                     # 4 ranks, kill rank 2 at step 40, a new rank at 80, 120 steps
    python bench/elastic_train.py --ranks 5 --kill 3 --at 10 --join-at 0 --steps 60 --json out.json

Rank 0 serves the rendezvous store, so it is not the one killed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
import time

import numpy as np

import gpucoll
from gpucoll import elastic
from gpucoll.errors import RemoteError

FEATURES, SAMPLES, LR = 16, 4096, 0.1
ADMIT_EVERY = 10  # steps between the checks for processes waiting to join


def _data():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((SAMPLES, FEATURES)).astype(np.float64)
    w_true = np.arange(1, FEATURES + 1, dtype=np.float64) / FEATURES
    y = x @ w_true + 0.01 * rng.standard_normal(SAMPLES)
    return x, y


def _trainer(x, y, kill_rank: int, kill_at: int, join_at: int, contact: str, me: int):
    """This rank's step function and event log (the same for the first ranks and the newcomer)."""
    events, losses = [], []

    def step(c, st, i):
        # This rank's shard under the current communicator: the data is split over however many ranks there are.
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
        if contact and i == join_at - 1 and c.rank == 0:
            _invite(c, contact)

    def on_event(kind, info):
        events.append({"kind": kind, **{k: (str(v) if k == "error" else v) for k, v in info.items()}})

    return step, on_event, events, losses


def _invite(comm, contact: str) -> None:
    """Rank 0, at the step before --join-at: tell the launcher where to send the new rank (the job's secret goes in
    a file only this user can read), and wait until it has asked to join, so that the next admission takes it."""
    address, port = comm.join_address()
    doc = {"address": address, "port": port, "secret": os.environ["GPUCOLL_STORE_SECRET"]}
    fd = os.open(contact + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f)
    os.rename(contact + ".tmp", contact)
    deadline = time.monotonic() + 60
    while comm.waiting_to_join() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)


def _rank(comm, kill_rank: int, kill_at: int, join_at: int, steps: int, contact: str):
    x, y = _data()
    state = {"w": np.zeros(FEATURES, np.float64)}
    step, on_event, events, losses = _trainer(x, y, kill_rank, kill_at, join_at, contact, comm.rank)
    comm, state = elastic.run(comm, step, state, steps=steps, on_event=on_event, admit_every=ADMIT_EVERY)
    comm.close()
    return {"w": state["w"].tolist(), "events": events, "losses": losses}


def _newcomer(contact: str, steps: int, timeout: float, out: str) -> None:
    """The process that joins: started by the launcher once rank 0 published where to go."""
    with open(contact) as f:
        doc = json.load(f)
    x, y = _data()
    state = {"w": np.zeros(FEATURES, np.float64)}  # overwritten by rank 0's parameters when it is admitted
    step, on_event, events, losses = _trainer(x, y, -1, -1, -1, "", -1)
    comm, state = elastic.join_run(doc["address"], doc["port"], step, state, steps=steps, backend="host",
                                   timeout=timeout, secret=doc["secret"], on_event=on_event,
                                   admit_every=ADMIT_EVERY)
    comm.close()
    with open(out, "w") as f:
        json.dump({"w": state["w"].tolist(), "events": events, "losses": losses}, f)


def _launch_newcomer(contact: str, steps: int, timeout: float, out: str, box: list) -> None:
    """The launcher's side of growing: wait for rank 0's invitation, start the new process."""
    deadline = time.monotonic() + 120
    while not os.path.exists(contact) and time.monotonic() < deadline:
        time.sleep(0.01)
    proc = mp.get_context("spawn").Process(target=_newcomer, args=(contact, steps, timeout, out))
    proc.start()
    box.append(proc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--kill", type=int, default=2, help="the rank killed (not 0: it serves the store)")
    ap.add_argument("--at", type=int, default=40, help="the step at which it is killed")
    ap.add_argument("--join-at", type=int, default=80,
                    help=f"the step at which a new rank joins (a multiple of {ADMIT_EVERY}; 0: none)")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not 0 < args.kill < args.ranks:
        ap.error("--kill must name a rank other than 0")
    if args.join_at and (args.join_at % ADMIT_EVERY or not args.at < args.join_at < args.steps):
        ap.error(f"--join-at must be a multiple of {ADMIT_EVERY} after --at and before --steps")
    with tempfile.TemporaryDirectory() as tmp:
        contact = os.path.join(tmp, "contact.json") if args.join_at else ""
        newcomer_out, box = os.path.join(tmp, "newcomer.json"), []
        if contact:
            threading.Thread(target=_launch_newcomer, args=(contact, args.steps, args.timeout, newcomer_out, box),
                             daemon=True).start()
        try:
            results = gpucoll.spawn(_rank, args.ranks, args=(args.kill, args.at, args.join_at, args.steps, contact),
                                    backend="host", timeout=args.timeout, elastic=True)
        except RemoteError as e:  # the killed rank returns nothing
            results = e.results
        for proc in box:
            proc.join(60)
        newcomer = None
        if contact and os.path.exists(newcomer_out):
            with open(newcomer_out) as f:
                newcomer = json.load(f)
    survivors = [r for r, res in enumerate(results) if res is not None]
    first = results[survivors[0]]
    for ev in first["events"]:
        if ev["kind"] == "failure":
            print(f"step {ev['step']}: rank {ev['rank']} of {ev['world_size']} saw the failure: {ev['error']}")
        elif ev["kind"] == "recovered":
            print(f"step {ev['step']}: recovered on {ev['world_size']} ranks (from {ev['old_size']}) in "
                  f"{ev['seconds'] * 1e3:.0f} ms")
        else:
            print(f"step {ev['step']}: a new rank joined: {ev['world_size']} ranks (from {ev['old_size']}), "
                  f"admitted in {ev['seconds'] * 1e3:.0f} ms")
    print("step  ranks  loss")
    for i, size, loss in first["losses"]:
        if i % 10 == 0 or i == args.steps - 1 or abs(i - args.at) <= 1 or abs(i - args.join_at) <= 1:
            print(f"{i:4d}  {size:5d}  {loss:.6f}")
    finals = [results[r]["w"] for r in survivors] + ([newcomer["w"]] if newcomer else [])
    same = all(w == first["w"] for w in finals)
    joined = f" and the newcomer ({len(newcomer['losses'])} steps)" if newcomer else ""
    print(f"survivors {survivors} ({len(first['losses'])} steps each){joined}: same final parameters on every "
          f"rank: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "survivors": survivors, "results": results, "newcomer": newcomer}, f,
                      indent=1)
    ok = same and len(survivors) == args.ranks - 1 and (newcomer is not None or not args.join_at)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
