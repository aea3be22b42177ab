// The pybind11 side of gpucoll._C. This directory is the only place that includes pybind11; each file
// binds one part of the core and module.cc calls them in order.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
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
// problem). Made, read and destroyed with the GIL held: a NumPy array's buffer is released at destruction.
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
// gpucoll._C.Work (work.cc): an operation running on another thread, over its Completion. `keep` (its buffers'
// Python objects) is held until the operation ended. At the end the completing thread takes the GIL once: it drops
// `keep` and runs the Python callbacks registered so far (each GIL hand-over can wait a switch interval for a busy
// thread, so there is one per operation, not one per callback).
class NativeWork {
 public:
  NativeWork(std::shared_ptr<Completion> done, pybind11::object keep);
  void wait() const;  // releases the GIL; rethrows the operation's error
  bool is_completed() const;
  bool done() const { return done_->done(); }
  void add_done_callback(pybind11::function fn);  // with the GIL held
  pybind11::object result = pybind11::none();

 private:
  // Shared with the completion's callback; its Python objects are touched with the GIL held only.
  struct End {
    bool fired = false;
    pybind11::object keep;
    std::vector<pybind11::object> callbacks;
    ~End();
  };
  std::shared_ptr<Completion> done_;
  std::shared_ptr<End> end_;
};
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
