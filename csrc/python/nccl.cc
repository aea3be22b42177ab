// The NCCL backend's bindings: feature gates (every build), and in CUDA builds the communicator, its Work
// objects and a pointer query. A build without CUDA binds NcclComm as a function that raises Unsupported
// saying how to get a CUDA build, so every caller meets the same clear error.
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "backends/nccl/nccl_features.h"
#include "backends/nccl/nccl_loader.h"
#include "core/error.h"
#include "python/bindings.h"

#ifdef GPUCOLL_WITH_CUDA
#include "device/cuda/cuda_util.h"
#include "backends/nccl/cuda/nccl_comm.h"
#endif

namespace py = pybind11;

namespace gpucoll::python {
namespace {

constexpr const char* kNoCudaBuild =
    "gpucoll was built without CUDA (nvcc was not found at build time), so it has no NCCL backend. Install the "
    "CUDA toolkit and rebuild: GPUCOLL_CUDA=on pip install --no-build-isolation -e . (or set CUDACXX to nvcc)";

#ifdef GPUCOLL_WITH_CUDA
cudaStream_t as_stream(uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

const char* state_name(const nccl::Work& w) {
  switch (w.state()) {
    case nccl::Work::State::kInGroup:
      return "in_group";
    case nccl::Work::State::kLaunched:
      return "launched";
    case nccl::Work::State::kCaptured:
      return "captured";
  }
  return "?";
}

// gpucoll._C.Work's end for an NCCL operation: its event (nccl_comm.h says when it is recorded, and why a
// captured operation has none and one in an open group cannot be waited for yet).
class NcclDone final : public DeviceDone {
 public:
  explicit NcclDone(std::shared_ptr<nccl::Work> w) : w_(std::move(w)) {}
  bool query() override { return w_->query(); }
  void wait_on(uintptr_t stream) override { w_->wait_on(as_stream(stream)); }
  void synchronize() override { w_->synchronize(); }
  bool has_seq() const override { return true; }
  uint64_t seq() const override { return w_->seq(); }
  std::string describe() override { return nccl::describe(w_->desc(), w_->seq()) + " " + state_name(*w_); }

 private:
  std::shared_ptr<nccl::Work> w_;
};

void bind_comm(py::module_& m) {
  using nccl::NcclComm;
  using nccl::Work;
  py::class_<Work, std::shared_ptr<Work>>(m, "NcclWork")
      .def_property_readonly("seq", &Work::seq)
      .def_property_readonly("what", [](const Work& w) { return nccl::describe(w.desc(), w.seq()); })
      .def_property_readonly("state", &state_name)
      .def("query", &Work::query, py::call_guard<py::gil_scoped_release>())
      .def(
          "wait_on", [](Work& w, uintptr_t stream) { w.wait_on(as_stream(stream)); }, py::arg("stream"),
          py::call_guard<py::gil_scoped_release>())
      .def("synchronize", &Work::synchronize, py::call_guard<py::gil_scoped_release>());

  py::class_<NcclComm, NoGilHolder<NcclComm>>(m, "NcclComm")
      .def(py::init([](const py::bytes& uid, int nranks, int rank, int device, double timeout_s) {
             const std::string raw = uid;
             GPUCOLL_CHECK_ARG(raw.size() == sizeof(ncclUniqueId), "the NCCL unique id must be ",
                               sizeof(ncclUniqueId), " bytes; got ", raw.size());
             ncclUniqueId id;
             std::memcpy(id.internal, raw.data(), sizeof(id.internal));
             py::gil_scoped_release release;  // init polls for up to timeout_s
             return new NcclComm(id, nranks, rank, device, timeout_s);
           }),
           py::arg("unique_id"), py::arg("nranks"), py::arg("rank"), py::arg("device"), py::arg("timeout_s"))
      .def(
          "collective",
          [](NcclComm& c, int coll, uintptr_t in, uintptr_t out, int64_t count, DType dtype, RedOp op, int root,
             uintptr_t stream, bool async_op, std::optional<double> premul) {
            GPUCOLL_CHECK_ARG(count >= 0, "count must be >= 0; got ", count);
            nccl::CollArgs a;
            a.coll = static_cast<algo::Coll>(coll);
            a.in = reinterpret_cast<const void*>(in);
            a.out = reinterpret_cast<void*>(out);
            a.count = static_cast<size_t>(count);
            a.dtype = dtype;
            a.op = op;
            a.root = root;
            a.premul = premul.has_value();
            a.premul_scalar = premul.value_or(1.0);
            py::gil_scoped_release release;
            return c.collective(a, as_stream(stream), async_op);
          },
          py::arg("coll"), py::arg("in_ptr"), py::arg("out_ptr"), py::arg("count"), py::arg("dtype"), py::arg("op"),
          py::arg("root"), py::arg("stream"), py::arg("async_op"), py::arg("premul") = py::none(),
          "Enqueue one collective on `stream` (a raw cudaStream_t); returns an NcclWork for async_op, else None.")
      .def(
          "all_reduce_array",
          // Communicator.all_reduce(x) in place of a plain __cuda_array_interface__ array (cuda_array.cc), sync,
          // on x's own stream: the buffer, its placement on this communicator's GPU and the enqueue in one crossing.
          // False, before anything is enqueued, for anything else (the Python path runs it and raises its errors).
          [](NcclComm& c, py::handle x, RedOp op) {
            CudaArrayView v;
            if (!cuda_array_view(x, &v)) return false;
            nccl::CollArgs a;
            a.coll = algo::Coll::kAllReduce;
            a.in = reinterpret_cast<const void*>(v.ptr);
            a.out = reinterpret_cast<void*>(v.ptr);
            a.count = v.count;
            a.dtype = v.dtype;
            a.op = op;
            py::gil_scoped_release release;
            const cuda::PointerInfo where = cuda::pointer_info(a.in);
            if (!where.device_memory || where.device != c.device()) return false;
            c.collective(a, as_stream(v.stream), false);
            return true;
          },
          py::arg("x"), py::arg("op"))
      .def(
          "p2p",
          [](NcclComm& c, const std::vector<std::tuple<bool, int, uintptr_t, int64_t>>& batch, uintptr_t stream,
             bool async_op) {
            std::vector<nccl::P2PArgs> ops;
            ops.reserve(batch.size());
            for (const auto& [send, peer, ptr, bytes] : batch) {
              GPUCOLL_CHECK_ARG(bytes >= 0, "a send/recv size must be >= 0; got ", bytes);
              ops.push_back(nccl::P2PArgs{send, peer, reinterpret_cast<void*>(ptr), static_cast<size_t>(bytes)});
            }
            py::gil_scoped_release release;
            return c.p2p(ops, as_stream(stream), async_op);
          },
          py::arg("ops"), py::arg("stream"), py::arg("async_op") = false)
      .def("trace", [](const NcclComm& c, int last) { return trace_dict(c.trace(), last); }, py::arg("last") = 0,
           "The flight recorder's last `last` operations (0: every one it holds), oldest first.")
      .def("group_start", &NcclComm::group_start, py::call_guard<py::gil_scoped_release>())
      .def("group_end", &NcclComm::group_end, py::call_guard<py::gil_scoped_release>())
      .def("poll",
           [](NcclComm& c) {
             nccl::PollResult r;
             {
               py::gil_scoped_release release;
               r = c.poll();
             }
             py::dict d;
             d["completed"] = r.completed;
             d["pending"] = r.pending;
             d["oldest_seq"] = r.oldest_seq;
             d["oldest_what"] = r.oldest_what;
             d["oldest_age_s"] = r.oldest_age_s;
             d["issued"] = r.issued;
             d["async_error"] = r.async_error == ncclSuccess ? std::string() : nccl_result_name(r.async_error);
             d["async_text"] = r.async_text;
             d["usable"] = r.usable;
             return d;
           })
      .def("abort", &NcclComm::abort, py::arg("why"), py::call_guard<py::gil_scoped_release>())
      .def("close", &NcclComm::close, py::call_guard<py::gil_scoped_release>())
      .def("split_blocking", &NcclComm::split_blocking, py::call_guard<py::gil_scoped_release>())
      .def("split", &NcclComm::split, py::arg("color"), py::arg("key"), py::call_guard<py::gil_scoped_release>(),
           "Collective over every rank (ncclCommSplit): the NcclComm of the ranks with the same color (>= 0), "
           "ordered by key; None for color -1.")
      .def("shrink", &NcclComm::shrink, py::arg("exclude"), py::call_guard<py::gil_scoped_release>(),
           "Collective over the ranks not in exclude (ncclCommShrink, NCCL >= 2.27): their NcclComm.")
      .def_property_readonly("blocking", &NcclComm::blocking)
      .def("reason", &NcclComm::reason, py::call_guard<py::gil_scoped_release>())
      .def("scratch", &NcclComm::scratch, py::call_guard<py::gil_scoped_release>())
      .def("native", [](const NcclComm& c, int coll) { return c.native(static_cast<algo::Coll>(coll)); })
      .def("_set_prefer_native", &NcclComm::set_prefer_native, py::arg("prefer"))
      .def_property_readonly("rank", &NcclComm::rank)
      .def_property_readonly("nranks", &NcclComm::nranks)
      .def_property_readonly("device", &NcclComm::device)
      .def_property_readonly("nccl_version", &NcclComm::nccl_version)
      .def_property_readonly("issued", &NcclComm::issued)
      .def_property_readonly("usable", &NcclComm::usable)
      .def_property_readonly("group_depth", &NcclComm::group_depth)
      .def_property_readonly("internal_stream", &NcclComm::internal_stream);

  m.def(
      "cuda_stream_wait",
      [](uintptr_t consumer, uintptr_t producer, int device) {
        cuda::stream_wait_stream(as_stream(consumer), as_stream(producer), device);
      },
      py::arg("consumer"), py::arg("producer"), py::arg("device"), py::call_guard<py::gil_scoped_release>(),
      "Make stream `consumer` wait for the work queued on `producer` (no-op when equal or either is capturing).");
  m.def(
      "cuda_pointer_info",
      [](uintptr_t ptr) {
        cuda::PointerInfo info;
        {
          py::gil_scoped_release release;
          info = cuda::pointer_info(reinterpret_cast<const void*>(ptr));
        }
        py::dict d;
        d["device_memory"] = info.device_memory;
        d["device"] = info.device;
        d["kind"] = info.kind;
        return d;
      },
      py::arg("ptr"), "What a pointer refers to (cudaPointerGetAttributes): device_memory, device, kind.");
}
#else
void bind_comm(py::module_& m) {
  auto unsupported = [](const py::args&, const py::kwargs&) -> py::object {
    GPUCOLL_THROW(ErrorCode::kUnsupported, "", kNoCudaBuild);
  };
  m.def("NcclComm", unsupported, kNoCudaBuild);
  m.def("cuda_stream_wait", unsupported, kNoCudaBuild);
  m.def("cuda_pointer_info", unsupported, kNoCudaBuild);
}
#endif

}  // namespace

std::unique_ptr<DeviceDone> nccl_device_done(py::handle native) {
#ifdef GPUCOLL_WITH_CUDA
  if (py::isinstance<nccl::Work>(native)) return std::make_unique<NcclDone>(native.cast<std::shared_ptr<nccl::Work>>());
#else
  (void)native;
#endif
  return nullptr;
}

void bind_nccl(py::module_& m) {
#ifdef GPUCOLL_WITH_CUDA
  m.attr("NCCL_BACKEND_BUILT") = true;
#else
  m.attr("NCCL_BACKEND_BUILT") = false;
#endif
  m.attr("NCCL_BACKEND_UNBUILT_REASON") = kNoCudaBuild;
  m.attr("NCCL_FP8_VERSION") = kNcclFp8Version;
  m.attr("NCCL_NATIVE_ALLTOALL_VERSION") = kNcclNativeAllToAllVersion;
  m.attr("NCCL_MULTI_RANK_GPU_VERSION") = kNcclMultiRankGpuVersion;
  m.def("nccl_dtype_min_version", &nccl_dtype_min_version, py::arg("dtype"),
        "The oldest NCCL version code that handles dtype (0: all).");
  m.def("nccl_check_dtype", &nccl_check_dtype, py::arg("dtype"), py::arg("version"),
        "Raise Unsupported when an NCCL of `version` (an ncclGetVersion code) cannot handle dtype.");
  m.def("nccl_multi_rank_gpu_supported", &nccl_multi_rank_gpu_supported, py::arg("version"));
  m.def(
      "premul_scalar_bytes",
      [](DType t, double scalar) {
        unsigned char buf[8];
        const size_t n = premul_scalar_bytes(t, scalar, buf);
        return py::bytes(reinterpret_cast<const char*>(buf), n);
      },
      py::arg("dtype"), py::arg("scalar"), "The bytes ncclRedOpCreatePreMulSum reads for scalar in dtype.");
  m.def("nccl_unique_id", []() {
    // Works without a GPU: rank 0 makes the id that every rank's NcclComm is created from.
    const NcclLibrary& lib = nccl_require();
    ncclUniqueId id;
    GPUCOLL_NCCL_CALL(lib, ncclGetUniqueId, &id);
    return py::bytes(id.internal, sizeof(id.internal));
  });
  bind_comm(m);
}

}  // namespace gpucoll::python
