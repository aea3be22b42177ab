// Bindings of the custom allreduce: the host-side decisions (every build: launch shapes, eligibility,
// residency limit) and, in CUDA builds, the communicator, streams, events and multi-stream graphs used by
// gpucoll/backends/custom.py and gpucoll/testing.py. A build without CUDA binds CustomComm and the CUDA
// helpers as functions raising Unsupported with how to get a CUDA build.
#include <pybind11/stl.h>

#include <string>
#include <tuple>
#include <vector>

#include "backends/custom/eligibility.h"
#include "backends/custom/launch_shape.h"
#include "backends/custom/slices.h"
#include "core/error.h"
#include "python/bindings.h"

#ifdef GPUCOLL_WITH_CUDA
#include "backends/custom/cuda/custom_comm.h"
#include "backends/custom/cuda/peer_memory.h"
#include "backends/custom/cuda/stream_graph.h"
#include "device/cuda/cuda_util.h"
#endif

namespace py = pybind11;

namespace gpucoll::python {
namespace {

using custom::Algo;

constexpr const char* kNoCudaBuild =
    "gpucoll was built without CUDA (nvcc was not found at build time), so it has no custom allreduce kernels. "
    "Install the CUDA toolkit and rebuild: GPUCOLL_CUDA=on pip install --no-build-isolation -e .";

Algo algo_arg(const std::string& name) {
  Algo a;
  GPUCOLL_CHECK_ARG(custom::parse_algo(name, &a), "algo must be one of oneshot, twoshot, ring, tree (or dbt); got '",
                    name, "'");
  return a;
}

void bind_host_logic(py::module_& m) {
  m.attr("CUSTOM_MAX_RANKS") = custom::kMaxRanks;
  m.attr("CUSTOM_MAX_BLOCKS") = custom::kMaxBlocks;
  m.attr("CUSTOM_THREADS") = custom::kThreads;
  m.def("custom_algo_name", [](const std::string& name) { return std::string(custom::algo_name(algo_arg(name))); },
        py::arg("name"), "The canonical name of a custom algorithm ('dbt' -> 'tree'); InvalidArgument if unknown.");
  m.def(
      "custom_choose_algo",
      [](size_t bytes, int nranks) { return std::string(custom::algo_name(custom::choose_algo(bytes, nranks))); },
      py::arg("bytes"), py::arg("nranks"), "The algorithm algo='auto' runs.");
  m.def(
      "custom_launch_shape",
      [](const std::string& algo, size_t bytes, int nranks, int sms, int max_blocks) {
        const custom::LaunchShape s = custom::choose_launch_shape(algo_arg(algo), bytes, nranks, sms, max_blocks);
        return py::make_tuple(s.blocks, s.threads);
      },
      py::arg("algo"), py::arg("bytes"), py::arg("nranks"), py::arg("sms"), py::arg("max_blocks") = 0,
      "(blocks, threads) of one kernel.");
  m.def("custom_max_blocks_per_rank", &custom::max_blocks_per_rank, py::arg("co_resident_ranks"), py::arg("sms"),
        py::arg("blocks_per_sm"));
  m.def("custom_check_residency", &custom::check_residency, py::arg("nranks"), py::arg("blocks"), py::arg("sms"),
        py::arg("blocks_per_sm"));
  m.def("custom_piece_elems", &custom::piece_elems, py::arg("half_bytes"), py::arg("elem_size"));
  m.def(
      "custom_slice",
      [](size_t count, int nchunks, int chunk, int nblocks, int block, size_t elems_per_pack) {
        GPUCOLL_CHECK_ARG(nchunks >= 1 && chunk >= 0 && chunk < nchunks && nblocks >= 1 && block >= 0 &&
                              block < nblocks && elems_per_pack >= 1,
                          "custom_slice needs 0 <= chunk < nchunks, 0 <= block < nblocks, elems_per_pack >= 1");
        const custom::Range r =
            custom::block_slice_of(custom::chunk_range(count, nchunks, chunk), elems_per_pack, nblocks, block);
        return py::make_tuple(r.begin, r.count);
      },
      py::arg("count"), py::arg("nchunks"), py::arg("chunk"), py::arg("nblocks"), py::arg("block"),
      py::arg("elems_per_pack"),
      "(begin, count) of block `block`'s slice of chunk `chunk`: the kernels' own arithmetic (slices.h).");
  m.def(
      "custom_eligibility",
      [](int nranks, std::vector<std::string> hosts, std::vector<uint8_t> p2p, DType dtype, RedOp op, bool premul,
         size_t count, uintptr_t in_ptr, uintptr_t out_ptr, bool registered, size_t registered_bytes) {
        custom::Facts f;
        f.nranks = nranks;
        f.hosts = std::move(hosts);
        f.p2p = std::move(p2p);
        f.dtype = dtype;
        f.op = op;
        f.premul = premul;
        f.count = count;
        f.in_ptr = in_ptr;
        f.out_ptr = out_ptr;
        f.registered = registered;
        f.registered_bytes = registered_bytes;
        const custom::Decision d = custom::check_eligibility(f);
        py::dict out;
        out["ok"] = d.ok;
        out["reason"] = d.reason;
        out["alignment"] = d.alignment;
        return out;
      },
      py::arg("nranks"), py::arg("hosts"), py::arg("p2p"), py::arg("dtype"), py::arg("op"), py::arg("premul"),
      py::arg("count"), py::arg("in_ptr"), py::arg("out_ptr"), py::arg("registered") = false,
      py::arg("registered_bytes") = 0, "Whether one allreduce can run on the custom kernels: {ok, reason, alignment}.");
}

#ifdef GPUCOLL_WITH_CUDA
cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

py::tuple range_tuple(const cuda::custom::ExportedRange& r) { return py::make_tuple(py::bytes(r.handle), r.offset); }

cuda::custom::ExportedRange range_from(const std::tuple<std::string, uint64_t>& t) {
  cuda::custom::ExportedRange r;
  r.handle = std::get<0>(t);
  r.offset = std::get<1>(t);
  return r;
}

cuda::custom::KernelTrace* live_trace(const cuda::custom::CustomComm& c) {
  cuda::custom::KernelTrace* t = c.trace();
  if (t == nullptr) GPUCOLL_THROW(ErrorCode::kInvalidUsage, "trace", "the custom communicator is closed");
  return t;
}

void bind_cuda(py::module_& m) {
  using cuda::custom::CustomComm;
  using Ranges = std::vector<std::tuple<std::string, uint64_t>>;
  py::class_<CustomComm, NoGilHolder<CustomComm>>(m, "CustomComm")
      .def(py::init<int, int, int, size_t, double>(), py::arg("rank"), py::arg("nranks"), py::arg("device"),
           py::arg("half_bytes"), py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>())
      .def("ipc_handle", [](const CustomComm& c) { return py::bytes(c.ipc_handle()); })
      .def("connect_ipc", &CustomComm::connect_ipc, py::arg("handles"), py::arg("min_sms"), py::arg("co_resident") = 1,
           py::call_guard<py::gil_scoped_release>())
      .def("connect_local", &CustomComm::connect_local, py::arg("comms"))
      .def_property_readonly("p2p_row", [](const CustomComm& c) { return c.p2p_row(); })
      .def("export_buffer", [](const CustomComm& c, uintptr_t ptr) { return range_tuple(c.export_buffer(ptr)); })
      .def(
          "register_ipc",
          [](CustomComm& c, uintptr_t ptr, size_t bytes, const Ranges& peers) {
            std::vector<cuda::custom::ExportedRange> rs;
            for (const auto& t : peers) rs.push_back(range_from(t));
            c.register_ipc(ptr, bytes, rs);
          },
          py::arg("ptr"), py::arg("bytes"), py::arg("peers"))
      .def("register_local", &CustomComm::register_local, py::arg("ptr"), py::arg("bytes"), py::arg("peer_ptrs"))
      .def("registered_bytes", &CustomComm::registered_bytes, py::arg("ptr"))
      .def("set_defer_registration", &CustomComm::set_defer_registration, py::arg("defer"))
      .def("pending", &CustomComm::pending)
      .def(
          "register_pending_ipc",
          [](CustomComm& c, const std::vector<Ranges>& peers) {
            std::vector<std::vector<cuda::custom::ExportedRange>> all;
            for (const auto& row : peers) {
              all.emplace_back();
              for (const auto& t : row) all.back().push_back(range_from(t));
            }
            c.register_pending_ipc(all);
          },
          py::arg("peers"))
      .def("register_pending_local", &CustomComm::register_pending_local, py::arg("peer_ptrs"))
      .def(
          "all_reduce",
          [](CustomComm& c, uintptr_t in, uintptr_t out, size_t count, DType dtype, RedOp op, const std::string& algo,
             uintptr_t stream, int max_blocks, int64_t piece) {
            const Algo a = algo_arg(algo);
            py::gil_scoped_release release;
            return c.all_reduce(reinterpret_cast<const void*>(in), reinterpret_cast<void*>(out), count, dtype, op, a,
                                as_stream(stream), max_blocks, piece);
          },
          py::arg("in_ptr"), py::arg("out_ptr"), py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("algo"),
          py::arg("stream"), py::arg("max_blocks") = 0, py::arg("piece") = -1,
          "Enqueue the call (piece >= 0: only that piece); returns how many pieces the call has.")
      .def(
          "compressed_all_reduce",
          [](CustomComm& c, uintptr_t in, uintptr_t out, size_t count, DType dtype, RedOp op,
             const std::string& compress, uintptr_t stream) {
            const Wire w = wire_from_name(compress.c_str());
            if (w == Wire::kNone) GPUCOLL_INVALID_ARG("compress must be 'int8', 'fp8' or 'bf16'; got '", compress, "'");
            py::gil_scoped_release release;
            c.compressed_all_reduce(reinterpret_cast<const void*>(in), reinterpret_cast<void*>(out), count, dtype, op,
                                    w, as_stream(stream));
          },
          py::arg("in_ptr"), py::arg("out_ptr"), py::arg("count"), py::arg("dtype"), py::arg("op"),
          py::arg("compress"), py::arg("stream"),
          "all_reduce(compress=...) on the kernels (backends/custom/kernels/compressed.cu), enqueued on `stream`.")
      .def(
          "run_all_reduce",
          [](CustomComm& c, uintptr_t in, uintptr_t out, size_t count, DType dtype, RedOp op, bool premul,
             const std::string& algo, uintptr_t stream) {
            return c.run_all_reduce(reinterpret_cast<const void*>(in), reinterpret_cast<void*>(out), count, dtype, op,
                                    premul, algo, as_stream(stream));
          },
          py::arg("in_ptr"), py::arg("out_ptr"), py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("premul"),
          py::arg("algo"), py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
          "One allreduce, checked, chosen and enqueued: '' when it runs here, else why the kernels decline it.")
      .def(
          "all_reduce_array",
          // Communicator.all_reduce(x) in place of a plain __cuda_array_interface__ array (cuda_array.cc), sync,
          // algo auto, on x's own stream: the buffer, its placement, the per-call choice, eligibility and the launch
          // in one crossing. `choices` is the selector's answer per size bucket, {dtype * 64 + log2 of the power of
          // two at or above the bytes: algorithm name, or None for NCCL}, filled lazily by the caller, or None where
          // no selector decides (the kernels' own size rule). Returns True when it ran here; "nccl" where the
          // choice is NCCL; the key where `choices` lacks it (the caller asks the selector and calls again); False
          // for anything else. Only True has enqueued anything: the others leave the call to the caller's paths,
          // which raise the general path's typed errors and log its fallbacks.
          [](CustomComm& c, py::handle x, RedOp op, py::handle choices) -> py::object {
            CudaArrayView v;
            if (!cuda_array_view(x, &v)) return py::bool_(false);
            std::string algo = "auto";
            if (!choices.is_none()) {
              if (!PyDict_Check(choices.ptr())) return py::bool_(false);
              const size_t nbytes = v.count * dtype_size(v.dtype);
              const long lg = nbytes <= 1 ? 0 : 64 - __builtin_clzll(static_cast<unsigned long long>(nbytes - 1));
              const long key = static_cast<long>(v.dtype) * 64 + lg;
              const py::object k = py::reinterpret_steal<py::object>(PyLong_FromLong(key));
              PyObject* hit = PyDict_GetItemWithError(choices.ptr(), k.ptr());  // borrowed
              if (hit == nullptr) {
                if (PyErr_Occurred()) throw py::error_already_set();
                return k;
              }
              if (hit == Py_None) return py::str("nccl");
              if (!PyUnicode_Check(hit)) return py::bool_(false);
              algo = py::cast<std::string>(hit);
            }
            bool ran = false;  // elsewhere than this GPU, or declined by the kernels: the general path decides
            {
              py::gil_scoped_release release;
              const cuda::PointerInfo where = cuda::pointer_info(reinterpret_cast<const void*>(v.ptr));
              if (where.device_memory && where.device == c.device()) {
                ran = c.run_all_reduce(reinterpret_cast<const void*>(v.ptr), reinterpret_cast<void*>(v.ptr), v.count,
                                       v.dtype, op, false, algo, as_stream(v.stream))
                          .empty();
              }
            }
            return py::bool_(ran);
          },
          py::arg("x"), py::arg("op"), py::arg("choices"))
      .def("set_placement", &CustomComm::set_placement, py::arg("hosts"), py::arg("p2p"),
           "Every rank's host and the agreed P2P matrix; returns why the kernels can never run here ('' if they can).")
      .def(
          "shape_for",
          [](const CustomComm& c, const std::string& algo, size_t bytes, DType dtype, RedOp op) {
            const custom::LaunchShape s = c.shape_for(algo_arg(algo), bytes, dtype, op);
            return py::make_tuple(s.blocks, s.threads);
          },
          py::arg("algo"), py::arg("bytes"), py::arg("dtype"), py::arg("op"))
      .def("timed_out", &CustomComm::timed_out, py::call_guard<py::gil_scoped_release>())
      .def("late_ranks", &CustomComm::late_ranks, py::call_guard<py::gil_scoped_release>(),
           "The ranks a wait of this rank gave up on (their flags never came).")
      .def("check_calls", &CustomComm::check_calls, py::call_guard<py::gil_scoped_release>(),
           "InvalidArgument once per call whose kernel found that ranks made different calls (after a sync).")
      .def("_set_call_check", &CustomComm::set_call_check, py::arg("on"))
      .def_property_readonly("call_check", &CustomComm::call_check)
      .def(
          "trace",
          [](const CustomComm& c, int last) {
            cuda::custom::KernelTrace* t = live_trace(c);
            std::vector<TraceEntry> entries;
            {
              py::gil_scoped_release nogil;  // copies the device half out
              entries = t->snapshot(last);
            }
            return trace_dict(entries, t->capacity(), t->recorded());
          },
          py::arg("last") = 0, "The flight recorder's last `last` calls (0: all), device times merged in.")
      .def(
          "stragglers",
          [](const CustomComm& c, bool reset) {
            cuda::custom::KernelTrace* t = live_trace(c);
            StragglerWindow::Snapshot snap;
            {
              py::gil_scoped_release nogil;
              snap = t->stragglers(reset);
            }
            return straggler_dict(snap, t->window());
          },
          py::arg("reset") = false, "Each rank's lateness at the last calls, as the kernels measured it in barrier 0.")
      .def("records_handle", [](const CustomComm& c) { return py::bytes(c.records_handle()); })
      .def_property_readonly("record_capacity",
                             [](const CustomComm& c) { return c.trace() ? c.trace()->record_capacity() : 0u; })
      .def("connect_records", &CustomComm::connect_records, py::arg("handles"), py::arg("capacities"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "peer_calls",
          [](const CustomComm& c, const std::vector<int>& skip) {
            cuda::custom::KernelTrace* t = live_trace(c);
            std::vector<cuda::custom::KernelTrace::PeerCalls> calls;
            {
              py::gil_scoped_release nogil;
              calls = t->peer_calls(skip);
            }
            py::list out;
            for (const auto& p : calls) {
              if (!p.known) {
                out.append(py::none());
                continue;
              }
              py::dict d;
              d["entered"] = p.entered;
              d["done"] = p.done;
              d["in_for_s"] = p.in_for_s;
              d["done_ago_s"] = p.done_ago_s;
              out.append(d);
            }
            return out;
          },
          py::arg("skip") = std::vector<int>{},
          "Where every rank's kernels are, read from its ring: the last call they began and the last they finished "
          "(None: that rank's ring is not readable here, or in `skip`).")
      .def("synchronize", &CustomComm::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("close", &CustomComm::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("rank", &CustomComm::rank)
      .def_property_readonly("nranks", &CustomComm::nranks)
      .def_property_readonly("device", &CustomComm::device)
      .def_property_readonly("sms", &CustomComm::sms)
      .def_property_readonly("half_bytes", &CustomComm::half_bytes)
      .def_property_readonly("open_mappings", &CustomComm::open_mappings)
      .def_property_readonly("registered_count", &CustomComm::registered_count);

  py::class_<cuda::Stream, NoGilHolder<cuda::Stream>>(m, "CudaStream")
      .def(py::init<int>(), py::arg("device"))
      .def_property_readonly("handle", [](const cuda::Stream& s) { return reinterpret_cast<uintptr_t>(s.get()); })
      .def("synchronize", &cuda::Stream::synchronize, py::call_guard<py::gil_scoped_release>());
  py::class_<cuda::Event>(m, "CudaEvent")
      .def(py::init<int, bool>(), py::arg("device"), py::arg("timing") = false)
      .def("record", [](cuda::Event& e, uintptr_t s) { e.record(as_stream(s)); }, py::arg("stream"))
      .def("query", &cuda::Event::query)
      .def("synchronize", &cuda::Event::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("wait_on", [](const cuda::Event& e, uintptr_t s) { e.wait_on(as_stream(s)); }, py::arg("stream"))
      .def("elapsed_ms", &cuda::Event::elapsed_ms, py::arg("start"),
           "Milliseconds since `start` completed (both made with timing=True, both complete).");
  py::class_<cuda::MultiStreamGraph, NoGilHolder<cuda::MultiStreamGraph>>(m, "MultiStreamGraph")
      .def(py::init([](int device, const std::vector<uintptr_t>& streams) {
             std::vector<cudaStream_t> ss;
             for (uintptr_t s : streams) ss.push_back(as_stream(s));
             return new cuda::MultiStreamGraph(device, ss);
           }),
           py::arg("device"), py::arg("streams"))
      .def("begin", &cuda::MultiStreamGraph::begin)
      .def("end", &cuda::MultiStreamGraph::end)
      .def("replay", &cuda::MultiStreamGraph::replay, py::arg("times") = 1, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("capturing", &cuda::MultiStreamGraph::capturing);
  m.def("custom_ipc_open_handles", &cuda::custom::ipc_open_handles,
        "CUDA IPC mappings open in this process (every custom communicator).");
}
#else
void bind_cuda(py::module_& m) {
  auto unsupported = [](const py::args&, const py::kwargs&) -> py::object {
    GPUCOLL_THROW(ErrorCode::kUnsupported, "", kNoCudaBuild);
  };
  for (const char* name : {"CustomComm", "CudaStream", "CudaEvent", "MultiStreamGraph"}) m.def(name, unsupported);
  m.def("custom_ipc_open_handles", []() { return 0; });
}
#endif

}  // namespace

std::unique_ptr<DeviceDone> event_device_done(uintptr_t stream, int ordinal, std::string what) {
#ifdef GPUCOLL_WITH_CUDA
  // gpucoll._C.Work's end for what the custom kernels enqueued on `stream`: a CUDA event recorded after it.
  class EventDone final : public DeviceDone {
   public:
    EventDone(uintptr_t stream, int ordinal, std::string what) : event_(ordinal), what_(std::move(what)) {
      event_.record(as_stream(stream));
    }
    bool query() override { return event_.query(); }
    void wait_on(uintptr_t s) override { event_.wait_on(as_stream(s)); }
    void synchronize() override { event_.synchronize(); }
    std::string describe() override { return what_; }

   private:
    cuda::Event event_;
    std::string what_;
  };
  return std::make_unique<EventDone>(stream, ordinal, std::move(what));
#else
  (void)stream;
  (void)ordinal;
  (void)what;
  GPUCOLL_THROW(ErrorCode::kUnsupported, "", kNoCudaBuild);
#endif
}

void bind_custom(py::module_& m) {
#ifdef GPUCOLL_WITH_CUDA
  m.attr("CUSTOM_BACKEND_BUILT") = true;
#else
  m.attr("CUSTOM_BACKEND_BUILT") = false;
#endif
  m.attr("CUSTOM_BACKEND_UNBUILT_REASON") = kNoCudaBuild;
  bind_host_logic(m);
  bind_cuda(m);
}

}  // namespace gpucoll::python
