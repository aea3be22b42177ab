"""Per-communicator choice of backend and algorithm: the topology-aware cost model (csrc/select/cost.cc) fed with
this job's wiring, placement and available backends, behind a cache.

Built once at init by every rank together (:func:`build`): each rank detects its machine (or reads
GPUCOLL_TOPO_FILE), publishes that view with its hostname, GPU and which backends it can run through the store,
and every rank merges the same records into the same :class:`Selector`, so every rank makes the same choice
for the same call - a choice that differed between ranks would deadlock them. The model, the request rules
(``algo=``, GPUCOLL_ALGO) and their error texts live in C++; this module adds availability, the rank -> GPU
placement, the no-topology fallbacks and the per-call cache.
"""

from __future__ import annotations

import dataclasses
import math
import socket
import threading

from gpucoll import _log, config, topology
from gpucoll._native import _C
from gpucoll.backends.usable import CUSTOM_ALGORITHMS, custom_problems, nccl_problems
from gpucoll.errors import InvalidArgument, Unsupported

_CUSTOM_DEFAULT = CUSTOM_ALGORITHMS  # what the custom backend's kernels implement (usable.py)
_CUDA_HOST_WHY = "the host backend takes CPU buffers only (CUDA buffers are not staged through host memory)"


@dataclasses.dataclass(frozen=True)
class Choice:
    """What runs one call: ``backend`` (custom, nccl, host, custom+nccl) and ``algorithm`` (for nccl the model's
    guess at what NCCL runs; NCCL picks its own), the model's time in seconds for the call's size bucket (NaN
    where nothing is modelled) and why."""

    backend: str
    algorithm: str
    predicted_time: float
    reason: str
    protocol: str = ""
    link_class: str = ""


@dataclasses.dataclass(frozen=True)
class Availability:
    """Which backends this rank (or, merged, every rank) can run, and why not."""

    nccl: bool = False
    custom: bool = False
    host: bool = True
    nccl_why: str = ""
    custom_why: str = ""
    host_why: str = ""
    # What the custom backend implements: "all_reduce:oneshot" (one collective) or "oneshot" (all); empty: all
    # the model prices.
    custom_algorithms: tuple = ()

    def record(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def merged(records, ranks_of_host=None) -> Availability:
        """A backend is available when it is on every rank; the reason names the first rank without it."""
        out = {}
        for name in ("nccl", "custom", "host"):
            missing = [(r, rec) for r, rec in enumerate(records) if not rec[name]]
            out[name] = not missing
            out[f"{name}_why"] = "" if not missing else f"rank {missing[0][0]}: {missing[0][1][f'{name}_why']}"
        algos = [tuple(rec["custom_algorithms"]) for rec in records]
        # Ranks that list different subsets share the intersection; an empty list means "all".
        listed = [set(a) for a in algos if a]
        common = tuple(sorted(set.intersection(*listed))) if listed else ()
        if listed and not common:
            out["custom"] = False
            out["custom_why"] = "the ranks' custom backends implement no algorithm in common"
        return Availability(custom_algorithms=common, **out)


def probe_availability(nccl=None, custom=None, custom_algorithms=None) -> Availability:
    """This process's backends. `nccl`/`custom`: True/False to state them, or a string saying why not; None
    probes (NCCL: built with CUDA, a usable GPU, libnccl loads; custom: built with its kernels, a usable GPU), with
    the checks of usable.py."""
    nccl_ok, nccl_why = _probe_nccl() if nccl is None else _stated(nccl)
    custom_ok, custom_why, algos = _probe_custom() if custom is None else (*_stated(custom), ())
    if custom_algorithms is not None:
        algos = tuple(custom_algorithms)
    return Availability(nccl=nccl_ok, custom=custom_ok, host=True, nccl_why=nccl_why, custom_why=custom_why,
                        custom_algorithms=tuple(algos))


def _stated(value):
    if isinstance(value, str):
        return False, value
    return bool(value), "" if value else "not available"


def _probe_nccl():
    found = nccl_problems()
    return (not found), "; ".join(found)


def custom_algorithms() -> tuple:
    """What this build's custom backend implements."""
    return tuple(_CUSTOM_DEFAULT)


def _probe_custom():
    found = list(custom_problems())
    return (not found), "; ".join(found), custom_algorithms()


def size_bucket(nbytes: int) -> int:
    """The power of two at or above nbytes (0 for 0): calls in one bucket share a cached choice."""
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


class Selector:
    """The choice for one communicator. Build it with :func:`build` (or directly, in tests)."""

    def __init__(self, topo, *, rank: int, world_size: int, gpus=None, hosts=None, avail: Availability | None = None,
                 local_size: int = 0, why_no_topology: str = ""):
        """`gpus[r]`: rank r's GPU (a global index of `topo`), or None when the ranks' GPUs are not known (CPU
        communicator, empty detection) - then `why_no_topology` says why. `hosts[r]`: rank r's host group (an int
        or a name); ranks of one host must be consecutive and every host must hold as many ranks for the
        two-level and P2P paths. `local_size` is the host backend's virtual node size (GPUCOLL_LOCAL_SIZE)."""
        self.topology = topo
        self.rank = rank
        self.world_size = world_size
        self.avail = avail or Availability()
        self.local_size = local_size
        self.gpus = list(gpus) if gpus is not None else None
        self.nodes, self.local = 1, world_size
        self.why_no_layout = why_no_topology or ("" if gpus is not None else "the ranks' GPUs are not known")
        if self.gpus is not None:
            if len(self.gpus) != world_size:
                raise InvalidArgument(f"gpus must list one GPU per rank ({world_size}); got {len(self.gpus)}")
            self._set_layout(hosts if hosts is not None else [topo.gpu_host(g) for g in self.gpus])
        self._cache: dict = {}
        # all_reduce's answers for the custom backend's one-call path, per dtype and size bucket, in the form the
        # native call reads (CustomComm.all_reduce_array; Custom.fast_all_reduce fills it): cleared with the cache.
        self.fast_choices: dict = {}
        self._lock = threading.Lock()

    def _set_layout(self, hosts) -> None:
        order, counts = [], {}
        for h in hosts:
            if not order or order[-1] != h:
                if h in counts:
                    self.gpus, self.why_no_layout = None, (
                        f"ranks are not grouped by host (host {h!r} holds ranks that are not consecutive); "
                        f"P2P kernels and the two-level algorithms need consecutive ranks per host")
                    return
                order.append(h)
            counts[h] = counts.get(h, 0) + 1
        if len(set(counts.values())) > 1:
            self.gpus, self.why_no_layout = None, (
                f"hosts hold different numbers of ranks ({counts}); the two-level algorithms need as many on each")
            return
        self.nodes, self.local = len(order), self.world_size // len(order)

    # -- what the communicator calls ------------------------------------------------------------------------------
    def choose(self, coll, nbytes: int, dtype: str = "float32", algo: str = "auto", *, backend: str = "auto",
               device: str = "cuda") -> Choice:
        """The backend and algorithm for one call. `nbytes` counts like the host selector (the whole buffer; for
        all_gather, reduce_scatter, all_to_all, gather and scatter the world-sized one). `algo` ("auto",
        "oneshot", "nccl:ring", "host:ring", ...) and, when auto, GPUCOLL_ALGO win over the model; an impossible
        request raises InvalidArgument saying why. `backend` other than auto keeps the choice to that backend;
        `device` "cpu" means CPU buffers (the host backend's own selector), "cuda" GPU buffers."""
        if algo is None:
            algo = "auto"
        if not isinstance(algo, str):
            raise InvalidArgument(f"algo must be a string ('auto' or an algorithm name); got {algo!r}")
        if device not in ("cuda", "cpu"):
            raise InvalidArgument(f"device must be 'cuda' or 'cpu'; got {device!r}")
        if backend not in ("auto", "custom", "nccl", "host"):
            raise InvalidArgument(f"backend must be one of auto, custom, nccl, host; got {backend!r}")
        coll_name = _coll_name(coll)
        key = (coll_name, size_bucket(nbytes), dtype, algo.strip().lower(), backend, device)
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit
        choice = self._host(*key[:4], backend) if device == "cpu" else self._cuda(*key[:4], backend)
        with self._lock:
            self._cache[key] = choice
        return choice

    def mark_p2p_failed(self, pairs) -> None:
        """Rank pairs whose P2P failed a real copy: P2P kernels stop using them. Every rank must make the same
        call (exchange the probe's results first), or the ranks' choices would differ."""
        for a, b in pairs:
            if self.gpus is not None and self.gpus[a] != self.gpus[b]:
                self.topology.set_p2p(self.gpus[a], self.gpus[b], "failed")
        with self._lock:
            self._cache.clear()
            self.fast_choices.clear()

    def describe(self) -> str:
        a = self.avail
        backends = ", ".join(f"{n} " + ("yes" if getattr(a, n) else f"no ({getattr(a, n + '_why')})")
                             for n in ("custom", "nccl"))
        where = (f"{self.nodes} node(s) x {self.local} ranks on GPUs {self.gpus}" if self.gpus is not None
                 else f"no GPU placement: {self.why_no_layout}")
        return f"selection: {where}; backends: {backends}"

    # -- the two paths --------------------------------------------------------------------------------------------
    def _host(self, coll: str, nbytes: int, dtype: str, algo: str, backend: str) -> Choice:
        if backend not in ("auto", "host"):
            raise InvalidArgument(f"CPU buffers run on the host backend; backend={backend!r} takes CUDA buffers")
        if not self.avail.host:
            raise Unsupported(f"the host backend is not available: {self.avail.host_why}")
        coll_id = _C.coll_names().index(coll)
        algo = algo.split(":", 1)[1] if algo.startswith("host:") else "auto" if algo == "host" else algo
        name = _C.select_algorithm(coll_id, self.world_size, nbytes, self.local_size, algo)
        pred = _C.predict(name, coll_id, self.world_size, nbytes, self.local_size)
        how = "the host cost model's fastest" if algo == "auto" else f"requested ({algo})"
        return Choice("host", name, pred["seconds"] if pred["usable"] else math.nan,
                      f"CPU buffers: host backend, {how} schedule", "", "SHM")

    def _cuda(self, coll: str, nbytes: int, dtype: str, algo: str, backend: str) -> Choice:
        a = self.avail
        only = {"custom": backend in ("auto", "custom"), "nccl": backend in ("auto", "nccl")}
        why = {"host": _CUDA_HOST_WHY}
        for name in ("custom", "nccl"):
            if not only[name]:
                why[name] = f"this call is restricted to backend={backend!r}"
            elif not getattr(a, name):
                why[name] = f"{name} backend not available: {getattr(a, name + '_why')}"
        custom_ok = only["custom"] and a.custom
        nccl_ok = only["nccl"] and a.nccl
        if backend == "host":
            raise InvalidArgument(f"backend='host' takes CPU buffers; {_CUDA_HOST_WHY}")
        if self.gpus is None:
            return self._unplaced(coll, algo, nccl_ok, why)
        if self.world_size == 1 and a.nccl and algo in ("", "auto") and not _algo_env(coll):
            # One rank moves nothing between GPUs: the topology model has no link to price, NCCL copies locally.
            return Choice("nccl", "auto", 0.0, "one rank: NCCL copies in place", "", "local")

        def select(custom: bool, nccl: bool):
            return _C.topo_select(self.topology, coll, nbytes, dtype, nranks_per_node=self.local, nodes=self.nodes,
                                  custom=custom, nccl=nccl, host=False, requested=algo, gpus=self.gpus, why=why,
                                  custom_algorithms=list(a.custom_algorithms))

        try:
            try:
                c = select(custom_ok, nccl_ok)
            except InvalidArgument:
                if backend != "custom" or not a.nccl or coll == "all_reduce":
                    raise
                # backend='custom': our kernels for all_reduce (refused, with the reason, where they cannot run
                # it), NCCL for the collectives they do not implement (broadcast, all_gather, ...).
                del why["nccl"]
                c = select(False, True)
        except InvalidArgument as e:
            raise InvalidArgument(f"{e.message} (ranks on GPUs {self._placement()})") from None
        requested = algo not in ("", "auto") or bool(_algo_env(coll))
        how = "requested" if requested else "fastest predicted"
        return Choice(c["backend"], c["algorithm"], c["seconds"],
                      f"{how} on {self.nodes}x{self.local} ranks over {c['link_class']} ({c['model']} model)",
                      c["protocol"], c["link_class"])

    def _unplaced(self, coll: str, algo: str, nccl_ok: bool, why: dict) -> Choice:
        """No topology for these ranks: NCCL (which detects the machine itself) or nothing."""
        wanted = algo if algo not in ("", "auto") else _algo_env(coll)
        if wanted and wanted.split(":", 1)[0] != "nccl":
            raise InvalidArgument(f"algo={wanted!r} needs the ranks' GPU topology, which is unknown: "
                                  f"{self.why_no_layout}; only 'nccl' can be chosen")
        if not nccl_ok:
            raise Unsupported(f"no backend can run {coll} on CUDA buffers: {why.get('nccl', 'nccl unavailable')}; "
                              f"custom kernels need the GPU topology ({self.why_no_layout})")
        return Choice("nccl", "auto", math.nan, f"no GPU topology ({self.why_no_layout}): NCCL picks its own "
                      f"algorithm")

    def _placement(self) -> str:
        return ", ".join(f"rank {r}: GPU{g}" for r, g in enumerate(self.gpus or ()))


def _coll_name(coll) -> str:
    names = _C.coll_names()
    if isinstance(coll, int) and not isinstance(coll, bool) and 0 <= coll < len(names):
        return names[coll]
    if isinstance(coll, str) and coll.lower().replace("allreduce", "all_reduce") in names:
        return coll.lower().replace("allreduce", "all_reduce")
    raise InvalidArgument(f"coll must be a collective id or one of {', '.join(names)}; got {coll!r}")


def _algo_env(coll: str) -> str:
    """What GPUCOLL_ALGO names for `coll` ("" for nothing), parsed by the C++ selector, its one reader."""
    return _C.topo_algo_override(coll)


def build(store, rank: int, world_size: int, *, device=None, local_size: int = 0, avail: Availability | None = None,
          p2p_failed=(), timeout: float | None = None, local_topology=None) -> Selector:
    """The communicator's Selector, built by every rank together over the rendezvous `store`.

    `device`: this rank's CUDA device ordinal (None for a CPU communicator). `avail`: this rank's backends
    (default: :func:`probe_availability`); the merged availability is what every rank has. `p2p_failed`: rank
    pairs this rank's real-copy probe saw fail; every rank's list is applied. `local_topology` replaces
    detection (tests). GPUCOLL_TOPO_FILE and GPUCOLL_TOPO_DUMP_FILE apply as in :func:`gpucoll.topology.detect`;
    with several hosts rank 0 then rewrites the dump file with the merged, multi-host view."""
    avail = avail if avail is not None else probe_availability()
    local = local_topology if local_topology is not None else topology.detect()
    bus_id = ""
    if device is not None:
        devices = {d["index"]: d for d in _C.cuda_probe()["devices"]}
        bus_id = str(devices.get(int(device), {}).get("pci_bus_id", "")).lower()
        colon = bus_id.find(":")
        bus_id = bus_id[max(colon - 4, 0):]  # "00000000:18:00.0" -> "0000:18:00.0", the topology's form
    record = {"host": socket.gethostname(), "device": device, "bus_id": bus_id, "avail": avail.record(),
              "p2p_failed": [list(p) for p in p2p_failed]}
    # Several communicators may be built over one store (torch's, or repeated inits): each gets its own keys.
    generation = (store.add("gpucoll/topo/count", 1) - 1) // world_size
    topo, records = topology.exchange_through_store(store, rank, world_size, local, extra=record,
                                                    prefix=f"gpucoll/topo/{generation}", timeout=timeout)
    if rank == 0 and topo.num_hosts > 1 and config.is_set("GPUCOLL_TOPO_DUMP_FILE"):
        try:
            topology.dump(topo, config.get("GPUCOLL_TOPO_DUMP_FILE"))
        except OSError as e:  # a diagnostic, like NCCL_TOPO_DUMP_FILE: never fails init
            _log.warn(f"GPUCOLL_TOPO_DUMP_FILE: could not write the merged topology: {e}")
    merged = Availability.merged([rec["avail"] for rec in records])
    gpus, why = place_ranks(topo, records)
    sel = Selector(topo, rank=rank, world_size=world_size, gpus=gpus,
                   hosts=[rec["host"] for rec in records] if gpus is not None else None, avail=merged,
                   local_size=local_size, why_no_topology=why)
    failed = {tuple(sorted(p)) for rec in records for p in rec["p2p_failed"]}
    if failed:
        sel.mark_p2p_failed(sorted(failed))
    _log.debug(sel.describe())
    return sel


def place_ranks(topo, records):
    """Rank r's global GPU index in `topo` from its record (host, CUDA bus id, device ordinal), or (None, why).

    Ranks' hosts are matched to the topology's hosts by name; when no name matches (a GPUCOLL_TOPO_FILE that
    describes other machines) the i-th host by lowest rank is the topology's i-th host. On its host a rank's GPU
    is the one with its bus id, else the one numbered like its device ordinal."""
    if any(rec["device"] is None for rec in records):
        return None, "a CPU communicator (no rank has a CUDA device)"
    if topo.num_gpus == 0:
        notes = "; ".join(topo.notes) or "detection found no GPU"
        return None, f"the topology has no GPUs ({notes})"
    names = topo.host_names()
    order = list(dict.fromkeys(rec["host"] for rec in records))
    by_name = all(h in names for h in order)
    if not by_name and len(order) > len(names):
        return None, f"the ranks run on {len(order)} hosts, the topology describes {len(names)}"
    gpus = []
    for r, rec in enumerate(records):
        h = names.index(rec["host"]) if by_name else order.index(rec["host"])
        ids = topo.host_gpus(h)
        on_bus = [g for g in ids if rec["bus_id"] and topo.gpu_bus_id(g) == rec["bus_id"]]
        if on_bus:
            gpus.append(on_bus[0])
        elif 0 <= int(rec["device"]) < len(ids):
            gpus.append(ids[int(rec["device"])])
        else:
            return None, (f"rank {r} uses CUDA device {rec['device']} but the topology's host {names[h]!r} has "
                          f"{len(ids)} GPU(s)")
    return gpus, ""
