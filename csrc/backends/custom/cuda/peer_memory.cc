#include "backends/custom/cuda/peer_memory.h"

#include <atomic>
#include <cstddef>
#include <cstring>

#include "device/cuda/cuda_util.h"
#include "core/error.h"
#include "core/log.h"

namespace gpucoll::cuda::custom {
namespace {

std::atomic<int64_t> g_open_handles{0};

cudaIpcMemHandle_t handle_from(const std::string& bytes, int peer) {
  cudaIpcMemHandle_t h;
  GPUCOLL_CHECK_ARG(bytes.size() == sizeof(h.reserved), "the IPC handle of rank ", peer, " must be ",
                    sizeof(h.reserved), " bytes; got ", bytes.size());
  std::memcpy(h.reserved, bytes.data(), sizeof(h.reserved));
  return h;
}

std::string handle_bytes(const cudaIpcMemHandle_t& h) { return std::string(h.reserved, sizeof(h.reserved)); }

// CUresult cuMemGetAddressRange(CUdeviceptr* base, size_t* size, CUdeviceptr ptr), without cuda.h.
using MemGetAddressRange = int (*)(unsigned long long*, size_t*, unsigned long long);

MemGetAddressRange address_range_fn() {
  static MemGetAddressRange fn = []() -> MemGetAddressRange {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return reinterpret_cast<MemGetAddressRange>(p);
  }();
  return fn;
}

}  // namespace

int64_t ipc_open_handles() { return g_open_handles.load(); }

RankMemory::RankMemory(int rank, int device, size_t half_bytes) : device_(device), half_bytes_(half_bytes) {
  GPUCOLL_CHECK_ARG(half_bytes % 256 == 0 && half_bytes > 0, "the staging half must be a positive multiple of 256 "
                    "bytes; got ", half_bytes);
  DeviceGuard guard(device);
  const size_t total = kSignalsBytes + 2 * half_bytes;
  GPUCOLL_CUDA_CHECK(cudaMalloc(&base_, total));
  try {
    // Zero flags and counters: epochs start at 1, so zero never satisfies a wait. Synchronous, so the area
    // is initialised before any peer can learn its handle.
    GPUCOLL_CUDA_CHECK(cudaMemset(base_, 0, kSignalsBytes));
    const uint32_t probe = kProbeMagic ^ static_cast<uint32_t>(rank);
    GPUCOLL_CUDA_CHECK(cudaMemcpy(&signals()->probe, &probe, sizeof(probe), cudaMemcpyHostToDevice));
    GPUCOLL_CUDA_CHECK(cudaDeviceSynchronize());
  } catch (...) {
    release();
    throw;
  }
}

RankMemory::~RankMemory() { release(); }

void RankMemory::release() noexcept {
  free_on_device(base_, device_);
  base_ = nullptr;
}

std::string RankMemory::ipc_handle() const {
  DeviceGuard guard(device_);
  cudaIpcMemHandle_t h;
  GPUCOLL_CUDA_CHECK(cudaIpcGetMemHandle(&h, base_));
  return handle_bytes(h);
}

void* IpcMappings::open(const std::string& handle, int peer) {
  auto it = open_.find(handle);
  if (it != open_.end()) return it->second;
  const cudaIpcMemHandle_t h = handle_from(handle, peer);
  void* ptr = nullptr;
  const cudaError_t err = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) {
    cudaGetLastError();
    GPUCOLL_THROW(ErrorCode::kCuda, "cudaIpcOpenMemHandle", "cannot map rank ", peer,
                  "'s memory into this process: cudaIpcOpenMemHandle failed: ", describe(err));
  }
  open_.emplace(handle, ptr);
  g_open_handles.fetch_add(1);
  return ptr;
}

void IpcMappings::close_all() noexcept {
  for (auto& [handle, ptr] : open_) {
    const cudaError_t err = cudaIpcCloseMemHandle(ptr);
    if (err != cudaSuccess) {
      cudaGetLastError();
      GPUCOLL_DEBUG("cudaIpcCloseMemHandle failed at teardown: ", describe(err));
    }
    g_open_handles.fetch_sub(1);
  }
  open_.clear();
}

ExportedRange export_range(const void* ptr) {
  MemGetAddressRange fn = address_range_fn();
  if (fn == nullptr) {
    GPUCOLL_THROW(ErrorCode::kUnsupported, "cuMemGetAddressRange",
                  "the CUDA driver does not offer cuMemGetAddressRange; buffers cannot be registered");
  }
  unsigned long long base = 0;
  size_t size = 0;
  const int res = fn(&base, &size, reinterpret_cast<unsigned long long>(ptr));
  if (res != 0) {
    GPUCOLL_THROW(ErrorCode::kInvalidArgument, "cuMemGetAddressRange", "cannot register the buffer at ",
                  ptr, ": it is not device memory from cudaMalloc (cuMemGetAddressRange returned ", res, ")");
  }
  cudaIpcMemHandle_t h;
  const cudaError_t err = cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base));
  if (err != cudaSuccess) {
    cudaGetLastError();
    GPUCOLL_THROW(ErrorCode::kInvalidArgument, "cudaIpcGetMemHandle", "cannot register the buffer at ", ptr,
                  ": its allocation cannot be shared with CUDA IPC (", describe(err),
                  "); allocate it with cudaMalloc (torch's and CuPy's default allocators do)");
  }
  ExportedRange out;
  out.handle = handle_bytes(h);
  out.offset = reinterpret_cast<uintptr_t>(ptr) - base;
  return out;
}

bool probe_peer(const Signals* peer_signals, int peer) noexcept {
  uint32_t v = 0;
  if (cudaMemcpy(&v, &peer_signals->probe, sizeof(v), cudaMemcpyDeviceToHost) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return v == (kProbeMagic ^ static_cast<uint32_t>(peer));
}

}  // namespace gpucoll::cuda::custom
