// gpucoll._C.Work: the one type every async_op=True call returns (host, nccl, custom) and what a call that finished
// before it returned hands back (bindings.h says how its end is composed). gpucoll.torch's Work and DDP's futures
// are made from it.
//
// The GIL. A waiter releases it. Callbacks registered from Python run on the thread that completed the operation
// with the GIL taken; so do the releases of the Python objects an operation keeps alive (its buffers). At
// interpreter exit no thread may take the GIL any more, so after host_at_exit() (gpucoll/backends/host.py
// registers it with atexit) they are skipped: the objects are leaked, the callbacks not run.
#include <pybind11/pybind11.h>

#include <atomic>
#include <utility>

#include "core/error.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace gpucoll::python {

namespace {
std::atomic<bool> g_exiting{false};  // set by host_at_exit

// The device end of an object that has query(), wait_on(stream) and synchronize() in Python (a backend's native
// operation bound some other way than NcclWork, and the tests' stand-ins for the native communicator). Its methods
// are called without the GIL, so each takes it.
class PyDeviceDone final : public DeviceDone {
 public:
  explicit PyDeviceDone(py::object native) : native_(std::move(native)) {}
  ~PyDeviceDone() override {
    if (python_exiting()) {
      native_.release();
      return;
    }
    py::gil_scoped_acquire gil;
    native_ = py::object();
  }
  bool query() override {
    py::gil_scoped_acquire gil;
    return native_.attr("query")().cast<bool>();
  }
  void wait_on(uintptr_t stream) override {
    py::gil_scoped_acquire gil;
    native_.attr("wait_on")(stream);
  }
  void synchronize() override {
    py::gil_scoped_acquire gil;
    native_.attr("synchronize")();
  }
  bool has_seq() const override {
    py::gil_scoped_acquire gil;
    return py::hasattr(native_, "seq");
  }
  uint64_t seq() const override {
    py::gil_scoped_acquire gil;
    return native_.attr("seq").cast<uint64_t>();
  }
  std::string describe() override {
    py::gil_scoped_acquire gil;
    return py::str(native_.attr("what")).cast<std::string>() + " " + py::str(native_.attr("state")).cast<std::string>();
  }

 private:
  py::object native_;
};
}  // namespace

bool python_exiting() { return interpreter_finalizing() || g_exiting.load(std::memory_order_acquire); }

Work::End::~End() {
  if (python_exiting()) {  // the interpreter is going: leaked
    keep.release();
    for (auto& fn : callbacks) fn.release();
    return;
  }
  py::gil_scoped_acquire gil;
  keep = py::object();
  callbacks.clear();
}

Work::Work(py::object result) : result(std::move(result)) {}

Work::Work(std::shared_ptr<Completion> done, py::object keep) : done_(std::move(done)), end_(std::make_shared<End>()) {
  end_->keep = std::move(keep);
  auto end = end_;  // held by the callback until it ran: `keep` lives that long whoever drops the Work
  done_->on_done([end]() mutable {
    if (python_exiting()) return;  // End's destructor leaks what it holds
    py::gil_scoped_acquire gil;
    end->fired = true;
    end->keep = py::object();
    std::vector<py::object> run;
    run.swap(end->callbacks);
    for (const py::object& fn : run) {
      try {
        fn();
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("gpucoll Work callback");
      }
    }
    run.clear();
    end.reset();  // with the GIL still held: the last reference may be this one
  });
}

Work::Work(std::unique_ptr<DeviceDone> device, py::object native, std::string kind, int ordinal,
           py::object raise_failed, py::object after_sync)
    : device_(std::move(device)),
      native_(std::move(native)),
      kind_(std::move(kind)),
      ordinal_(ordinal),
      raise_failed_(std::move(raise_failed)),
      after_sync_(std::move(after_sync)) {}

void Work::check_failed() const {
  if (!raise_failed_.is_none()) raise_failed_();
}

bool Work::wait() {
  if (device_) {
    check_failed();
    // The caller's current stream, found as every call's stream is found (torch's, CuPy's or the legacy one).
    const auto stream =
        py::module_::import("gpucoll._cuda_buffers").attr("current_stream")(kind_, ordinal_).cast<uintptr_t>();
    py::gil_scoped_release nogil;
    device_->wait_on(stream);
    return true;
  }
  if (!done_) return true;
  if (!done_->done()) {
    py::gil_scoped_release nogil;
    done_->wait();
    return true;
  }
  // Ended: the common case inside a completion callback, where handing the GIL over and back would cost the
  // completing thread a switch interval while the caller's thread runs Python.
  if (done_->error()) std::rethrow_exception(done_->error());
  return true;
}

bool Work::is_completed() {
  if (device_) {
    check_failed();
    py::gil_scoped_release nogil;
    return device_->query();
  }
  if (!done_) return true;
  if (!done_->done()) return false;
  if (done_->error()) std::rethrow_exception(done_->error());
  return true;
}

void Work::synchronize() {
  if (device_) {
    {
      py::gil_scoped_release nogil;
      device_->synchronize();
    }
    check_failed();
    if (!after_sync_.is_none()) after_sync_();
    return;
  }
  wait();  // host memory: done once the operation ended
}

bool Work::done() const {
  if (device_) {
    // A query that fails: the operation ended, unsuccessfully (is_completed() and synchronize() raise why).
    try {
      py::gil_scoped_release nogil;
      return device_->query();
    } catch (const Error&) {
      return true;
    } catch (py::error_already_set&) {
      return true;
    }
  }
  return !done_ || done_->done();
}

void Work::add_done_callback(py::function fn) {
  if (device_) {
    GPUCOLL_THROW(ErrorCode::kUnsupported, "", "add_done_callback() is for operations that run on the host; a GPU "
                  "operation's end is on a stream: wait() orders the current stream after it");
  }
  if (!done_ || end_->fired) {  // under the GIL, as `fired` is set: the callbacks ran, or the interpreter exits
    if (!python_exiting()) fn();
    return;
  }
  end_->callbacks.push_back(std::move(fn));
}

py::object Work::seq() const {
  if (device_ && device_->has_seq()) return py::int_(device_->seq());
  return py::none();
}

std::string Work::repr() const {
  if (device_) return "<gpucoll.Work " + device_->describe() + ">";
  if (!done_) return "<gpucoll.Work completed>";
  return std::string("<gpucoll.Work host ") + (done_->done() ? "completed>" : "running>");
}

void bind_work(py::module_& m) {
  py::class_<Work, std::shared_ptr<Work>>(
      m, "Work",
      "What an async_op=True call returns on every backend (gpucoll.Work), and a call that finished before it "
      "returned. wait(): a GPU operation orders the caller's current stream after it (torch's for tensors, CuPy's "
      "for arrays, else the legacy default stream) and the host does not block; a host operation blocks until it "
      "is done. is_completed(): whether it finished (never blocks). synchronize(): blocks the host until it "
      "finished. result(): what the synchronous call would have returned. wait, is_completed and synchronize raise "
      "the operation's error, or its communicator's recorded failure (CollectiveTimeout, NcclError, RemoteError) "
      "once the watchdog recorded one. An operation captured into a CUDA graph reports completed.")
      .def(py::init([](py::object result) { return std::make_shared<Work>(std::move(result)); }),
           py::arg("result") = py::none(), "A Work that has completed, holding `result`.")
      .def_static(
          "on_device",
          [](py::object native, std::string kind, int device, py::object raise_failed) {
            std::unique_ptr<DeviceDone> end = nccl_device_done(native);
            if (!end) end = std::make_unique<PyDeviceDone>(native);
            return std::make_shared<Work>(std::move(end), std::move(native), std::move(kind), device,
                                          std::move(raise_failed), py::none());
          },
          py::arg("native"), py::arg("kind"), py::arg("device"), py::arg("raise_failed") = py::none(),
          "The Work of a GPU operation `native` (an NcclWork, or any object with query(), wait_on(stream) and "
          "synchronize()) on CUDA device `device`, whose buffers are of `kind` (what _cuda_buffers names the "
          "caller's current stream by). raise_failed(): raises the communicator's recorded failure.")
      .def_static(
          "after_stream",
          [](uintptr_t stream, std::string kind, int device, std::string what, py::object after_sync) {
            return std::make_shared<Work>(event_device_done(stream, device, std::move(what)), py::none(),
                                          std::move(kind), device, py::none(), std::move(after_sync));
          },
          py::arg("stream"), py::arg("kind"), py::arg("device"), py::arg("what"), py::arg("after_sync") = py::none(),
          "The Work of what was enqueued on `stream` so far (a CUDA event recorded now). after_sync(): called once "
          "synchronize() saw it finish.")
      .def("wait", [](Work& w, py::object /*timeout*/) { return w.wait(); }, py::arg("timeout") = py::none(),
           "GPU: the caller's current stream waits for the operation (the host does not block); host: blocks until "
           "it finished. Raises its error or the communicator's failure. `timeout` is accepted for torch's "
           "signature; the communicator's own timeout applies.")
      .def("is_completed", &Work::is_completed, "Whether it finished (never blocks); raises its error.")
      .def("done", &Work::done, "Whether it ended, successfully or not (never blocks, never raises).")
      .def("synchronize", &Work::synchronize, "Blocks the host until it finished; raises its error.")
      .def("result", [](const Work& w) { return w.result; }, "What the synchronous call would have returned.")
      .def_readwrite("_result", &Work::result)
      .def_property_readonly("seq", &Work::seq, "The communicator's operation number (NCCL), else None.")
      .def_property_readonly(
          "device", [](const Work& w) { return w.ordinal() >= 0 ? py::object(py::int_(w.ordinal())) : py::none(); },
          "The CUDA device a GPU operation runs on; None for a host one (and a completed Work).")
      .def_property_readonly("_native", &Work::native, "The backend's object its device end was made from.")
      .def("add_done_callback", &Work::add_done_callback, py::arg("fn"),
           "fn() once a host operation finished (success or not), on the thread that finished it with the GIL held, "
           "or at once if it has. Its exceptions are reported as unraisable. Unsupported for a GPU operation.")
      .def("__repr__", &Work::repr);
  m.def(
      "host_at_exit",
      [](double seconds) {
        g_exiting.store(true, std::memory_order_release);
        py::gil_scoped_release nogil;
        stop_host_progress(seconds);
      },
      py::arg("seconds"),
      "At interpreter exit: no thread of gpucoll's may take the GIL from now on; every host communicator's queued "
      "operations get `seconds` to finish.");
}

}  // namespace gpucoll::python
