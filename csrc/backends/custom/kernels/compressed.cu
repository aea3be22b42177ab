// The compressed all-reduce over peer memory (all_reduce(x, compress=...); wire formats in core/quant.h): the host
// backend's schedule (backends/host/compressed.cc) as a two-shot kernel, with the same result bit for bit.
//
// Records, not elements. A piece is a whole number of 256-element quant blocks (the launcher cuts it so), and the
// staging half holds two regions of block records: A, this rank's piece encoded, and B, the reduced records of
// the chunk this rank owns. Chunk c is quant blocks [nb*c/P, nb*(c+1)/P), as on the host, and block b of the grid
// takes slice b of every chunk in whole quant blocks (peer_ops.cuh's rule, in records): whatever block b reads
// was written by block b of its owner before their last common barrier.
//   encode      region A[slice b of every chunk] = encode(in)
//   barrier 0   every rank's records are readable (RAW), and every rank made this same call (open_call)
//   reduce      region B[slice b of chunk r] = encode(sum over q in rank order of decode(rank q's A)), avg divides
//               the float sum by P first
//   barrier 1   every owner's B is readable
//   gather      out[slice b of chunk c] = decode(rank c's B), for every c
// No end barrier, as two_shot.cu: the next call uses the other half.
//
// Launch shape: 512 threads as two groups of 256, one thread per element of a quant block; a block's largest
// magnitude is a tree in shared memory (8 steps), not warp shuffles, which the emulated device does not have.
// Every thread of the block runs every loop the same number of times (inactive groups included), because the
// reductions synchronise the whole block. Peer memory is read with ld.global.cg (peer_ops.cuh); every store goes
// through __stwb, which the emulated device checks.
#include "backends/custom/kernels/custom_dispatch.cuh"
#include "backends/custom/kernels/peer_ops.cuh"
#include "backends/custom/kernels/peer_sync.cuh"
#include "core/quant.h"

namespace gpucoll::cuda::custom {
namespace {

constexpr int kB = kQuantBlock;
constexpr int kGroups = kThreads / kB;
static_assert(kThreads % kB == 0, "a group of threads per quant block");

__device__ __forceinline__ float load_f(const float* p) { return ld_cg(p); }
__device__ __forceinline__ float load_f(const f16_t* p) { return to_float(ld_cg(p)); }
__device__ __forceinline__ float load_f(const bf16_t* p) { return to_float(ld_cg(p)); }
template <class T>
__device__ __forceinline__ T store_f(float v) {
  if constexpr (std::is_same<T, f16_t>::value) {
    return f16_from_float(v);
  } else if constexpr (std::is_same<T, bf16_t>::value) {
    return bf16_from_float(v);
  } else {
    return v;
  }
}

__device__ __forceinline__ unsigned char ld_byte(const unsigned char* p) { return __ldcg(p); }

// Quant blocks [first, end) of this grid block's slice of chunk c: balanced, the last slice the remainder.
struct Blocks {
  size_t first, end;
};
__device__ __forceinline__ Blocks slice_of_chunk(size_t nb, int P, int c) {
  const size_t cb = nb * static_cast<size_t>(c) / static_cast<size_t>(P);
  const size_t ce = nb * static_cast<size_t>(c + 1) / static_cast<size_t>(P);
  const size_t n = ce - cb;
  const size_t B = gridDim.x;
  return {cb + n * blockIdx.x / B, cb + n * (blockIdx.x + 1) / B};
}

// Encodes one quant block per group of 256 threads: value `v` of element j (valid: j is inside the vector) into
// `rec` (null for a group without a block this round). Every thread of the grid block calls it together.
__device__ __forceinline__ void encode_group(Wire w, float v, bool valid, unsigned char* rec, float* red, int* odd) {
  const int t = threadIdx.x;
  const int j = t % kB;
  const int base = t - j;
  if (w == Wire::kBf16) {
    if (rec != nullptr && valid) {
      __stwb(reinterpret_cast<unsigned short*>(rec) + j, bf16_from_float(v).bits);
    }
    return;
  }
  red[t] = valid ? finite_abs(v) : 0.f;
  odd[t] = valid && !(v - v == 0.f) ? 1 : 0;
  __syncthreads();
  for (int s = kB / 2; s > 0; s >>= 1) {
    if (j < s) {
      const float o = red[t + s];
      red[t] = o > red[t] ? o : red[t];
      odd[t] |= odd[t + s];
    }
    __syncthreads();
  }
  const float m = red[base];
  const bool special = odd[base] != 0;
  __syncthreads();  // red and odd are rewritten by the next call
  if (rec == nullptr) return;
  const BlockScale b = block_scale(m, w == Wire::kInt8 ? kInt8Max : kFp8Max);
  if (valid) {
    const unsigned char c = w == Wire::kInt8 ? static_cast<unsigned char>(int8_code(v, b)) : fp8_code(v, b);
    __stwb(rec + j, c);
  }
  if (j == 0) {
    __stwb(reinterpret_cast<unsigned int*>(rec + kB), float_bits(b.scale));
    __stwb(rec + kB + kRecordFlags, static_cast<unsigned char>(special ? kHasSpecials : 0));
  }
}

// Element j of a record another rank wrote (or this one).
__device__ __forceinline__ float decode_elem(Wire w, const unsigned char* rec, int j) {
  if (w == Wire::kBf16) {
    return to_float(bf16_t{__ldcg(reinterpret_cast<const unsigned short*>(rec) + j)});
  }
  const float scale = bits_float(__ldcg(reinterpret_cast<const unsigned int*>(rec + kB)));
  const unsigned char c = ld_byte(rec + j);
  return w == Wire::kInt8 ? int8_value(static_cast<int8_t>(c), scale) : fp8_value(fp8_unscaled(c), scale);
}

template <class T>
__global__ void __launch_bounds__(kThreads) compressed_kernel(AllReduceArgs a) {
  __shared__ float red[kThreads];
  __shared__ int odd[kThreads];
  const Sync s = begin_call(a);
  if (s.skip) return;
  const int P = a.nranks;
  const Wire w = a.wire;
  const size_t n = a.count;
  const size_t nb = (n + kB - 1) / kB;
  const size_t rec = static_cast<size_t>(wire_record_bytes(w));
  const int g = threadIdx.x / kB;
  const int j = threadIdx.x % kB;
  auto region_a = [&](int q, size_t k) { return static_cast<unsigned char*>(staging(a, q, s.calls)) + k * rec; };
  auto region_b = [&](int q, size_t k) { return region_a(q, nb + k); };
  auto elem = [&](size_t k) { return k * kB + static_cast<size_t>(j); };

  const T* in = static_cast<const T*>(a.in);
  for (int c = 0; c < P; ++c) {
    const Blocks r = slice_of_chunk(nb, P, c);
    for (size_t k0 = r.first; k0 < r.end; k0 += kGroups) {
      const size_t k = k0 + static_cast<size_t>(g);
      const bool has = k < r.end;
      const bool valid = has && elem(k) < n;
      encode_group(w, valid ? load_f(in + elem(k)) : 0.f, valid, has ? region_a(a.rank, k) : nullptr, red, odd);
    }
  }
  if (!open_call(s, a)) {  // ranks made different calls: nothing was touched (peer_sync.cuh)
    end_call(s);
    return;
  }
  const Blocks mine = slice_of_chunk(nb, P, a.rank);
  for (size_t k0 = mine.first; k0 < mine.end; k0 += kGroups) {
    const size_t k = k0 + static_cast<size_t>(g);
    const bool has = k < mine.end;
    const bool valid = has && elem(k) < n;
    float acc = 0.f;
    if (valid) {
      acc = decode_elem(w, region_a(0, k), j);
      for (int q = 1; q < P; ++q) acc = add_rn(acc, decode_elem(w, region_a(q, k), j));
      if (a.op == RedOp::kAvg) acc = div_rn(acc, static_cast<float>(P));
    }
    encode_group(w, acc, valid, has ? region_b(a.rank, k) : nullptr, red, odd);
  }
  barrier(s, 1);
  T* out = static_cast<T*>(a.out);
  for (int i = 0; i < P; ++i) {
    const int c = (a.rank + 1 + i) % P;  // the ranks' blocks pull from different owners at once
    const Blocks r = slice_of_chunk(nb, P, c);
    for (size_t k = r.first + static_cast<size_t>(g); k < r.end; k += kGroups) {
      if (elem(k) < n) st_elem(out + elem(k), store_f<T>(decode_elem(w, region_b(c, k), j)));
    }
  }
  end_call(s);
}

template <class F>
cudaError_t with_kernel(DType dtype, F f) {
  switch (dtype) {
    case DType::kF32: return f(&compressed_kernel<float>);
    case DType::kF16: return f(&compressed_kernel<f16_t>);
    case DType::kBF16: return f(&compressed_kernel<bf16_t>);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_compressed(const AllReduceArgs& a, cudaStream_t stream) {
  if (!args_valid(a, false) || a.wire == Wire::kNone || a.threads != kThreads) return cudaErrorInvalidValue;
  if (a.op != RedOp::kSum && a.op != RedOp::kAvg) return cudaErrorInvalidValue;
  if (a.count > compressed_piece_elems(a.half_bytes, a.wire)) return cudaErrorInvalidValue;
  return with_kernel(a.dtype, [&](auto kernel) {
    AllReduceArgs args = a;
    void* params[] = {&args};
    return cudaLaunchKernel(kernel, dim3(static_cast<unsigned>(a.blocks)), dim3(static_cast<unsigned>(a.threads)),
                            params, 0, stream);
  });
}

cudaError_t compressed_blocks_per_sm(DType dtype, int* out) {
  if (out == nullptr) return cudaErrorInvalidValue;
  return with_kernel(dtype, [&](auto kernel) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(out, kernel, kThreads, 0);
  });
}

}  // namespace gpucoll::cuda::custom
