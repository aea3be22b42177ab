"""The one harness of gpucoll-bench (nccl-tests' src/common.cu): sizes, buffers, the timed loop, the check,
the cross-rank statistics, and the table and JSON that rank 0 writes.

Every rank runs run_rank() with its Communicator. Per (algorithm, dtype, op, size) and for out-of-place then
in-place, as nccl-tests' BenchTime does: fill inputs, run the warmup calls, barrier, time `iters` calls (the
collective calls only; buffers are allocated once at the largest size), then run `check` verified calls on
fresh inputs. The table shows rank 0's time by default (-a picks avg/min/max over ranks).
In place uses nccl-tests' layouts (colls.Counts); one that gpucoll refuses shows N/A in every in-place column,
with a note saying why, and one that nccl-tests does not check (alltoall, sendrecv) shows N/A under #wrong.

Cross-rank bookkeeping (wrong counts, times, rank info) uses the communicator's own all_reduce on tiny float64
or int64 arrays. A broken collective could garble that bookkeeping, so every rank also returns its own local
counts and the exit status is computed from those too (see cli.exit_status).
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np

import gpucoll
from gpucoll import __version__
from gpucoll._native import _C
from gpucoll._spawn import free_port
from gpucoll.bench import colls, compressed, devmem, report, virtual
from gpucoll.bench.colls import DTYPES, DataContext, corrupt, count_wrong
from gpucoll.cli import info
from gpucoll.errors import GpucollError, InvalidArgument

AVERAGE_NAMES = ("rank0", "avg", "min", "max")  # nccl-tests' -a 0/1/2/3
PROGRESS_AFTER_S = 2.0  # the progress bar appears once a sweep has run this long: short runs stay quiet
UNCHECKED_ROUNDS = 5  # --compare unchecked: timings with the call check on, and off, per row


@dataclass
class Params:
    coll: str = "all_reduce"
    minbytes: int = 32 << 20  # nccl-tests' defaults
    maxbytes: int = 32 << 20
    stepbytes: int = 1 << 20
    stepfactor: int = 1
    iters: int = 20
    warmup_iters: int = 1
    check: int = 1
    dtypes: list[str] = field(default_factory=lambda: ["float"])
    ops: list[str] = field(default_factory=lambda: ["sum"])
    dtypes_all: bool = False  # -d all / -o all: what a backend cannot run is skipped with a note, not refused
    ops_all: bool = False
    root: int = 0
    algos: list[str] = field(default_factory=lambda: ["auto"])
    algo_all: bool = False  # --algo all: algorithms unusable at this world size are skipped, not refused
    average: int = 1  # nccl-tests' default: the mean over ranks
    graph: int = 0  # -G N: capture the `iters` calls in a CUDA graph and launch it N times (nccl-tests)
    blocking: int = 0  # -z 1: synchronize the stream after every call (nccl-tests' --blocking)
    json: str | None = None
    csv: str | None = None  # --csv FILE: every row + the environment
    plot: str | None = None  # --plot FILE.png
    min_busbw: float | None = None  # --min-busbw: exit 1 when the average busbw is below
    compare: str | None = None  # --compare gloo: the peer's name; peer_times holds its measurements
    compress: str | None = None  # --compress int8: all_reduce's wire format
    peer_times: dict = field(default_factory=dict)  # (type, redop, size) -> seconds
    progress: bool = False  # tqdm bar on stderr (decided by the cli: stderr a TTY and enough rows)
    quiet: bool = False  # no table (--health-check prints its own summary)
    table_to_stderr: bool = False  # --json - / --csv -: stdout carries the data, the table goes to stderr
    timeout: float = 300.0
    backend: str = "host"
    backends: list[str] = field(default_factory=lambda: ["host"])  # --backend a,b: one run each, in order
    backend_label: str = ""  # what the preamble says: "auto(host)" when --backend auto resolved to host
    staged: bool = False  # tests: host buffers with a separate "device" twin (devmem.StagedHostMem)
    nranks: int | None = None
    launch: str = "spawn"  # "spawn", "in-process" or the launcher's name
    inject_error: bool = False
    argv: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # "# ..." lines printed after the preamble

    @property
    def program(self) -> str:
        return f"gpucoll-bench {self.coll}"


def sizes(p: Params) -> list[int]:
    """nccl-tests' size loop: multiply by -f when it is above 1, else add -i."""
    out, size = [], p.minbytes
    while size <= p.maxbytes:
        out.append(size)
        size = size * p.stepfactor if p.stepfactor > 1 else size + p.stepbytes
        if size == 0:  # -b 0 with a factor: nccl-tests loops forever here; we stop
            break
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class _Rank:
    """One rank's state for a run."""

    def __init__(self, comm, p: Params):
        self.comm, self.p = comm, p
        self.rank, self.n = comm.rank, comm.world_size
        self.coll = colls.get(p.coll)
        self.out = report.Printer(self.rank == 0 and not p.quiet, sys.stderr if p.table_to_stderr else None)
        self.bar = None  # tqdm progress bar, rank 0 only, once the sweep has run PROGRESS_AFTER_S
        self._progress_from: float | None = None  # when the sweep started, if it may show a bar
        self._rows_total = self._rows_done = 0
        self.rows: list[dict] = []
        self.errors_local = 0  # checks (size x placement) where this rank saw a wrong element
        self.wrong_local = 0  # wrong elements this rank saw, all checks together
        self.max_error = 0.0  # --compress: the largest |error| checked in the current row
        self.bw_sum = {}  # algo -> [sum of busbw, count]
        self.refused: str | None = None  # why gpucoll refused nccl-tests' in-place call (said once)
        self.mem = devmem.for_comm(comm, p.staged)
        self.comm = self.mem.bind(comm)
        # Two raw byte buffers at the largest size; rows use prefix views of them (nccl-tests allocates once).
        # On a CUDA run these are the host mirrors the plugins fill and check, and *_dev their device twins.
        nbytes = 0
        for name in p.dtypes:
            isz = DTYPES[name].itemsize
            c = self.coll.counts(p.maxbytes // isz, self.n, isz)
            nbytes = max(nbytes, c.send * isz, c.recv * isz)
        self.send_buf = self.mem.alloc(nbytes)
        self.recv_buf = self.mem.alloc(nbytes)
        self.send_dev = self.mem.twin(self.send_buf)
        self.recv_dev = self.mem.twin(self.recv_buf)

    # -- cross-rank helpers ----------------------------------------------------------------------------------
    def _sum(self, values, dtype=np.float64) -> np.ndarray:
        arr = np.array(values, dtype=dtype)
        self.mem.reduce_small(self.comm, arr, "sum")
        return arr

    def _time(self, sec: float) -> float:
        """nccl-tests' Allreduce(args, &deltaSec, average): 0 this rank's (rank 0's is printed), 1 mean over
        ranks, 2 min, 3 max."""
        if self.p.average == 0 or self.n == 1:
            return sec
        arr = np.array([sec], np.float64)
        self.mem.reduce_small(self.comm, arr, ("sum", "sum", "min", "max")[self.p.average])
        return float(arr[0]) / (self.n if self.p.average == 1 else 1)

    def rank_info(self) -> list[dict]:
        """Every rank's pid and hostname, gathered with all_reduce (each rank fills its own slot)."""
        pids = np.zeros(self.n, np.int64)
        pids[self.rank] = os.getpid()
        names = np.zeros((self.n, 64), np.uint8)
        raw = socket.gethostname().encode()[:64]
        names[self.rank, :len(raw)] = np.frombuffer(raw, np.uint8)
        self.mem.reduce_small(self.comm, pids)
        self.mem.reduce_small(self.comm, names)
        label = self.mem.label if self.mem.kind == "cuda" else f"cpu {_cpu_model()}"
        device = f"{label} [{self.comm.backend}]"
        return [{"rank": r, "pid": int(pids[r]), "hostname": bytes(names[r]).rstrip(b"\0").decode(errors="replace"),
                 "device": device} for r in range(self.n)]

    # -- one measurement (nccl-tests' BenchTime) -------------------------------------------------------------
    def _views(self, counts, dt, in_place: bool):
        """This row's buffers: host storage views (what init_data fills and the check reads), the objects the
        collective is given (views of the device twins; the host views themselves on the host backend), and the
        byte spans of each raw buffer the row uses, (send first, send stop, recv first, recv stop), for staging.
        In place, as nccl-tests' startColl: both live in the receive buffer, the input at send_inplace_offset *
        rank and the output at recv_inplace_offset * rank."""
        isz, mem = dt.itemsize, self.mem

        def host(buf, first, count):
            return buf[first * isz:(first + count) * isz].view(dt.storage)

        if in_place:
            s0, r0 = counts.send_inplace_offset * self.rank, counts.recv_inplace_offset * self.rank
            stop = max(s0 + counts.send, r0 + counts.recv) * isz
            return (host(self.recv_buf, s0, counts.send), host(self.recv_buf, r0, counts.recv),
                    mem.view(self.recv_dev, s0 * isz, counts.send * isz, dt),
                    mem.view(self.recv_dev, r0 * isz, counts.recv * isz, dt), (0, 0, 0, stop))
        return (host(self.send_buf, 0, counts.send), host(self.recv_buf, 0, counts.recv),
                mem.view(self.send_dev, 0, counts.send * isz, dt), mem.view(self.recv_dev, 0, counts.recv * isz, dt),
                (0, counts.send * isz, 0, counts.recv * isz))

    def _upload(self, spans) -> None:
        self.mem.upload(self.send_buf, self.send_dev, spans[0], spans[1])
        self.mem.upload(self.recv_buf, self.recv_dev, spans[2], spans[3])

    def _download(self, spans) -> None:
        self.mem.download(self.send_dev, self.send_buf, spans[0], spans[1])
        self.mem.download(self.recv_dev, self.recv_buf, spans[2], spans[3])

    def bench(self, dt, op: str, algo: str, counts, in_place: bool):
        """(time us, algbw, busbw, #wrong or None when unchecked), or None when gpucoll refuses this in-place
        layout."""
        p, coll, mem = self.p, self.coll, self.mem
        send, recv, send_obj, recv_obj, spans = self._views(counts, dt, in_place)
        ctx = DataContext(rank=self.rank, nranks=self.n, dtype=dt, op=op, root=p.root, algo=algo, counts=counts,
                          in_place=in_place, send=send, recv=recv, copy=mem.copy, compress=p.compress)
        # Ordinary numbers in the buffers while timing: garbage could hold denormals, which are slow on CPUs.
        coll.init_data(ctx)
        self._upload(spans)

        def call():
            coll.run(self.comm, send_obj, recv_obj, ctx)
            if p.blocking:
                mem.synchronize()

        def first_call() -> bool:
            # nccl-tests' in-place layouts put the input inside the output at an offset (all_gather's input is the
            # rank's slice of its output); gpucoll may refuse such overlaps. Its argument checks run before any
            # communication and agree on every rank (the layout is the same everywhere), so all ranks refuse the
            # first call together and stay in step: the row shows N/A instead of failing the run.
            try:
                call()
                return True
            except InvalidArgument as e:
                if not in_place:
                    raise
                if self.refused is None:
                    self.refused = f"{coll.name} in place not run: gpucoll refuses nccl-tests' in-place layout ({e})"
                return False

        # The first call is the first warmup call, or the first timed one with -w 0 (-G: always a warmup call,
        # as NCCL must have connected before its calls can be captured).
        warm = max(p.warmup_iters, 1 if p.graph else 0)
        if warm and not first_call():
            return None
        for _ in range(warm - 1):
            call()
        replay = mem.capture(lambda: [call() for _ in range(p.iters)]) if p.graph else None
        self.comm.barrier()
        timer = mem.timer()
        timer.start()
        if replay is not None:
            for _ in range(p.graph):  # nccl-tests: time = all launches / (iters * launches)
                replay()
        else:
            if not warm and not first_call():
                return None
            for _ in range(p.iters - (0 if warm else 1)):
                call()
        sec = self._time(timer.stop() / (p.iters * max(p.graph, 1)))
        algbw, busbw = coll.get_bw(counts.param, dt.itemsize, sec, self.n) if sec > 0 else (0.0, 0.0)

        wrong: int | None = None
        if p.check > 0 and (coll.in_place_checked or not in_place):
            for _ in range(p.check):
                expects = coll.init_data(ctx)
                self._upload(spans)
                if p.graph:  # checked through a graph too, as nccl-tests does: what was timed is what is checked
                    mem.capture(call)()
                else:
                    call()
                self._download(spans)
                if p.inject_error and self.rank == self.n - 1:
                    # A compressed result is checked against its error bound, which a low bit stays within: flip the
                    # exponent's second bit instead.
                    corrupt(expects[0].buf, 8 * expects[0].buf.itemsize - 2 if p.compress else 0)
                if p.compress:  # elements outside the error bound, not bits that differ
                    local, worst = compressed.errors(ctx, p.compress, expects[0].buf)
                    self.max_error = max(self.max_error, worst)
                else:
                    local = sum(count_wrong(e) for e in expects)
                if local:
                    self.errors_local += 1
                    self.wrong_local += local
                wrong = round(self._sum([local])[0])
                if wrong:
                    break
        acc = self.bw_sum.setdefault(algo, [0.0, 0])
        acc[0] += busbw
        acc[1] += 1
        return sec * 1e6, algbw, busbw, wrong

    # -- a block of sizes (nccl-tests' TimeTest) -------------------------------------------------------------
    def _peer(self, dt, op_name: str, nbytes: int, counts, out_of_place) -> dict | None:
        """The --compare peer's numbers for this row and the ratio peer time / gpucoll (out-of-place) time."""
        p = self.p
        if not p.compare:
            return None
        sec = p.peer_times.get((dt.name, op_name, nbytes))
        if sec is None:
            return {"name": p.compare, "time": None, "alg_bw": None, "bus_bw": None, "ratio": None}
        algbw, busbw = self.coll.get_bw(counts.param, dt.itemsize, sec, self.n) if sec > 0 else (0.0, 0.0)
        ours = out_of_place[0] if out_of_place else None
        ratio = (sec * 1e6) / ours if ours else None
        return {"name": p.compare, "time": sec * 1e6, "alg_bw": algbw, "bus_bw": busbw, "ratio": ratio}

    def _unchecked(self, dt, op: str, algo: str, counts) -> dict:
        """--compare unchecked (measuring the host backend's cross-rank call check only): out-of-place timings
        with the check on and off, alternating, UNCHECKED_ROUNDS of each in these same ranks; their medians and
        the ratio unchecked / checked. Every rank switches between the same two calls."""
        impl, saved = self.comm._ops.impl, list(self.bw_sum.get(algo, [0.0, 0]))
        times: dict = {True: [], False: []}
        try:
            for _ in range(UNCHECKED_ROUNDS):
                for on in (True, False):
                    impl._set_call_check(on)
                    times[on].append(self.bench(dt, op, algo, counts, False)[0])
        finally:
            impl._set_call_check(True)
            self.bw_sum[algo] = saved  # these timings are not rows of their own
        checked, unchecked = statistics.median(times[True]), statistics.median(times[False])
        algbw, busbw = self.coll.get_bw(counts.param, dt.itemsize, unchecked * 1e-6, self.n) if unchecked > 0 \
            else (0.0, 0.0)
        return {"name": "unchecked", "time": unchecked, "alg_bw": algbw, "bus_bw": busbw,
                "ratio": unchecked / checked if checked else None, "checked_us": times[True],
                "unchecked_us": times[False]}

    def _uncompressed(self, dt, op: str, algo: str, counts) -> dict:
        """--compare none (with --compress): out-of-place timings of the same call uncompressed and compressed,
        alternating, UNCHECKED_ROUNDS of each in these same ranks; their medians and the ratio uncompressed /
        compressed (above 1: compression is faster)."""
        p, saved = self.p, list(self.bw_sum.get(algo, [0.0, 0]))
        wire, check = p.compress, p.check
        times: dict = {wire: [], None: []}
        try:
            p.check = 0
            for _ in range(UNCHECKED_ROUNDS):
                for mode in (wire, None):
                    p.compress = mode
                    times[mode].append(self.bench(dt, op, algo, counts, False)[0])
        finally:
            p.compress, p.check = wire, check
            self.bw_sum[algo] = saved  # these timings are not rows of their own
        ours, plain = statistics.median(times[wire]), statistics.median(times[None])
        algbw, busbw = self.coll.get_bw(counts.param, dt.itemsize, plain * 1e-6, self.n) if plain > 0 else (0.0, 0.0)
        return {"name": "none", "time": plain, "alg_bw": algbw, "bus_bw": busbw,
                "ratio": plain / ours if ours else None, "compressed_us": times[wire], "uncompressed_us": times[None]}

    def time_test(self, dt, op: str, algo: str) -> None:
        coll, p = self.coll, self.p
        op_name = op if coll.reduces else "none"
        root = p.root if coll.rooted else -1
        for size in sizes(p):
            counts = coll.counts(size // dt.itemsize, self.n, dt.itemsize)
            nbytes = max(counts.send, counts.recv) * dt.itemsize
            self.out.write(report.row_preamble(nbytes, counts.param, dt.name, op_name, root))
            row = report.json_row(nbytes, counts.param, dt.name, op_name, root, algo, p.iters, coll.name)
            row["backend"] = self.comm.backend
            resolved = self._resolved(dt, algo, nbytes)
            if resolved is not None:
                row["algo_resolved"] = resolved  # what "auto" (or a name) ran: gpucoll-tune and the plot read it
            # A sweep may run one backend twice (--backend nccl,auto where auto is nccl): the label keeps each run's
            # rows apart in the merged JSON and the plot.
            row["backend_label"] = p.backend_label or self.comm.backend
            # Each row says whether it ran on gpucoll's emulated CUDA device, so that no row copied out of its file
            # (a spreadsheet, a plot of merged runs) passes for a GPU timing.
            row["emulated"] = bool(getattr(self.mem, "emulated", False))
            oop = None
            self.max_error = 0.0
            for in_place in (False, True):
                res = self.bench(dt, op, algo, counts, in_place)
                oop = res if not in_place else oop
                self.out.write(report.row_body(*res) if res else report.row_body_not_run())
                row["in_place" if in_place else "out_of_place"] = report.json_result(*(res or (None,) * 4))
            if p.compare == "unchecked":
                peer = self._unchecked(dt, op, algo, counts)
            elif p.compare == "none":
                peer = self._uncompressed(dt, op, algo, counts)
            else:
                peer = self._peer(dt, op_name, nbytes, counts, oop)
            if peer is not None:
                row["peer"] = peer
                self.out.write(report.row_peer(peer["time"], peer["ratio"]))
            if p.compress:
                row["compress"] = p.compress
                row["max_error"] = self.max_error if p.check else None
                self.out.write(report.row_max_error(row["max_error"]))
            self.out.write("\n")
            self.rows.append(row)
            self._tick()

    def _resolved(self, dt, algo: str, nbytes: int) -> str | None:
        """The algorithm a row's calls run (nbytes: the selector's count, the world-sized buffer of the blocked
        collectives); None for send/recv, which has no algorithms, and for communicators that cannot tell (the
        virtual ranks of --backend custom run the kernel named)."""
        if self.p.compress:  # its own two-shot schedule, whatever auto would pick for the uncompressed call
            return f"compressed:{self.p.compress}"
        finder = getattr(self.comm, "algorithm_for", None)
        if self.coll.coll_id < 0 or finder is None:
            return None
        try:
            return finder(self.coll.coll_id, nbytes, dt.gpucoll, algo)
        except GpucollError:
            return None

    def _devices(self) -> str:
        if self.mem.kind != "cuda":
            return "cpu"
        return "cuda (emulated)" if getattr(self.mem, "emulated", False) else "cuda"

    def _picks(self, algo: str) -> str:
        """What "auto" runs, for its block's heading: " (picks oneshot up to 64K, twoshot from 256K)", per datatype
        when they differ; "" for a named algorithm, and where the communicator cannot tell. A bare "auto" left the
        reader to guess which algorithm the numbers below belong to."""
        if algo != "auto" or not self.out.enabled:
            return ""
        if self.p.compress:
            return f" (compressed: a two-shot schedule of its own, {self.p.compress} on the wire)"
        per_type = {}
        for name in self.p.dtypes:
            dt = DTYPES[name]
            runs: list = []  # [algorithm, first size, last size] per run of equal picks in size order
            for size in sizes(self.p):
                counts = self.coll.counts(size // dt.itemsize, self.n, dt.itemsize)
                nbytes = max(counts.send, counts.recv) * dt.itemsize
                pick = self._resolved(dt, algo, nbytes)
                if pick is None:
                    return ""
                pick = pick.removeprefix(f"{self.comm.backend}:")  # "custom:oneshot" in a custom block: "oneshot"
                if runs and runs[-1][0] == pick:
                    runs[-1][2] = nbytes
                else:
                    runs.append([pick, nbytes, nbytes])
            per_type[name] = _ranges(runs)
        texts = list(dict.fromkeys(per_type.values()))
        if texts == ["nccl at every size"]:
            return " (NCCL picks its own algorithm per call)"
        if len(texts) == 1:
            return f" (picks {texts[0]})"
        return " (picks " + "; ".join(f"{name}: {text}" for name, text in per_type.items()) + ")"

    def _tick(self) -> None:
        """One row done: advance the bar, or start it once the sweep has run PROGRESS_AFTER_S. Started late rather
        than with tqdm's delay: the table clears and redraws the bar around each row (report.Printer), and a
        redraw would show a delayed bar at once."""
        self._rows_done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self._progress_from is not None and time.monotonic() - self._progress_from >= PROGRESS_AFTER_S:
            from tqdm import tqdm

            self.bar = tqdm(total=self._rows_total, initial=self._rows_done, file=sys.stderr, unit="row",
                            leave=False, desc=self.coll.name)
            self.out.bar = self.bar

    # -- the whole run ---------------------------------------------------------------------------------------
    def run(self) -> dict:
        p = self.p
        ranks = self.rank_info()
        self.out.lines(report.preamble_lines(p.program, _version(), p, self.n, p.backend_label or self.comm.backend,
                                             p.algos, ranks, self._devices()))
        self.out.lines([f"# {note}\n" for note in p.notes])
        if getattr(self.mem, "emulated", False):
            self.out.write("# Device: gpucoll's emulated CUDA device (a CPU emulation, not a GPU): every row is "
                           "checked, but these timings are not GPU timings\n")
        started = time.time()
        if p.progress and self.rank == 0:
            self._rows_total = len(p.algos) * len(p.dtypes) * len(p.ops if self.coll.reduces else ["sum"]) \
                * len(sizes(p))
            self._progress_from = time.monotonic()
        for algo in p.algos:
            self.out.write(f"#\n# Algorithm: {algo}{self._picks(algo)}\n")
            head = report.header_lines_peer(p.compare) if p.compare else report.header_lines()
            self.out.lines(report.with_max_error(head) if p.compress else head)
            for name in p.dtypes:
                for op in (p.ops if self.coll.reduces else ["sum"]):
                    self.time_test(DTYPES[name], op, algo)
        if self.refused:
            self.out.write(f"#\n# {self.refused}\n")
        errors = round(self._sum([self.errors_local])[0])
        total = [sum(v[0] for v in self.bw_sum.values()), sum(v[1] for v in self.bw_sum.values())]
        avg_bw = total[0] / total[1] if total[1] else 0.0
        per_algo = {a: (v[0] / v[1] if v[1] else 0.0) for a, v in self.bw_sum.items()}
        if self.bar is not None:
            self.bar.close()
            self.out.bar = None
        self.out.lines(report.footer_lines(errors, avg_bw, p.program, per_algo, p.min_busbw))
        # Rank 0's document; the cli writes --json/--csv/--plot from it (one file for a sweep of backends).
        doc = self._json_doc(ranks, errors, avg_bw, per_algo, started) if self.rank == 0 else None
        return {"rank": self.rank, "errors": errors, "errors_local": self.errors_local,
                "wrong_local": self.wrong_local, "avg_busbw": avg_bw,
                "rows": self.rows if self.rank == 0 else None, "doc": doc}

    def _json_doc(self, ranks, errors: int, avg_bw: float, per_algo: dict, started: float) -> dict:
        p = self.p
        config = {"collective": p.coll, "nthreads": 1, "ngpus": 1 if self.mem.kind == "cuda" else 0,
                  "nranks": self.n, "device_kind": self._devices(), "minimum_bytes": p.minbytes,
                  "maximum_bytes": p.maxbytes, "warmup_iters": p.warmup_iters, "iterations": p.iters,
                  "aggregated_iterations": 1, "validation": p.check, "graph": p.graph,
                  "blocking": p.blocking, "datatypes": p.dtypes,
                  "ops": p.ops, "root": p.root, "algos": p.algos, "average": AVERAGE_NAMES[p.average],
                  "timeout": p.timeout}
        config["step_factor" if p.stepfactor > 1 else "step_bytes"] = p.stepfactor if p.stepfactor > 1 else p.stepbytes
        env = {"gpucoll_version": _version(), "hostname": socket.gethostname(), "nranks": self.n,
               "backend": self.comm.backend, "backend_label": p.backend_label or self.comm.backend, "launch": p.launch,
               "argv": p.argv, "python": sys.version.split()[0], "numpy": np.__version__,
               "platform": platform.platform(), "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
               "load_average": list(os.getloadavg()), "build": dict(_C.build_info()),
               "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
               "elapsed_s": round(time.time() - started, 3), "compare": p.compare, "info": _info()}
        return {"version": _version(), "program": p.program, "config": config, "environment": env,
                "devices": ranks, "results": self.rows,
                "out_of_bounds": {"count": errors, "okay": errors == 0},
                "average_bus_bandwidth": {"bandwidth": avg_bw, "per_algo": per_algo, "min": p.min_busbw,
                                          "okay": "unchecked" if p.min_busbw is None else avg_bw >= p.min_busbw}}


def _ranges(runs: list) -> str:
    """[[pick, first size, last size], ...] in size order -> "oneshot up to 64K, twoshot from 256K"."""
    if len(runs) == 1:
        return f"{runs[0][0]} at every size"
    parts = []
    for i, (pick, lo, hi) in enumerate(runs):
        if i == 0:
            parts.append(f"{pick} up to {report.size_label(hi)}")
        elif i == len(runs) - 1:
            parts.append(f"{pick} from {report.size_label(lo)}")
        elif lo == hi:
            parts.append(f"{pick} at {report.size_label(lo)}")
        else:
            parts.append(f"{pick} at {report.size_label(lo)}-{report.size_label(hi)}")
    return ", ".join(parts)


def _info() -> dict:
    """`gpucoll info --json`'s object (gpucoll.cli.info.collect); an error string instead of failing the run."""
    try:
        return info.collect()
    except Exception as e:  # noqa: BLE001 - the environment is informative, never fatal
        return {"error": f"{type(e).__name__}: {e}"}


def _version() -> str:
    return __version__


def run_rank(comm, params: Params) -> dict:
    """gpucoll.spawn / launcher entry: the whole benchmark on this rank."""
    return _Rank(comm, params).run()


def run_local(fn, p: Params, n: int, args: tuple) -> list:
    """fn(comm, *args) on `n` local ranks of p.backend, results in rank order: one rank in this process, more as
    spawned processes (nccl: as gpucoll.spawn places them, several on one GPU where NCCL allows), custom as
    virtual ranks in this process (gpucoll/bench/virtual.py)."""
    if p.backend == "custom":
        p.launch = "virtual"
        return virtual.run(fn, n, args, p.timeout)
    if n > 1:
        p.launch = "spawn"
        return gpucoll.spawn(fn, n, args=args, backend=p.backend, timeout=p.timeout)
    p.launch = "in-process"
    comm = gpucoll.init(0, 1, backend=p.backend, address="127.0.0.1", port=free_port(), timeout=p.timeout)
    try:
        return [fn(comm, *args)]
    finally:
        comm.close()
