// gpucoll._C.Work: what an operation that runs on another thread returns (today the host backend's async_op=True
// operations, run on its progress thread: backends/host/progress.h), over the one state such an operation ends in
// (core/completion.h). gpucoll.torch's Work and DDP's futures are made from it.
//
// The GIL. A waiter releases it. Callbacks registered from Python run on the thread that completed the operation
// with the GIL taken; so do the releases of the Python objects an operation keeps alive (its buffers). At
// interpreter exit no thread may take the GIL any more, so after host_at_exit() (gpucoll/backends/host.py
// registers it with atexit) they are skipped: the objects are leaked, the callbacks not run.
#include <pybind11/pybind11.h>

#include <atomic>
#include <utility>

#include "python/bindings.h"

namespace py = pybind11;

namespace gpucoll::python {

namespace {
std::atomic<bool> g_exiting{false};  // set by host_at_exit
}  // namespace

bool python_exiting() { return interpreter_finalizing() || g_exiting.load(std::memory_order_acquire); }

NativeWork::End::~End() {
  if (python_exiting()) {  // the interpreter is going: leaked
    keep.release();
    for (auto& fn : callbacks) fn.release();
    return;
  }
  py::gil_scoped_acquire gil;
  keep = py::object();
  callbacks.clear();
}

NativeWork::NativeWork(std::shared_ptr<Completion> done, py::object keep)
    : done_(std::move(done)), end_(std::make_shared<End>()) {
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

void NativeWork::wait() const {
  if (!done_->done()) {
    py::gil_scoped_release nogil;
    done_->wait();
    return;
  }
  // Ended: the common case inside a completion callback, where handing the GIL over and back would cost the
  // completing thread a switch interval while the caller's thread runs Python.
  if (done_->error()) std::rethrow_exception(done_->error());
}

bool NativeWork::is_completed() const {
  if (!done_->done()) return false;
  if (done_->error()) std::rethrow_exception(done_->error());
  return true;
}

void NativeWork::add_done_callback(py::function fn) {
  if (end_->fired) {  // under the GIL, as `fired` is set: the callbacks ran, or the interpreter exits
    if (!python_exiting()) fn();
    return;
  }
  end_->callbacks.push_back(std::move(fn));
}

void bind_work(py::module_& m) {
  py::class_<NativeWork, std::shared_ptr<NativeWork>>(m, "Work",
                                                      "What an async_op=True operation that runs on another thread "
                                                      "returns (gpucoll.Work's interface).")
      .def("wait", [](const NativeWork& w, py::object /*timeout*/) { w.wait(); return true; },
           py::arg("timeout") = py::none(),
           "Blocks until the operation finished; raises its error. `timeout` is accepted for torch's signature; "
           "the communicator's own timeout applies.")
      .def("is_completed", &NativeWork::is_completed, "Whether it finished (never blocks); raises its error.")
      .def("done", &NativeWork::done, "Whether it finished, successfully or not (never blocks, never raises).")
      .def("synchronize", [](const NativeWork& w) { w.wait(); }, "The same as wait() (host memory).")
      .def("result", [](const NativeWork& w) { return w.result; }, "What the synchronous call would have returned.")
      .def_readwrite("_result", &NativeWork::result)
      .def("add_done_callback", &NativeWork::add_done_callback, py::arg("fn"),
           "fn() once the operation finished (success or not), on the thread that finished it with the GIL held, "
           "or at once if it has. Its exceptions are reported as unraisable.")
      .def("__repr__", [](const NativeWork& w) {
        return std::string("<gpucoll.Work host ") + (w.done() ? "completed>" : "running>");
      });
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
