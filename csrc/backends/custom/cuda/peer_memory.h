// Peer memory of the custom allreduce: one device allocation per rank holding its signal area and its two
// staging halves, exported with CUDA IPC and opened by every peer; and the bookkeeping of every IPC mapping
// this process opened (a process-wide live count, so tests can check that teardown closed them all).
//
// Compiled only in CUDA builds (a *_cuda directory: gpucoll_cuda, cudart_static).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "backends/custom/kernels/custom_allreduce.h"

namespace gpucoll::cuda::custom {

// IPC mappings open in this process right now (all communicators).
int64_t ipc_open_handles();

// A rank's own allocation: [Signals, padded to 256 B][half 0][half 1]. Zeroed, with the probe word set.
class RankMemory {
 public:
  RankMemory(int rank, int device, size_t half_bytes);
  ~RankMemory();
  RankMemory(const RankMemory&) = delete;
  RankMemory& operator=(const RankMemory&) = delete;

  void* base() const { return base_; }
  Signals* signals() const { return static_cast<Signals*>(base_); }
  void* buffer() const { return static_cast<char*>(base_) + kSignalsBytes; }
  size_t half_bytes() const { return half_bytes_; }
  // cudaIpcGetMemHandle of the allocation, as bytes for the rendezvous store.
  std::string ipc_handle() const;
  // Frees the allocation (idempotent, never throws).
  void release() noexcept;

  static constexpr size_t kSignalsBytes = (sizeof(Signals) + 255) / 256 * 256;

 private:
  void* base_ = nullptr;
  int device_;
  size_t half_bytes_;
};

// The IPC mappings one communicator opened, keyed by handle: the driver maps an allocation once per process
// and refuses a second cudaIpcOpenMemHandle of the same handle, so buffers registered from one allocation
// share the mapping.
class IpcMappings {
 public:
  IpcMappings() = default;
  ~IpcMappings() { close_all(); }
  IpcMappings(const IpcMappings&) = delete;
  IpcMappings& operator=(const IpcMappings&) = delete;

  // The local address of the peer allocation behind `handle` (64 bytes from RankMemory::ipc_handle or
  // export_range), opened on first use. Throws CudaError naming the peer when the driver refuses.
  void* open(const std::string& handle, int peer);
  // Closes every mapping (cudaIpcCloseMemHandle) and updates the live count; never throws.
  void close_all() noexcept;
  size_t size() const { return open_.size(); }

 private:
  std::map<std::string, void*> open_;
};

// The allocation that contains `ptr` (base, size) and its IPC handle, for registering a user buffer with the
// peers: they open the handle and add ptr - base. Uses the driver's cuMemGetAddressRange through the
// runtime's entry-point query (the static runtime does not link libcuda). Throws CudaError/Unsupported.
struct ExportedRange {
  std::string handle;
  uint64_t offset = 0;  // ptr - allocation base
};
ExportedRange export_range(const void* ptr);

// Reads rank `peer`'s probe word through `peer_signals` with a real copy; true when it holds the expected
// pattern (the mapping works end to end).
bool probe_peer(const Signals* peer_signals, int peer) noexcept;

}  // namespace gpucoll::cuda::custom
