// The host backend's compressed all-reduce (all_reduce(x, compress=...); wire formats in core/quant.h).
//
// The two-shot shape, with only encoded bytes in the work buffers. Per piece, each work-buffer half holds two
// regions of block records: A, this rank's whole piece encoded, and B, the reduced chunk this rank owns.
//   1. every rank encodes its piece into A;
//   2. rank r decodes chunk r's records from every rank's A, sums them in float32 in rank order, and encodes the
//      sum once into its B (avg divides the float sum by P before that);
//   3. every rank decodes every chunk from its owner's B into the output.
// Every rank decodes the same records, rank r its own chunk included, so the result is the same on every rank
// bit for bit, and it is a function of the inputs alone (blocks are numbered from the vector's start and pieces
// are whole blocks): gpucoll/compression.py reproduces it in NumPy.
//
// Steps 2 and 3 each read every peer's buffer, so both are recorded with every peer as a reader; the next piece
// on the same half waits for them (wait_war) as run_pieces' steps do.
#include <algorithm>
#include <array>
#include <cstring>
#include <type_traits>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "backends/host/host_comm.h"
#include "core/half.h"
#include "core/quant.h"

namespace gpucoll::host {

namespace {

constexpr int kB = kQuantBlock;

inline float to_f(float v) { return v; }
inline float to_f(f16_t v) { return to_float(v); }
inline float to_f(bf16_t v) { return to_float(v); }
template <class T>
inline T from_f(float v) {
  if constexpr (std::is_same_v<T, f16_t>) {
    return f16_from_float(v);
  } else if constexpr (std::is_same_v<T, bf16_t>) {
    return bf16_from_float(v);
  } else {
    return v;
  }
}

const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[static_cast<size_t>(c)] = fp8_unscaled(static_cast<uint8_t>(c));
    return t;
  }();
  return table;
}

// int8's loops in SSE2 (every x86-64), 16 elements at a time; elsewhere, and for a block's tail, quant.h's scalar
// functions, which these match lane for lane: the same IEEE operations in the same order, the same rounding (the
// magic-number one, so that neither depends on MXCSR's mode) and the same special codes. Written as plain loops,
// GCC vectorises neither the select chains nor a float max reduction (not without -ffast-math).
// The largest finite magnitude of v[0, n), and whether every value is finite.
float finite_max(const float* v, int n, bool* all_finite) {
  float m = 0.f;
  bool finite = true;
  int i = 0;
#if defined(__SSE2__)
  const __m128i abs_mask = _mm_set1_epi32(0x7fffffff);
  const __m128i inf_bits = _mm_set1_epi32(0x7f800000);
  __m128 mv = _mm_setzero_ps();
  __m128i odd = _mm_setzero_si128();
  for (; i + 4 <= n; i += 4) {
    const __m128i a = _mm_and_si128(_mm_castps_si128(_mm_loadu_ps(v + i)), abs_mask);
    const __m128i fin = _mm_cmplt_epi32(a, inf_bits);
    odd = _mm_or_si128(odd, _mm_andnot_si128(fin, abs_mask));
    mv = _mm_max_ps(mv, _mm_castsi128_ps(_mm_and_si128(a, fin)));  // no NaN left: maxps is exact
  }
  float lanes[4];
  _mm_storeu_ps(lanes, mv);
  m = std::max(std::max(lanes[0], lanes[1]), std::max(lanes[2], lanes[3]));
  finite = _mm_movemask_epi8(_mm_cmpeq_epi32(odd, _mm_setzero_si128())) == 0xffff;
#endif
  for (; i < n; ++i) {
    const float a = finite_abs(v[i]);
    finite = finite && (v[i] - v[i] == 0.f);
    m = a > m ? a : m;
  }
  *all_finite = finite;
  return m;
}

#if defined(__SSE2__)
inline __m128i blend(__m128i mask, __m128i a, __m128i b) {  // mask ? a : b
  return _mm_or_si128(_mm_and_si128(mask, a), _mm_andnot_si128(mask, b));
}
inline __m128i int8_codes4(const float* v, const BlockScale& b) {
  const __m128 x = _mm_loadu_ps(v);
  __m128 t = _mm_mul_ps(_mm_mul_ps(x, _mm_set1_ps(b.lift)), _mm_set1_ps(b.inv));
  // A finite x gives a finite t; what a non-finite x gives is replaced by its code below.
  t = _mm_min_ps(_mm_max_ps(t, _mm_set1_ps(-kInt8Max)), _mm_set1_ps(kInt8Max));
  const __m128 magic = _mm_set1_ps(kRoundMagic);
  __m128i c = _mm_cvttps_epi32(_mm_sub_ps(_mm_add_ps(t, magic), magic));  // integral already: exact
  const __m128i xb = _mm_castps_si128(x);
  const __m128i ab = _mm_and_si128(xb, _mm_set1_epi32(0x7fffffff));
  const __m128i inf_bits = _mm_set1_epi32(0x7f800000);
  const __m128i sign = _mm_srai_epi32(xb, 31);
  const __m128i inf_code = _mm_sub_epi32(_mm_xor_si128(_mm_set1_epi32(127), sign), sign);  // 127 or -127
  c = blend(_mm_cmpeq_epi32(ab, inf_bits), inf_code, c);
  return blend(_mm_cmpgt_epi32(ab, inf_bits), _mm_set1_epi32(-128), c);
}
#endif

// `plain`: every value finite and no lift. Then t = x * inv (x * 1 is x) lies within 126 (1 + 2^-23) of 0, which
// rounds into [-126, 126]: the clamp and the special codes change nothing, and are skipped.
void int8_codes(const float* __restrict__ v, int n, const BlockScale& b, bool plain, int8_t* __restrict__ q) {
  int i = 0;
#if defined(__SSE2__)
  if (plain) {
    const __m128 inv = _mm_set1_ps(b.inv);
    const __m128 magic = _mm_set1_ps(kRoundMagic);
    auto codes4 = [&](const float* p) {
      return _mm_cvttps_epi32(_mm_sub_ps(_mm_add_ps(_mm_mul_ps(_mm_loadu_ps(p), inv), magic), magic));
    };
    for (; i + 16 <= n; i += 16) {
      const __m128i lo = _mm_packs_epi32(codes4(v + i), codes4(v + i + 4));
      const __m128i hi = _mm_packs_epi32(codes4(v + i + 8), codes4(v + i + 12));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(lo, hi));
    }
  }
  for (; i + 16 <= n; i += 16) {
    const __m128i lo = _mm_packs_epi32(int8_codes4(v + i, b), int8_codes4(v + i + 4, b));
    const __m128i hi = _mm_packs_epi32(int8_codes4(v + i + 8, b), int8_codes4(v + i + 12, b));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(lo, hi));  // in range: packs are exact
  }
#endif
  for (; i < n; ++i) q[i] = int8_code(v[i], b);
}

#if defined(__SSE2__)
template <bool kPlain>
inline __m128 int8_values4(__m128i c, __m128 scale) {
  const __m128 x = _mm_mul_ps(_mm_cvtepi32_ps(c), scale);
  if constexpr (kPlain) return x;
  const __m128i inf = _mm_set1_epi32(0x7f800000);
  __m128i r = blend(_mm_cmpeq_epi32(c, _mm_set1_epi32(127)), inf, _mm_castps_si128(x));
  r = blend(_mm_cmpeq_epi32(c, _mm_set1_epi32(-127)), _mm_or_si128(inf, _mm_set1_epi32(INT32_MIN)), r);
  return _mm_castsi128_ps(blend(_mm_cmpeq_epi32(c, _mm_set1_epi32(-128)), _mm_set1_epi32(0x7fc00000), r));
}
#endif

#if defined(__SSE2__)
template <bool kPlain>
int int8_values16(const int8_t* __restrict__ q, int n, __m128 s, float* __restrict__ out) {
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i));
    const __m128i lo16 = _mm_srai_epi16(_mm_unpacklo_epi8(b, b), 8);  // sign-extended to 16 bits
    const __m128i hi16 = _mm_srai_epi16(_mm_unpackhi_epi8(b, b), 8);
    _mm_storeu_ps(out + i, int8_values4<kPlain>(_mm_srai_epi32(_mm_unpacklo_epi16(lo16, lo16), 16), s));
    _mm_storeu_ps(out + i + 4, int8_values4<kPlain>(_mm_srai_epi32(_mm_unpackhi_epi16(lo16, lo16), 16), s));
    _mm_storeu_ps(out + i + 8, int8_values4<kPlain>(_mm_srai_epi32(_mm_unpacklo_epi16(hi16, hi16), 16), s));
    _mm_storeu_ps(out + i + 12, int8_values4<kPlain>(_mm_srai_epi32(_mm_unpackhi_epi16(hi16, hi16), 16), s));
  }
  return i;
}
#endif

// `plain`: the record has no special code (its flags byte says so), so every code is a finite value.
void int8_values(const int8_t* __restrict__ q, int n, float scale, bool plain, float* __restrict__ out) {
  int i = 0;
#if defined(__SSE2__)
  const __m128 s = _mm_set1_ps(scale);
  i = plain ? int8_values16<true>(q, n, s, out) : int8_values16<false>(q, n, s, out);
#else
  (void)plain;
#endif
  for (; i < n; ++i) out[i] = int8_value(q[i], scale);
}

void encode_floats(Wire w, const float* __restrict__ v, int n, unsigned char* __restrict__ rec) {
  if (w == Wire::kBf16) {
    auto* o = reinterpret_cast<bf16_t*>(rec);
    for (int i = 0; i < n; ++i) o[i] = bf16_from_float(v[i]);
    return;
  }
  bool finite = true;
  const BlockScale b = block_scale(finite_max(v, n, &finite), w == Wire::kInt8 ? kInt8Max : kFp8Max);
  if (w == Wire::kInt8) {
    int8_codes(v, n, b, finite && b.lift == 1.f, reinterpret_cast<int8_t*>(rec));
  } else {
    for (int i = 0; i < n; ++i) rec[i] = fp8_code(v[i], b);
  }
  std::memcpy(rec + kB, &b.scale, sizeof(float));
  rec[kB + kRecordFlags] = finite ? 0 : kHasSpecials;
}

template <class T>
void encode_block(Wire w, const T* x, int n, unsigned char* rec) {
  if constexpr (std::is_same_v<T, float>) {
    encode_floats(w, x, n, rec);
  } else {
    float v[kB];
    for (int i = 0; i < n; ++i) v[i] = to_f(x[i]);
    encode_floats(w, v, n, rec);
  }
}

// The values of one record.
void decode(Wire w, const unsigned char* __restrict__ rec, int n, float* __restrict__ out) {
  if (w == Wire::kBf16) {
    const auto* v = reinterpret_cast<const bf16_t*>(rec);
    for (int i = 0; i < n; ++i) out[i] = to_float(v[i]);
    return;
  }
  float scale;
  std::memcpy(&scale, rec + kB, sizeof(float));
  if (w == Wire::kInt8) {
    int8_values(reinterpret_cast<const int8_t*>(rec), n, scale, (rec[kB + kRecordFlags] & kHasSpecials) == 0, out);
  } else {
    const float* table = fp8_table().data();
    for (int i = 0; i < n; ++i) out[i] = fp8_value(table[rec[i]], scale);
  }
}

template <class F>
void with_float_type(DType d, F f) {
  switch (d) {
    case DType::kF16: f(f16_t{}); break;
    case DType::kBF16: f(bf16_t{}); break;
    default: f(float{}); break;
  }
}

}  // namespace

void wire_roundtrip(Wire w, DType dtype, const void* in, void* out, int64_t count) {
  GPUCOLL_CHECK_ARG(w != Wire::kNone, "wire_roundtrip needs a wire format");
  GPUCOLL_CHECK_ARG(dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16,
                    "wire_roundtrip needs float32, float16 or bfloat16 data; got ", dtype_name(dtype));
  with_float_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* x = static_cast<const T*>(in);
    T* y = static_cast<T*>(out);
    alignas(16) unsigned char rec[wire_record_bytes(Wire::kBf16)];
    float vals[kB];
    for (int64_t b = 0; b < count; b += kB) {
      const int m = static_cast<int>(std::min<int64_t>(kB, count - b));
      encode_block(w, x + b, m, rec);
      decode(w, rec, m, vals);
      for (int i = 0; i < m; ++i) y[b + i] = from_f<T>(vals[i]);
    }
  });
}

const char* compress_unusable(const CollArgs& a) {
  if (a.coll != algo::Coll::kAllReduce) return "compress applies to all_reduce only";
  if (a.dtype != DType::kF32 && a.dtype != DType::kF16 && a.dtype != DType::kBF16) {
    return "compress needs float32, float16 or bfloat16 data";
  }
  if (a.premul || (a.op != RedOp::kSum && a.op != RedOp::kAvg)) return "compress reduces with op sum or avg only";
  return nullptr;
}

void HostComm::run_compressed(const CollArgs& a, const algo::CallSig& sig) {
  const int P = opt_.nranks;
  const int me = opt_.rank;
  const Wire w = a.wire;
  const int64_t rec = wire_record_bytes(w);
  const int64_t es = static_cast<int64_t>(dtype_size(a.dtype));
  // Pieces of whole blocks: regions A and B fit in a work-buffer half, and each chunk is about one segment of
  // input, as run_pieces cuts them, so that a step's records stay in cache.
  const int64_t cap_blocks = opt_.buffer_bytes / 2 / (2 * rec);
  const int64_t seg_blocks = std::max<int64_t>(opt_.segment_bytes / (es * kB), 1);
  const int64_t piece_blocks = std::max<int64_t>(std::min(cap_blocks, seg_blocks * P), 1);
  const int64_t n = a.count;
  const int64_t nblocks = (n + kB - 1) / kB;
  std::vector<int> peers;
  for (int q = 0; q < P; ++q) {
    if (q != me) peers.push_back(q);
  }
  const float divisor = static_cast<float>(P);
  post_sig(sig);
  with_float_type(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(a.in);
    T* out = static_cast<T*>(a.out);
    float acc[kB];
    float vals[kB];
    for (int64_t b0 = 0; b0 < nblocks; b0 += piece_blocks) {
      const int64_t nb = std::min(piece_blocks, nblocks - b0);
      const int half = static_cast<int>(pieces_++ % 2);
      auto region_a = [&](int rank, int64_t k) { return work(rank, half) + k * rec; };
      auto region_b = [&](int rank, int64_t k) { return work(rank, half) + (nb + k) * rec; };
      auto len = [&](int64_t k) { return static_cast<int>(std::min<int64_t>(kB, n - (b0 + k) * kB)); };
      auto first_block = [&](int c) { return nb * c / P; };

      wait_war(half);
      for (int64_t k = 0; k < nb; ++k) {
        encode_block(w, in + (b0 + k) * kB, len(k), reinterpret_cast<unsigned char*>(region_a(me, k)));
      }
      complete_step({}, half);
      if (b0 == 0) check_arrivals(sig);

      for (int q : peers) wait_done(q, done_);
      for (int64_t k = first_block(me); k < first_block(me + 1); ++k) {
        const int m = len(k);
        decode(w, reinterpret_cast<const unsigned char*>(region_a(0, k)), m, acc);
        for (int q = 1; q < P; ++q) {
          decode(w, reinterpret_cast<const unsigned char*>(region_a(q, k)), m, vals);
          for (int i = 0; i < m; ++i) acc[i] = add_rn(acc[i], vals[i]);
        }
        if (a.op == RedOp::kAvg) {
          for (int i = 0; i < m; ++i) acc[i] = div_rn(acc[i], divisor);
        }
        encode_floats(w, acc, m, reinterpret_cast<unsigned char*>(region_b(me, k)));
      }
      complete_step(peers, half);

      for (int q : peers) wait_done(q, done_);
      for (int c = 0; c < P; ++c) {
        for (int64_t k = first_block(c); k < first_block(c + 1); ++k) {
          T* o = out + (b0 + k) * kB;
          if constexpr (std::is_same_v<T, float>) {
            decode(w, reinterpret_cast<const unsigned char*>(region_b(c, k)), len(k), o);
          } else {
            const int m = len(k);
            decode(w, reinterpret_cast<const unsigned char*>(region_b(c, k)), m, vals);
            for (int i = 0; i < m; ++i) o[i] = from_f<T>(vals[i]);
          }
        }
      }
      complete_step(peers, half);
    }
  });
}

}  // namespace gpucoll::host
