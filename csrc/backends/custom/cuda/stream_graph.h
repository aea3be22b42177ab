// The CUDA plumbing virtual ranks need from Python without torch or CuPy: owned streams, events, and the
// capture of work issued on several streams into one CUDA graph (fork from the first stream, join back).
#pragma once

#include <cuda_runtime_api.h>

#include <vector>

namespace gpucoll::cuda {

class Stream {
 public:
  explicit Stream(int device);  // non-blocking: no implicit sync with the legacy default stream
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return s_; }
  int device() const { return device_; }
  void synchronize() const;

 private:
  cudaStream_t s_ = nullptr;
  int device_;
};

class Event {
 public:
  // timing: cudaEventDefault (for elapsed_ms), else cudaEventDisableTiming (cheaper: the common case).
  explicit Event(int device, bool timing = false);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(cudaStream_t stream);
  bool query() const;  // true once the recorded work finished
  void synchronize() const;
  void wait_on(cudaStream_t stream) const;  // `stream` waits for the recorded work
  // Milliseconds from `start`'s completion to this event's (both timing events, both complete).
  float elapsed_ms(const Event& start) const;

 private:
  cudaEvent_t e_ = nullptr;
  int device_;
};

// One graph from work issued on `streams` between begin() and end(): streams[0] is captured (relaxed mode, so
// other threads may keep using CUDA), the others join it through events and are joined back before the end.
class MultiStreamGraph {
 public:
  MultiStreamGraph(int device, std::vector<cudaStream_t> streams);
  ~MultiStreamGraph();
  MultiStreamGraph(const MultiStreamGraph&) = delete;
  MultiStreamGraph& operator=(const MultiStreamGraph&) = delete;
  void begin();
  void end();
  void replay(int times);  // launches on streams[0]
  bool capturing() const { return capturing_; }

 private:
  int device_;
  std::vector<cudaStream_t> streams_;
  std::vector<cudaEvent_t> events_;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  bool capturing_ = false;
};

}  // namespace gpucoll::cuda
