// The flight recorder and the straggler window as Python sees them (core/flight_recorder.h, core/stragglers.h): plain
// dicts, names instead of ids, so a dump is JSON as it stands and readable without gpucoll
// (gpucoll/flight_recorder.py writes it).
#include <pybind11/stl.h>
#include <time.h>

#include "algo/registry.h"
#include "core/error.h"
#include "core/flight_recorder.h"
#include "core/stragglers.h"
#include "core/types.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace gpucoll::python {

namespace {
int64_t clock_ns(clockid_t id) {
  struct timespec ts;
  clock_gettime(id, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

py::object op_name(uint8_t coll) {
  if (coll == algo::kSigBarrier) return py::str("barrier");
  if (coll == kTraceP2P) return py::str("p2p");
  return py::str(algo::coll_name(static_cast<algo::Coll>(coll)));
}
}  // namespace

py::dict trace_dict(const FlightRecorder& rec, int last) {
  std::vector<TraceEntry> entries;
  {
    py::gil_scoped_release nogil;  // the writer never waits on the GIL, but a long copy should not hold it
    entries = rec.snapshot(last);
  }
  return trace_dict(entries, rec.capacity(), rec.recorded());
}

py::dict trace_dict(const std::vector<TraceEntry>& entries, int capacity, uint64_t recorded) {
  const auto& algos = algo::algorithms();
  py::list rows;
  for (const TraceEntry& e : entries) {
    py::dict r;
    const bool p2p = e.sig.coll == kTraceP2P;
    const bool barrier = e.sig.coll == algo::kSigBarrier;
    r["id"] = e.id;
    r["seq"] = e.seq;
    // The collective's number among the collectives alone (the host backend's seq; NCCL's seq counts sends and
    // receives too): the same on every rank for the same collective. None for a point-to-point batch.
    r["coll_seq"] = p2p ? py::none() : py::object(py::int_(e.sig.seq));
    r["op"] = op_name(e.sig.coll);
    r["count"] = e.sig.count;
    r["dtype"] = p2p || barrier ? py::none() : py::object(py::str(dtype_name(static_cast<DType>(e.sig.dtype))));
    if (e.sig.op == algo::kSigPremulSum) {
      r["redop"] = "premul_sum";
    } else {
      r["redop"] = e.sig.op == algo::kSigNone ? py::none() : py::object(py::str(redop_name(static_cast<RedOp>(e.sig.op))));
    }
    r["root"] = e.sig.root;  // a p2p batch: its one peer, -2 for several
    // NCCL picks its own algorithm and does not say which: "nccl", as Communicator.algorithm_for names it.
    if (e.backend == TraceBackend::kNccl && !p2p) {
      r["algo"] = "nccl";
    } else {
      r["algo"] = e.sig.algo < algos.size() ? py::object(py::str(algos[e.sig.algo]->name)) : py::none();
    }
    r["bytes"] = e.bytes;
    r["backend"] = trace_backend_name(e.backend);
    r["state"] = trace_state_name(e.state);
    r["enqueue_ns"] = e.enqueue_ns;
    r["start_ns"] = e.start_ns;
    r["end_ns"] = e.end_ns;
    r["dev_start_ns"] = e.dev_start_ns;
    r["dev_end_ns"] = e.dev_end_ns;
    rows.append(r);
  }
  py::dict out;
  out["capacity"] = capacity;
  out["recorded"] = recorded;
  // Both clocks read together: the entries' CLOCK_MONOTONIC times plus (realtime - monotonic) are wall-clock
  // times, which line up the dumps of ranks on different machines (as far as their clocks agree).
  const int64_t mono = clock_ns(CLOCK_MONOTONIC);
  const int64_t real = clock_ns(CLOCK_REALTIME);
  out["monotonic_ns"] = mono;
  out["realtime_ns"] = real;
  out["entries"] = rows;
  return out;
}

py::dict straggler_dict(const StragglerWindow& w) { return straggler_dict(w.stats(), w.capacity()); }

py::dict straggler_dict(const StragglerWindow::Snapshot& snap, int window) {
  py::list ranks;
  int r = 0;
  for (const RankLateness& s : snap.ranks) {
    py::dict row;
    row["rank"] = r++;
    row["median_s"] = s.median_s;
    row["p90_s"] = s.p90_s;
    row["max_s"] = s.max_s;
    row["last"] = s.last;
    row["last_share"] = snap.samples > 0 ? static_cast<double>(s.last) / static_cast<double>(snap.samples) : 0.0;
    ranks.append(row);
  }
  py::dict out;
  out["samples"] = snap.samples;
  out["window"] = window;
  out["total"] = snap.total;
  out["ranks"] = ranks;
  out["summary"] = StragglerWindow::summary(snap);
  return out;
}

void bind_trace(py::module_& m) {
  py::class_<StragglerWindow>(m, "StragglerWindow")
      .def(py::init<int, int>(), py::arg("nranks"), py::arg("capacity"))
      .def(
          "add",
          [](StragglerWindow& w, const std::vector<int64_t>& arrival_ns) {
            GPUCOLL_CHECK_ARG(static_cast<int>(arrival_ns.size()) == w.nranks(), "arrival_ns needs one time per rank (",
                              w.nranks(), "); got ", arrival_ns.size());
            return w.add(arrival_ns.data());
          },
          py::arg("arrival_ns"), "One collective: every rank's arrival time in nanoseconds of one clock.")
      .def("stats", [](const StragglerWindow& w) { return straggler_dict(w); },
           "The window's statistics, as Communicator.stragglers() reports them.")
      .def("clear", &StragglerWindow::clear);
}

}  // namespace gpucoll::python
