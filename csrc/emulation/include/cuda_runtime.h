// gpucoll's emulated CUDA device: <cuda_runtime.h> for the host compiler. The runtime API, the device-side
// builtins (gpucoll_emu/device.h), and the typed C++ overloads of cudaLaunchKernel and the occupancy query that
// NVIDIA's header also has. Here they matter more than there: nvcc registers every __global__ function with the
// runtime, so the runtime knows how to pass its parameters; a host compiler registers nothing, so the typed
// overload tells the emulator how to copy the parameters at launch (as CUDA does) and how to call the kernel.
// gpucoll's launchers pass the kernel as a typed function pointer, which compiles with both headers.
#pragma once

#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>

#include "cuda_runtime_api.h"
#include "gpucoll_emu/device.h"

extern "C" {
// How to call one kernel: copy its parameters out of a launch's void** (into a heap tuple), call it on them, free
// them. Registered per kernel function (idempotent); the C entry points look it up.
typedef void* (*gpucoll_emu_pack_fn)(void** args);
typedef void (*gpucoll_emu_invoke_fn)(const void* func, const void* params);
typedef void (*gpucoll_emu_free_fn)(void* params);
GPUCOLL_EMU_API void gpucoll_emu_register_kernel(const void* func, gpucoll_emu_pack_fn pack,
                                                 gpucoll_emu_invoke_fn invoke, gpucoll_emu_free_fn destroy);
}

namespace gpucoll_emu {

template <class... A>
struct KernelTraits {
  using Params = std::tuple<std::decay_t<A>...>;

  template <std::size_t... I>
  static void* pack_at(void** args, std::index_sequence<I...>) {
    return new Params(*static_cast<const std::decay_t<A>*>(args[I])...);
  }
  static void* pack(void** args) { return pack_at(args, std::index_sequence_for<A...>{}); }
  // Every fiber gets its own copies of the parameters (by-value arguments), as every CUDA thread does.
  static void invoke(const void* func, const void* params) {
    auto fn = reinterpret_cast<void (*)(A...)>(const_cast<void*>(func));
    std::apply(fn, *static_cast<const Params*>(params));
  }
  static void destroy(void* params) { delete static_cast<Params*>(params); }
};

template <class... A>
inline const void* register_kernel(void (*func)(A...)) {
  const void* f = reinterpret_cast<const void*>(func);
  gpucoll_emu_register_kernel(f, &KernelTraits<A...>::pack, &KernelTraits<A...>::invoke, &KernelTraits<A...>::destroy);
  return f;
}

}  // namespace gpucoll_emu

template <class... A>
inline cudaError_t cudaLaunchKernel(void (*func)(A...), dim3 gridDim, dim3 blockDim, void** args,
                                    std::size_t sharedMem = 0, cudaStream_t stream = 0) {
  return ::cudaLaunchKernel(gpucoll_emu::register_kernel(func), gridDim, blockDim, args, sharedMem, stream);
}

template <class... A>
inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* numBlocks, void (*func)(A...), int blockSize,
                                                                 std::size_t dynamicSMemSize) {
  return ::cudaOccupancyMaxActiveBlocksPerMultiprocessor(numBlocks, gpucoll_emu::register_kernel(func), blockSize,
                                                         dynamicSMemSize);
}
