// The flight recorder as Python sees it (core/flight_recorder.h): plain dicts, names instead of ids, so a dump is
// JSON as it stands and readable without gpucoll (gpucoll/trace/ writes and reads it).
#include <time.h>

#include "algo/registry.h"
#include "core/flight_recorder.h"
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
  const auto& algos = algo::algorithms();
  py::list rows;
  for (const TraceEntry& e : entries) {
    py::dict r;
    const bool p2p = e.sig.coll == kTraceP2P;
    const bool barrier = e.sig.coll == algo::kSigBarrier;
    r["id"] = e.id;
    r["seq"] = e.seq;
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
  out["capacity"] = rec.capacity();
  out["recorded"] = rec.recorded();
  // Both clocks read together: the entries' CLOCK_MONOTONIC times plus (realtime - monotonic) are wall-clock
  // times, which line up the dumps of ranks on different machines (as far as their clocks agree).
  const int64_t mono = clock_ns(CLOCK_MONOTONIC);
  const int64_t real = clock_ns(CLOCK_REALTIME);
  out["monotonic_ns"] = mono;
  out["realtime_ns"] = real;
  out["entries"] = rows;
  return out;
}

}  // namespace gpucoll::python
