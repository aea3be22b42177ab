#include "backends/custom/cuda/stream_graph.h"

#include "device/cuda/cuda_util.h"
#include "core/error.h"

namespace gpucoll::cuda {

Stream::Stream(int device) : device_(device) {
  DeviceGuard guard(device);
  GPUCOLL_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking));
}

Stream::~Stream() {
  if (s_ != nullptr && cudaStreamDestroy(s_) != cudaSuccess) cudaGetLastError();
}

void Stream::synchronize() const { GPUCOLL_CUDA_CHECK(cudaStreamSynchronize(s_)); }

Event::Event(int device, bool timing) : device_(device) {
  DeviceGuard guard(device);
  GPUCOLL_CUDA_CHECK(cudaEventCreateWithFlags(&e_, timing ? cudaEventDefault : cudaEventDisableTiming));
}

Event::~Event() {
  if (e_ != nullptr && cudaEventDestroy(e_) != cudaSuccess) cudaGetLastError();
}

void Event::record(cudaStream_t stream) {
  DeviceGuard guard(device_);
  GPUCOLL_CUDA_CHECK(cudaEventRecord(e_, stream));
}

bool Event::query() const {
  const cudaError_t err = cudaEventQuery(e_);
  if (err == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  GPUCOLL_CUDA_CHECK(err);
  return true;
}

void Event::synchronize() const { GPUCOLL_CUDA_CHECK(cudaEventSynchronize(e_)); }

void Event::wait_on(cudaStream_t stream) const { GPUCOLL_CUDA_CHECK(cudaStreamWaitEvent(stream, e_, 0)); }

float Event::elapsed_ms(const Event& start) const {
  float ms = 0;
  GPUCOLL_CUDA_CHECK(cudaEventElapsedTime(&ms, start.e_, e_));
  return ms;
}

MultiStreamGraph::MultiStreamGraph(int device, std::vector<cudaStream_t> streams)
    : device_(device), streams_(std::move(streams)) {
  GPUCOLL_CHECK_ARG(!streams_.empty(), "a graph needs at least one stream");
  DeviceGuard guard(device);
  events_.resize(streams_.size(), nullptr);
  for (auto& e : events_) GPUCOLL_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
}

MultiStreamGraph::~MultiStreamGraph() {
  if (capturing_) {
    cudaGraph_t g = nullptr;
    if (cudaStreamEndCapture(streams_[0], &g) == cudaSuccess && g != nullptr) cudaGraphDestroy(g);
    cudaGetLastError();
  }
  if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
  if (graph_ != nullptr) cudaGraphDestroy(graph_);
  for (auto e : events_) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  cudaGetLastError();
}

void MultiStreamGraph::begin() {
  if (capturing_ || exec_ != nullptr) GPUCOLL_THROW(ErrorCode::kInvalidUsage, "capture", "this graph was already captured");
  DeviceGuard guard(device_);
  GPUCOLL_CUDA_CHECK(cudaStreamBeginCapture(streams_[0], cudaStreamCaptureModeRelaxed));
  capturing_ = true;
  // Fork: every other stream waits on an event recorded in the captured stream, which pulls it into the capture.
  GPUCOLL_CUDA_CHECK(cudaEventRecord(events_[0], streams_[0]));
  for (size_t i = 1; i < streams_.size(); ++i) GPUCOLL_CUDA_CHECK(cudaStreamWaitEvent(streams_[i], events_[0], 0));
}

void MultiStreamGraph::end() {
  if (!capturing_) GPUCOLL_THROW(ErrorCode::kInvalidUsage, "capture", "end() without begin()");
  DeviceGuard guard(device_);
  // Join: the captured stream waits on the others' last work; a capture with unjoined streams fails.
  for (size_t i = 1; i < streams_.size(); ++i) {
    GPUCOLL_CUDA_CHECK(cudaEventRecord(events_[i], streams_[i]));
    GPUCOLL_CUDA_CHECK(cudaStreamWaitEvent(streams_[0], events_[i], 0));
  }
  capturing_ = false;
  GPUCOLL_CUDA_CHECK(cudaStreamEndCapture(streams_[0], &graph_));
  GPUCOLL_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
}

void MultiStreamGraph::replay(int times) {
  if (exec_ == nullptr) GPUCOLL_THROW(ErrorCode::kInvalidUsage, "replay", "the graph has not been captured");
  DeviceGuard guard(device_);
  for (int i = 0; i < times; ++i) GPUCOLL_CUDA_CHECK(cudaGraphLaunch(exec_, streams_[0]));
}

}  // namespace gpucoll::cuda
