// The pybind11 side of gpucoll._C. This directory is the only place that includes pybind11; each file
// binds one part of the core and module.cc calls them in order.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/completion.h"
#include "core/flight_recorder.h"
#include "core/stragglers.h"
#include "core/types.h"

namespace gpucoll::python {

// The deleter of bound objects whose destructor waits for the device or for peers (cudaFree waits for every
// stream; a communicator's teardown for its kernels). pybind11 runs destructors with the GIL held, so a DeviceArray
// dropped while a collective is in flight would hold it for the whole wait, and any Python thread that collective
// needs stalls with it: rank 0's rendezvous store and the NCCL watchdog are such threads, so peers waiting on the
// store never launch their half and nothing times out. At interpreter exit the GIL stays held (threads may no
// longer take it).
inline bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

template <class T>
struct DeleteWithoutGil {
  void operator()(T* p) const noexcept {
    if (PyGILState_Check() && !interpreter_finalizing()) {
      pybind11::gil_scoped_release release;
      delete p;
    } else {
      delete p;
    }
  }
};
template <class T>
using NoGilHolder = std::unique_ptr<T, DeleteWithoutGil<T>>;

// The host memory of a NumPy array or a CPU torch.Tensor in its plain case (host_array.cc): writable,
// C-contiguous, non-empty, of a dtype the host backend reduces. read() is true and fills data, count and dtype
// for one; false for anything else, before anything is touched (the Python path then decides and names the
// problem). Made, read and destroyed with the GIL held: a NumPy array is read from its object's fields
// (host_array.cc), else its buffer is held until destruction.
class HostArrayView {
 public:
  HostArrayView() = default;
  HostArrayView(const HostArrayView&) = delete;
  HostArrayView& operator=(const HostArrayView&) = delete;
  ~HostArrayView() { release(); }
  bool read(pybind11::handle x);

  void* data = nullptr;
  int64_t count = 0;
  DType dtype = DType::kF32;

 private:
  void release();
  Py_buffer view_{};
  bool held_ = false;
};

// The plain case of a __cuda_array_interface__ array (cuda_array.cc): where it is one, its pointer, element count,
// dtype and the stream it is ordered on, and true; false for anything else (the Python path then decides).
struct CudaArrayView {
  uintptr_t ptr = 0;
  size_t count = 0;
  DType dtype = DType::kF32;
  uintptr_t stream = 0;
};
bool cuda_array_view(pybind11::handle x, CudaArrayView* out);

// work.cc: whether threads of gpucoll's may still take the GIL (false once the interpreter exits).
bool python_exiting();
// gpucoll._C.Work (work.cc): what every async_op=True call returns, whichever backend ran it, and what a call that
// finished before it returned hands back. Its end is one of three:
//  * none: the call had finished (the synchronous case, or a host call that ran inline);
//  * a Completion (an operation on another thread: the host backend's progress thread). `keep` (its buffers' Python
//    objects) is held until the operation ended. At the end the completing thread takes the GIL once: it drops
//    `keep` and runs the Python callbacks registered so far (each GIL hand-over can wait a switch interval for a
//    busy thread, so there is one per operation, not one per callback);
//  * a DeviceDone (a GPU operation). wait() makes the caller's current stream wait for it: that stream is found by
//    gpucoll._cuda_buffers.current_stream(kind, device) (torch's for tensors, CuPy's for arrays, else the legacy
//    default stream), as the Python path finds it for every call.
// A GPU communicator's failure (the NCCL watchdog's CollectiveTimeout, NcclError, RemoteError; the custom kernels'
// timeout) is recorded by its backend in Python, with the hang report that goes with it, so the Work holds two
// hooks into it rather than a copy: `raise_failed` (raises the recorded failure; called before wait() and
// is_completed() and after synchronize()) and `after_sync` (called once synchronize() saw the GPU finish: the
// custom backend reads its kernels' timeout flag there).
class Work {
 public:
  explicit Work(pybind11::object result);                                 // completed
  Work(std::shared_ptr<Completion> done, pybind11::object keep);          // host thread
  Work(std::unique_ptr<DeviceDone> device, pybind11::object native, std::string kind, int ordinal,
       pybind11::object raise_failed, pybind11::object after_sync);      // GPU
  bool wait();  // host: blocks (GIL released), rethrows the operation's error; GPU: orders the current stream
  bool is_completed();
  void synchronize();
  bool done() const;  // whether it ended, successfully or not (never raises)
  void add_done_callback(pybind11::function fn);  // with the GIL held
  pybind11::object seq() const;
  std::string repr() const;
  pybind11::object native() const { return native_; }
  int ordinal() const { return device_ ? ordinal_ : -1; }
  pybind11::object result = pybind11::none();

 private:
  // Shared with the completion's callback; its Python objects are touched with the GIL held only.
  struct End {
    bool fired = false;
    pybind11::object keep;
    std::vector<pybind11::object> callbacks;
    ~End();
  };
  void check_failed() const;
  std::shared_ptr<Completion> done_;  // host thread
  std::shared_ptr<End> end_;
  std::unique_ptr<DeviceDone> device_;  // GPU
  pybind11::object native_;             // the object the device end was made from (None: none)
  std::string kind_;
  int ordinal_ = -1;
  pybind11::object raise_failed_;
  pybind11::object after_sync_;
};
// nccl.cc: the device end of an NcclWork (gpucoll._C.NcclWork), or nullptr for any other object (and everywhere in
// a build without CUDA).
std::unique_ptr<DeviceDone> nccl_device_done(pybind11::handle native);
// custom.cc: a CUDA event recorded on `stream` now, as a device end. Unsupported in a build without CUDA.
std::unique_ptr<DeviceDone> event_device_done(uintptr_t stream, int ordinal, std::string what);
// host.cc: every live host communicator's progress thread gets `seconds` to finish its queue (interpreter exit).
void stop_host_progress(double seconds);

// errors.cc: translates gpucoll::Error into gpucoll.errors classes (once, for every binding).
void bind_errors(pybind11::module_& m);
// core.cc: dtypes, ops, config registry, logging.
void bind_core(pybind11::module_& m);
// host.cc: the shared-memory host communicator.
void bind_host(pybind11::module_& m);
// host_coalesced.cc: tensor fusion on the host backend (HostCoalescer).
void bind_host_coalesced(pybind11::module_& m);
// algo.cc: schedules, registry, checker, cost model.
void bind_algo(pybind11::module_& m);
// runtime.cc: build info, CUDA runtime/driver probe, NCCL loader state, CUDA primitives.
void bind_runtime(pybind11::module_& m);
// nccl.cc: the NCCL communicator (CUDA builds; elsewhere it raises Unsupported) and NCCL feature gates.
void bind_nccl(pybind11::module_& m);
// topo.cc: the Topology value, its importers and detection, the topology-aware cost model.
void bind_topo(pybind11::module_& m);
// device_memory.cc: device memory gpucoll owns (gpucoll.testing.DeviceArray): copies, DLPack export.
void bind_device_memory(pybind11::module_& m);
// work.cc: gpucoll._C.Work, host_at_exit.
void bind_work(pybind11::module_& m);
// custom.cc: gpucoll's own allreduce kernels (host-side decisions everywhere; the communicator in CUDA builds).
void bind_custom(pybind11::module_& m);

// trace.cc: a flight recorder's last `last` entries (0: all) with both clocks, as a dict that is JSON as it stands.
pybind11::dict trace_dict(const FlightRecorder& rec, int last);
// ... entries a backend has already taken and completed (the custom kernels merge their device records in).
pybind11::dict trace_dict(const std::vector<TraceEntry>& entries, int capacity, uint64_t recorded);
// trace.cc: a straggler window's statistics (gpucoll/stragglers.py reads them), and the window itself for backends
// that gather arrival times in Python (the NCCL backend's sampled enqueue times).
pybind11::dict straggler_dict(const StragglerWindow& w);
pybind11::dict straggler_dict(const StragglerWindow::Snapshot& snap, int window);
void bind_trace(pybind11::module_& m);

}  // namespace gpucoll::python
