#include <pybind11/stl.h>

#include <optional>
#include <tuple>

#include "algo/registry.h"
#include "select/selector.h"
#include "backends/host/host_comm.h"
#include "backends/host/kernels.h"
#include "core/config.h"
#include "core/error.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace gpucoll::python {

namespace {

// The DType of a native-order buffer-protocol format, for the formats NumPy gives the dtypes the host backend
// reduces; false for anything else (the caller then takes the Python path, which names the problem).
bool native_dtype(const char* format, Py_ssize_t itemsize, DType* out) {
  if (format == nullptr || format[0] == '\0' || format[1] != '\0') return false;
  switch (format[0]) {
    case 'e': *out = DType::kF16; return itemsize == 2;
    case 'f': *out = DType::kF32; return itemsize == 4;
    case 'd': *out = DType::kF64; return itemsize == 8;
    case 'b': *out = DType::kI8; return itemsize == 1;
    case 'B': *out = DType::kU8; return itemsize == 1;
    case 'i': case 'l': case 'q':
      if (itemsize == 4) *out = DType::kI32;
      else if (itemsize == 8) *out = DType::kI64;
      else return false;
      return true;
    default: return false;
  }
}

}  // namespace

void bind_host(py::module_& m) {
  using host::HostComm;
  m.def(
      "avg_scalar_bytes",
      [](DType dtype, int nranks) -> std::optional<py::bytes> {
        if (nranks < 1) GPUCOLL_INVALID_ARG("nranks must be >= 1; got ", nranks);
        if (dtype_is_fp8(dtype)) GPUCOLL_THROW(ErrorCode::kUnsupported, "", "the host backend has no fp8 arithmetic");
        unsigned char out[8];
        if (!host::avg_scalar_bytes(dtype, nranks, out)) return std::nullopt;
        return py::bytes(reinterpret_cast<const char*>(out), dtype_size(dtype));
      },
      py::arg("dtype"), py::arg("nranks"),
      "The bytes of 1/nranks in dtype as avg pre-multiplies floating inputs by it (NCCL's ncclAvg); None for "
      "integer dtypes, whose avg divides the sum.");
  py::class_<HostComm>(m, "HostComm")
      // handle=None creates the region (rank 0); otherwise (pid, fd, token0, token1) from the creator's `handle`.
      .def(py::init([](int rank, int nranks, double timeout_s,
                       std::optional<std::tuple<int64_t, int64_t, uint64_t, uint64_t>> handle) {
             host::HostOptions o;
             o.rank = rank;
             o.nranks = nranks;
             o.timeout_s = timeout_s;
             o.buffer_bytes = config_bytes("GPUCOLL_HOST_BUFFER_BYTES");
             o.segment_bytes = config_bytes("GPUCOLL_HOST_SEGMENT_BYTES");
             o.spin_us = config_int("GPUCOLL_HOST_SPIN_US");
             o.straggler_report = config_int("GPUCOLL_STRAGGLER_REPORT");
             o.trace_capacity = static_cast<int>(config_int("GPUCOLL_TRACE_BUFFER"));
             if (!handle) return new HostComm(o, nullptr);
             host::ShmHandle h;
             std::tie(h.pid, h.fd, h.token[0], h.token[1]) = *handle;
             return new HostComm(o, &h);
           }),
           py::arg("rank"), py::arg("nranks"), py::arg("timeout_s"), py::arg("handle") = py::none(),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("handle",
                             [](const HostComm& c) {
                               const host::ShmHandle h = c.handle();
                               return std::make_tuple(h.pid, h.fd, h.token[0], h.token[1]);
                             })
      .def("wait_attached", &HostComm::wait_attached, py::call_guard<py::gil_scoped_release>())
      .def(
          "run",
          [](HostComm& c, const std::string& algo_name, int coll, uintptr_t in, uintptr_t out, int64_t count,
             DType dtype, RedOp op, int root, int local_size, std::optional<double> premul, bool auto_algo) {
            const algo::Algorithm* a = algo::find_algorithm(algo_name);
            if (a == nullptr) GPUCOLL_INVALID_ARG("unknown algorithm '", algo_name, "'");
            if (dtype_is_fp8(dtype)) {
              GPUCOLL_THROW(ErrorCode::kUnsupported, "", "the host backend has no ", dtype_name(dtype),
                            " arithmetic: fp8 collectives need the nccl backend (NCCL >= 2.24, sm_90+)");
            }
            host::CollArgs args;
            args.coll = static_cast<algo::Coll>(coll);
            args.in = reinterpret_cast<const void*>(in);
            args.out = reinterpret_cast<void*>(out);
            args.count = count;
            args.dtype = dtype;
            args.op = op;
            args.premul = premul.has_value();
            args.premul_scalar = premul.value_or(1.0);
            args.root = root;
            args.local_size = local_size;
            args.auto_algo = auto_algo;
            c.run(args, *a);
          },
          py::arg("algo"), py::arg("coll"), py::arg("in_ptr"), py::arg("out_ptr"), py::arg("count"),
          py::arg("dtype"), py::arg("op"), py::arg("root") = 0, py::arg("local_size") = 0,
          py::arg("premul") = py::none(), py::arg("auto_algo") = false, py::call_guard<py::gil_scoped_release>())
      .def(
          "all_reduce_array",
          // Communicator.all_reduce(x) in place on a NumPy array with algo="auto": one crossing for what the Python
          // layers otherwise do in several (buffer, dtype, placement, algorithm, run), which cost 6x the run itself
          // at 8 B (bench/dispatch_overhead.py). Anything unusual (another format or byte order, read-only,
          // strided, empty) returns false before touching anything, and the Python path raises its typed error.
          [](HostComm& c, py::handle x, RedOp op, int local_size) {
            Py_buffer view;
            if (PyObject_GetBuffer(x.ptr(), &view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) {
              PyErr_Clear();
              return false;
            }
            // Released after the run, with the GIL held again (the guard below is destroyed first).
            struct Release {
              Py_buffer* v;
              ~Release() { PyBuffer_Release(v); }
            } release{&view};
            DType dtype;
            if (!native_dtype(view.format, view.itemsize, &dtype) || view.len <= 0) return false;
            host::CollArgs args;
            args.coll = algo::Coll::kAllReduce;
            args.in = view.buf;
            args.out = view.buf;
            args.count = static_cast<int64_t>(view.len / view.itemsize);
            args.dtype = dtype;
            args.op = op;
            args.local_size = local_size;
            args.auto_algo = true;
            const algo::Algorithm& a = c.auto_algorithm(algo::Coll::kAllReduce, view.len, local_size);
            py::gil_scoped_release nogil;
            c.run(args, a);
            return true;
          },
          py::arg("x"), py::arg("op"), py::arg("local_size"))
      .def("barrier", &HostComm::barrier, py::call_guard<py::gil_scoped_release>())
      .def(
          "p2p",
          [](HostComm& c, const std::vector<std::tuple<bool, int, uintptr_t, int64_t>>& batch) {
            std::vector<host::P2POp> ops;
            ops.reserve(batch.size());
            for (const auto& [send, peer, ptr, bytes] : batch) {
              host::P2POp op;
              op.send = send;
              op.peer = peer;
              op.buf = reinterpret_cast<void*>(ptr);
              op.bytes = bytes;
              ops.push_back(op);
            }
            py::gil_scoped_release release;
            c.p2p(ops);
          },
          py::arg("ops"))
      .def("close", &HostComm::close)
      // Benchmarks and tests only (gpucoll-bench --compare unchecked): every rank between the same two calls.
      .def("_set_call_check", &HostComm::set_call_check, py::arg("on"))
      .def(
          "stragglers",
          [](HostComm& c, bool reset) {
            py::dict out = straggler_dict(c.stragglers());
            if (reset) c.clear_stragglers();
            return out;
          },
          py::arg("reset") = false,
          "Each rank's lateness (against the first to arrive) at the last `window` collectives, and how often it "
          "arrived last; reset=True empties the window after reading it.")
      .def("trace", [](const HostComm& c, int last) { return trace_dict(c.trace(), last); }, py::arg("last") = 0,
           "The flight recorder's last `last` operations (0: every one it holds), oldest first.")
      .def(
          "peer_states",
          [](const HostComm& c) {
            py::list out;
            for (const HostComm::PeerState& p : c.peer_states()) {
              py::dict d;
              d["pid"] = p.pid;
              d["exited"] = p.exited;
              d["broken"] = p.broken;
              d["entered"] = p.entered;
              d["in_coll"] = p.in_coll;
              d["in_for_s"] = p.in_for_s;
              d["done"] = p.done;
              d["done_coll"] = p.done_coll;
              d["done_ago_s"] = p.done_ago_s;
              d["in_p2p"] = p.in_p2p;
              d["where"] = p.where;
              out.append(d);
            }
            return out;
          },
          "Where every rank is, as it published in the shared region: the collective it entered last and the last "
          "it completed (numbers, algo.Coll ids, -1 for a barrier), whether its process is gone.")
      .def_property_readonly("call_check", &HostComm::call_check)
      .def_property_readonly("rank", &HostComm::rank)
      .def_property_readonly("nranks", &HostComm::nranks)
      .def_property_readonly("op_seq", &HostComm::op_seq)
      .def_property_readonly("closed", &HostComm::closed)
      .def_property_readonly("broken", &HostComm::broken);
}

}  // namespace gpucoll::python
