"""What a rank writes when one of its collectives fails: the flight recorder's dump and the hang report.

Every communicator records its last operations natively (csrc/core/flight_recorder.h, ``GPUCOLL_TRACE_BUFFER``
entries, 2000 by default). When a collective times out or a peer fails, the Communicator hands the error here
(``on_failure``), which, on every rank that can still talk:

1. publishes the tail of this rank's recorder through the rendezvous store (a few dozen entries: bounded size);
2. waits a bounded time (a quarter of the timeout, 1 to 10 s) for the tails of the ranks that were in the same
   collective, in a helper thread: a store whose server is stopped must not hold the error back;
3. writes one JSON file, ``gpucoll-trace-<communicator>-rank<r>.json`` in ``GPUCOLL_TRACE_DIR`` (default: the
   temporary directory), with the whole ring, the peers' tails, and where each rank is as the backend sees it;
4. appends to the error's message where every rank is (dead; alive but elsewhere; alive and not arrived, running
   or stopped), how long the others have waited, the file's path and the command that merges every rank's
   (``python -m gpucoll trace``, gpucoll/cli/trace.py).

A failure inside the report never hides the error it reports: whatever goes wrong here is said in one line of the
message instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable

from gpucoll import _log, config
from gpucoll._native import _C
from gpucoll.errors import GpucollError, RemoteError, Unsupported

FORMAT = "gpucoll-trace"
VERSION = 1
TAIL = 32  # entries of a rank's recorder that travel through the store


def exchange_bound(timeout: float) -> float:
    """How long a failing rank waits for its peers' tails: long enough for ranks that time out a little later (each
    rank's deadline runs from its own arrival), short against the timeout the job already waited."""
    return min(10.0, max(1.0, 0.25 * float(timeout)))


def trace_path(key: str, rank: int) -> str:
    folder = config.get("GPUCOLL_TRACE_DIR").strip() or tempfile.gettempdir()
    return os.path.join(folder, f"gpucoll-trace-{key}-rank{rank}.json")


@dataclasses.dataclass
class Source:
    """What a dump is taken from: a communicator's identity and its backend's recorder (Backend.trace, trace_key,
    peer_states), from the Communicator or from a backend's own failure path (the NCCL watchdog)."""

    rank: int
    world_size: int
    timeout: float
    backend: str
    trace: Callable[[int], dict]
    key: Callable[[], str]
    states: Callable[[], object]
    # GPU backends, which see no peer process: rank -> [host, pid] as the rank published it at set-up, or None.
    who: Callable[[int], object] = lambda r: None


def failed_entry(trace: dict):
    """The operation the failure happened in: the oldest of the trailing entries that failed or never ended (a GPU
    backend may have several queued behind the one that hung; the host backend has one)."""
    found = None
    for e in reversed(trace.get("entries", [])):
        if e["state"] not in ("failed", "running"):
            break
        found = e
    return found


def start_ns(e: dict) -> int:
    """When an entry began on this rank: its start, or where the backend cannot see the start (NCCL), its enqueue."""
    return e["start_ns"] or e["enqueue_ns"]


def proc_state(pid: int) -> str:
    """'exited', 'stopped' (SIGSTOP, a debugger), 'running' (or sleeping: busy elsewhere), or '' where this machine
    cannot tell (no such /proc, another host's process)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except FileNotFoundError:
        return "exited"
    except OSError:
        return ""
    state = stat[stat.rfind(")") + 2:][:1]
    if state in ("Z", "X"):
        return "exited"
    if state in ("T", "t"):
        return "stopped"
    return "running"


def who_in_store(store, prefix: str) -> Callable[[int], object]:
    """Source.who for a backend whose ranks each set `prefix`<rank> to JSON [host, pid] at set-up."""
    def who(r: int):
        key = f"{prefix}{r}"
        return json.loads(store.get(key, timeout=1.0)) if store.check(key) else None
    return who


def whoami() -> bytes:
    """What a rank sets for who_in_store."""
    return json.dumps([socket.gethostname(), os.getpid()]).encode()


def _publish_and_collect(store, prefix: str, rank: int, mine: bytes, expect: list, bound: float, box: dict):
    """Runs in a helper thread: sets this rank's tail, gathers the expected ranks' tails until `bound`, then says
    it has read them and waits (within the same bound) until the ranks it heard from have read too: the rank that
    serves the store (rank 0) may exit as soon as its error is raised, and must not take the others' tails with it."""
    try:
        store.set(f"{prefix}{rank}", mine)
        box["published"] = True
        deadline = time.monotonic() + bound
        pending = [r for r in expect if r != rank]
        while pending and time.monotonic() < deadline:
            for r in list(pending):
                if store.check(f"{prefix}{r}"):
                    box.setdefault("peers", {})[r] = json.loads(store.get(f"{prefix}{r}", timeout=1.0))
                    pending.remove(r)
            if pending:
                time.sleep(0.05)
        store.set(f"{prefix}read/{rank}", b"1")
        readers = [f"{prefix}read/{r}" for r in box.get("peers", {})]
        while readers and not store.check(readers) and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception as e:  # noqa: BLE001 - reported in the message, never raised over the error being reported
        box["error"] = f"{type(e).__name__}: {e}"


def _ranks_text(ranks: list) -> str:
    """[0, 1, 2, 4] -> 'ranks 0-2, 4'; one rank -> 'rank 3'."""
    ranks = sorted(ranks)
    runs, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            runs += [str(start)] if start == r else [str(start), str(r)] if r == start + 1 else [f"{start}-{r}"]
            start = None
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(runs)


def _coll(cid: int) -> str:
    names = _C.coll_names()  # the core's table (algo::Coll), the one list of collectives
    return "barrier" if cid < 0 else names[cid] if cid < len(names) else f"collective {cid}"


def _gone_or_stopped(state: str, label: str) -> str:
    """How a rank whose process this machine sees exited or stopped is named (with the backend's view or without)."""
    if state == "exited":
        return "is dead (its process has exited)"
    return f"is alive but stopped (SIGSTOP or a debugger) and never entered {label}"


def _absent(r: int, st: dict, label: str) -> str:
    """What rank r, which never entered the failed collective, is doing, from what the backend saw of it."""
    # A GPU backend's states carry the process state taken with them ("proc"), when the failure was found.
    alive = "exited" if st["exited"] else st.get("proc") or (proc_state(st["pid"]) if st["pid"] > 0 else "")
    if alive in ("exited", "stopped"):
        how = _gone_or_stopped(alive, label)
    elif st["entered"] > st["done"] or st.get("in_p2p"):
        how = f"is alive but elsewhere and never entered {label}: {st['where']}"
    elif st.get("device"):  # what its kernels show: none running, which also holds for a rank in an NCCL call
        how = (f"is alive and never entered {label}, and its GPU runs none of this communicator's kernels "
               f"(computing, or in another call?)")
    else:
        how = f"is alive and never entered {label}, and is in no gpucoll call (computing?)"
    if st["done"] is None:  # a GPU backend that could not read a dead rank's ring
        last = "what it completed last is gone with it"
    elif st["done"]:
        last = f"its last completed operation: {_coll(st['done_coll'])} #{st['done']}, {st['done_ago_s']:.3g} s ago"
    else:
        last = "it had completed no collective"
    return f"rank {r} {how} ({last})"


def _silent(r: int, state, label: str):
    """What this machine saw of rank r's process (proc_state, taken when the failure was found), for a rank that
    sent no tail and whose backend cannot see it: dead, stopped or running; None where it cannot tell."""
    if state in ("exited", "stopped"):
        return f"rank {r} {_gone_or_stopped(state, label)}"
    if state == "running":
        return f"rank {r} is alive and sent no report: it is not in {label} (computing, or in another call)"
    return None


def _process_states(src: Source) -> dict:
    """{rank: proc_state} of the peers whose [host, pid] a GPU backend published and that run on this machine,
    taken when the failure is found: a rank resumed (SIGCONT) during the exchange was stopped when it mattered."""
    out = {}
    here = socket.gethostname()
    for r in range(src.world_size):
        if r == src.rank:
            continue
        try:
            who = src.who(r)
        except Exception:  # noqa: BLE001 - a store gone with its server: the rank stays merely silent
            who = None
        if who and who[0] == here:
            out[r] = proc_state(int(who[1]))
    return out


def where_everyone_is(world_size: int, rank: int, failed: dict, states, peers: dict, now_real_ns: int,
                      procs=None) -> str:
    """Who never entered the failed collective (dead, stopped, elsewhere or computing, with its last completed
    operation), and which ranks have waited in it and for how long. `states`: the backend's view of every rank
    (HostComm.peer_states) or None, in which case a rank that sent no tail is told from its process where `procs`
    ({rank: proc_state}) has it, and is otherwise only said to be silent."""
    seq, label = failed["seq"], f"{failed['op']} #{failed['seq']}"
    if failed["op"] == "p2p":
        return (f"this rank's sends and receives (batch #{seq}) failed; ranks number such batches apart, so whether "
                f"the peers were in the matching ones is in their dumps, not here")
    parts, waited, silent = [], {}, []
    for r in range(world_size):
        st = states[r] if states else None
        tail = peers.get(r)
        if st is not None and st["entered"] < seq:
            parts.append(_absent(r, st, label))
            continue
        if r == rank:
            waited[r] = (now_real_ns - failed["start_real_ns"]) * 1e-9
            continue
        entry = next((e for e in (tail or {}).get("tail", [])
                      if e["coll_seq"] == failed["coll_seq"] and e["op"] == failed["op"]), None)
        if entry is not None:
            waited[r] = (now_real_ns - start_ns(entry) - tail["realtime_minus_monotonic_ns"]) * 1e-9
        elif st is not None:
            waited[r] = st["in_for_s"] if st["entered"] > st["done"] else None
        elif (seen := _silent(r, (procs or {}).get(r), label)) is not None:
            parts.append(seen)
        else:
            silent.append(r)
    if waited:
        known = [w for w in waited.values() if w is not None]
        verb = "has" if len(waited) == 1 else "have"
        parts.append(f"{_ranks_text(list(waited))} {verb} waited in {label}"
                     + (f" for up to {max(known):.3g} s" if known else ""))
    if silent:
        parts.append(f"{_ranks_text(silent)} sent no report (dead, stopped, or not in {label})")
    return "; ".join(parts)


def on_failure(src: Source, store, err: GpucollError) -> None:
    """Dumps this rank's flight recorder for `err` (a CollectiveTimeout or RemoteError of a collective of `src`)
    and says in its message where every rank is and where the dump went. Once per error: a copy of it raised again
    (the NCCL backend raises its recorded failure at every later call) carries the same text. Never raises."""
    if err.trace_file is not None or config.get_int("GPUCOLL_TRACE_BUFFER") <= 0:
        return
    try:
        trace, key = src.trace(0), src.key()
    except Unsupported:
        return
    except Exception as e:  # noqa: BLE001 - the report never replaces the error it reports
        _amend(err, f"(no flight-recorder dump: {type(e).__name__}: {e})", None)
        return
    failed = failed_entry(trace)
    if failed is None:
        return
    offset = trace["realtime_ns"] - trace["monotonic_ns"]
    failed = dict(failed, start_real_ns=start_ns(failed) + offset)
    rank, world_size = src.rank, src.world_size
    try:
        states = src.states()
    except Exception:  # noqa: BLE001
        states = None
    procs = {} if states else _process_states(src)
    if states:
        entered = [r for r, s in enumerate(states) if s["entered"] >= failed["seq"] and not s["exited"]]
    else:  # a GPU backend: every rank, less those whose process this machine sees gone (no tail will come)
        entered = [r for r in range(world_size) if procs.get(r) != "exited"]
    if isinstance(err, RemoteError):  # the ranks it names are gone (dead, or cut off): no tail will come from them
        entered = [r for r in entered if r not in set(err.ranks or ())]
    mine = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "error": str(err),
            "realtime_minus_monotonic_ns": offset, "tail": trace["entries"][-TAIL:]}
    now_real = time.time_ns()  # the waits are measured up to the failure, not past the exchange below
    box: dict = {}
    if store is not None and world_size > 1:
        prefix = f"gpucoll/trace/{key}/{failed['op']}/{failed['seq']}/"
        bound = exchange_bound(src.timeout)
        if isinstance(err, RemoteError):  # the lost are named already: what the others were doing is a second's look
            bound = min(bound, 1.0)
        t = threading.Thread(target=_publish_and_collect, name="gpucoll-trace-exchange", daemon=True,
                             args=(store, prefix, rank, json.dumps(mine).encode(), entered, bound, box))
        t.start()
        t.join(bound + 1.0)
    peers = dict(box.get("peers", {}))
    peers[rank] = mine
    try:
        summary = where_everyone_is(world_size, rank, failed, states, peers, now_real, procs)
    except Exception as e:  # noqa: BLE001
        summary = f"(where every rank is: not worked out: {type(e).__name__}: {e})"
    path = trace_path(key, rank)
    doc = {"format": FORMAT, "version": VERSION, "rank": rank, "world_size": world_size, "backend": src.backend,
           "communicator": key, "host": mine["host"], "pid": mine["pid"], "written_realtime_ns": now_real,
           "error": {"type": type(err).__name__, "message": err.message, "ranks": list(err.ranks)},
           "failed": {"op": failed["op"], "seq": failed["seq"], "coll_seq": failed["coll_seq"]}, "summary": summary,
           "peer_states": states, "peers": {str(r): v for r, v in sorted(peers.items())},
           "exchange": {"published": bool(box.get("published")), "error": box.get("error"),
                        "heard_from": sorted(peers)},
           "trace": trace}
    try:
        _write(path, doc)
    except OSError as e:
        _amend(err, f"where every rank is: {summary}; (flight recorder not written to {path}: {e})", None)
        return
    everyone = os.path.join(os.path.dirname(path), f"gpucoll-trace-{key}-rank*.json")
    _amend(err, f"where every rank is: {summary}. Flight recorder: {path} (every rank's, merged: python -m "
                f"gpucoll trace {everyone})", path)
    _log.debug(f"flight recorder dumped to {path}")


def dump(src: Source, path=None) -> str:
    """Writes this rank's whole recorder to `path` (default: where a failure would write it) without a failure or
    any communication: every rank of a healthy job can dump, and python -m gpucoll trace merges the files into
    the straggler table. Returns the path."""
    trace, key = src.trace(0), src.key()
    path = path or trace_path(key, src.rank)
    doc = {"format": FORMAT, "version": VERSION, "rank": src.rank, "world_size": src.world_size,
           "backend": src.backend, "communicator": key, "host": socket.gethostname(), "pid": os.getpid(),
           "written_realtime_ns": time.time_ns(), "error": None, "failed": None, "summary": None,
           "peer_states": src.states(), "peers": {}, "exchange": None, "trace": trace}
    _write(path, doc)
    return path


def _write(path: str, doc: dict) -> None:
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def _amend(err: GpucollError, text: str, path) -> None:
    err.message = f"{err.message}\n{text}"
    err.args = (err.message,)
    err.trace_file = path
