#include <pybind11/stl.h>

#include <mutex>
#include <optional>
#include <set>
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

// all_reduce of `x` in place with the cost model's algorithm, if it is a plain host array (HostArrayView);
// false, with nothing run, for anything else.
bool all_reduce_now(host::HostComm& c, py::handle x, RedOp op, int local_size) {
  HostArrayView view;  // destroyed after `nogil` below, with the GIL held again
  if (!view.read(x)) return false;
  host::CollArgs args;
  args.coll = algo::Coll::kAllReduce;
  args.in = view.data;
  args.out = view.data;
  args.count = view.count;
  args.dtype = view.dtype;
  args.op = op;
  args.local_size = local_size;
  args.auto_algo = true;
  const int64_t nbytes = view.count * static_cast<int64_t>(dtype_size(view.dtype));
  py::gil_scoped_release nogil;  // before anything of `c`'s: it first waits for its queued operations
  c.run(args, c.auto_algorithm(algo::Coll::kAllReduce, nbytes, local_size));
  return true;
}

// all_reduce's compress= by name; "" is none.
Wire parse_wire(const std::string& name) {
  const Wire w = wire_from_name(name.c_str());
  if (w != Wire::kNone || name.empty()) return w;
  GPUCOLL_INVALID_ARG("compress must be 'int8', 'fp8', 'bf16' or None; got '", name, "'");
}

// The arguments of HostComm::run from the binding's, checked: the algorithm by name, no fp8, the wire format. A
// compressed call runs its own two-shot schedule; `algo_name` is ignored then.
std::pair<host::CollArgs, const algo::Algorithm*> run_args(const std::string& algo_name, int coll, uintptr_t in,
                                                           uintptr_t out, int64_t count, DType dtype, RedOp op,
                                                           int root, int local_size, std::optional<double> premul,
                                                           bool auto_algo, const std::string& compress) {
  const Wire wire = parse_wire(compress);
  static const algo::Algorithm* const two_shot = algo::find_algorithm("twoshot");
  const algo::Algorithm* a = wire != Wire::kNone ? two_shot : algo::find_algorithm(algo_name);
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
  args.wire = wire;
  return {args, a};
}

// Live host communicators, for host_at_exit (work.cc): their progress threads must be done with Python before
// the interpreter is. The holder removes one as it deletes it (without the GIL: close() waits for the queue).
std::mutex g_live_mu;
std::set<host::HostComm*> g_live;

struct HostCommDeleter {
  void operator()(host::HostComm* c) const noexcept {
    {
      std::lock_guard<std::mutex> lock(g_live_mu);
      g_live.erase(c);
    }
    DeleteWithoutGil<host::HostComm>()(c);
  }
};
}  // namespace

void stop_host_progress(double seconds) {
  std::lock_guard<std::mutex> lock(g_live_mu);
  for (host::HostComm* c : g_live) c->stop_progress_for(seconds);
}

namespace {

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
  m.def(
      "wire_roundtrip",
      [](uintptr_t in, uintptr_t out, int64_t count, DType dtype, const std::string& compress) {
        const Wire w = parse_wire(compress);
        if (w == Wire::kNone) GPUCOLL_INVALID_ARG("compress must be 'int8', 'fp8' or 'bf16'; got '", compress, "'");
        host::wire_roundtrip(w, dtype, reinterpret_cast<const void*>(in), reinterpret_cast<void*>(out), count);
      },
      py::arg("in_ptr"), py::arg("out_ptr"), py::arg("count"), py::arg("dtype"), py::arg("compress"),
      py::call_guard<py::gil_scoped_release>(),
      "out = in after one trip through the wire format (host memory, block by block): what a rank's "
      "all_reduce(compress=...) sends of `in`.");
  py::class_<HostComm, std::unique_ptr<HostComm, HostCommDeleter>>(m, "HostComm")
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
             HostComm* c = nullptr;
             if (!handle) {
               c = new HostComm(o, nullptr);
             } else {
               host::ShmHandle h;
               std::tie(h.pid, h.fd, h.token[0], h.token[1]) = *handle;
               c = new HostComm(o, &h);
             }
             std::lock_guard<std::mutex> lock(g_live_mu);
             g_live.insert(c);
             return c;
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
             DType dtype, RedOp op, int root, int local_size, std::optional<double> premul, bool auto_algo,
             const std::string& compress) {
            const auto [args, a] =
                run_args(algo_name, coll, in, out, count, dtype, op, root, local_size, premul, auto_algo, compress);
            c.run(args, *a);
          },
          py::arg("algo"), py::arg("coll"), py::arg("in_ptr"), py::arg("out_ptr"), py::arg("count"),
          py::arg("dtype"), py::arg("op"), py::arg("root") = 0, py::arg("local_size") = 0,
          py::arg("premul") = py::none(), py::arg("auto_algo") = false, py::arg("compress") = "",
          py::call_guard<py::gil_scoped_release>())
      .def(
          "run_async",
          // run() on the communicator's progress thread, after every operation called before it; returns a Work at
          // once. `keep` (the buffers' Python objects) stays alive until the operation ended, whoever drops the
          // Work: its memory is written meanwhile.
          [](HostComm& c, py::object keep, const std::string& algo_name, int coll, uintptr_t in, uintptr_t out,
             int64_t count, DType dtype, RedOp op, int root, int local_size, std::optional<double> premul,
             bool auto_algo, const std::string& compress) {
            const auto [args, a] =
                run_args(algo_name, coll, in, out, count, dtype, op, root, local_size, premul, auto_algo, compress);
            std::shared_ptr<Completion> done;
            {
              py::gil_scoped_release nogil;
              // `c` outlives the task: close(), which its deletion calls, runs the queue out first.
              done = c.submit([&c, args = args, a = a]() { c.run(args, *a); });
            }
            // `keep` is this call's argument until the Work holds it: alive from before the task starts.
            return std::make_shared<Work>(std::move(done), std::move(keep));
          },
          py::arg("keep"), py::arg("algo"), py::arg("coll"), py::arg("in_ptr"), py::arg("out_ptr"), py::arg("count"),
          py::arg("dtype"), py::arg("op"), py::arg("root") = 0, py::arg("local_size") = 0,
          py::arg("premul") = py::none(), py::arg("auto_algo") = false, py::arg("compress") = "")
      .def(
          "all_reduce_array",
          // Communicator.all_reduce(x) in place on a NumPy array or a CPU torch.Tensor with algo="auto": one
          // crossing for what the Python layers otherwise do in several (buffer, dtype, placement, algorithm, run),
          // which cost 6x the run itself at 8 B (bench/dispatch_overhead.py). Anything unusual (another type,
          // format or byte order, read-only, strided, empty) returns false before touching anything, and the
          // Python path raises its typed error.
          [](HostComm& c, py::handle x, RedOp op, int local_size) { return all_reduce_now(c, x, op, local_size); },
          py::arg("x"), py::arg("op"), py::arg("local_size"))
      .def(
          "all_reduce_torch",
          // gpucoll.torch's ProcessGroup.allreduce(tensors, opts) as dist.all_reduce(t) calls it, read here as it
          // comes: one tensor, waited for at once (opts.asyncOp false: torch >= 2.7). `ops` maps hash(opts.reduceOp),
          // which torch makes its RedOpType's value, to gpucoll's op (gpucoll/torch/_reduce.py checks that premise
          // and leaves out PREMUL_SUM). Reading torch's arguments in Python cost as much as the run at 8 B. Any other
          // call, op or tensor returns false having run nothing; the process group's general path then runs it.
          [](HostComm& c, const py::dict& ops, int local_size, py::handle tensors, py::handle opts) {
            PyObject* list = tensors.ptr();
            PyObject* x = nullptr;
            if (PyList_Check(list) && PyList_GET_SIZE(list) == 1) x = PyList_GET_ITEM(list, 0);
            else if (PyTuple_Check(list) && PyTuple_GET_SIZE(list) == 1) x = PyTuple_GET_ITEM(list, 0);
            if (x == nullptr) return false;
            static PyObject* const kAsyncOp = PyUnicode_InternFromString("asyncOp");  // made once: kept
            static PyObject* const kReduceOp = PyUnicode_InternFromString("reduceOp");
            const py::object async_op = py::reinterpret_steal<py::object>(PyObject_GetAttr(opts.ptr(), kAsyncOp));
            const py::object op = py::reinterpret_steal<py::object>(PyObject_GetAttr(opts.ptr(), kReduceOp));
            if (async_op.ptr() != Py_False || !op) {
              PyErr_Clear();
              return false;
            }
            const Py_hash_t h = PyObject_Hash(op.ptr());
            if (h == -1) {
              PyErr_Clear();
              return false;
            }
            const py::object key = py::reinterpret_steal<py::object>(PyLong_FromSsize_t(h));
            PyObject* gop = key ? PyDict_GetItemWithError(ops.ptr(), key.ptr()) : nullptr;  // borrowed
            if (gop == nullptr) {
              PyErr_Clear();
              return false;
            }
            return all_reduce_now(c, x, py::cast<RedOp>(gop), local_size);
          },
          py::arg("ops"), py::arg("local_size"), py::arg("tensors"), py::arg("opts"))
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
      .def("abort", &HostComm::abort, py::arg("reason"), py::call_guard<py::gil_scoped_release>())
      .def("abandon", &HostComm::abandon, py::call_guard<py::gil_scoped_release>())
      .def("close", &HostComm::close, py::call_guard<py::gil_scoped_release>())
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
