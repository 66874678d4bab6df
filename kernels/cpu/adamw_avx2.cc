// AVX2 + FMA + F16C AdamW path: 8 elements per iteration, the same operations as
// AdamWElement (Note [AdamW operation order]) so results match the scalar path.
//
// GCC lowers _mm256_mul_ps/_mm256_add_ps to plain vector arithmetic and would
// contract them into FMAs, changing rounding; contraction is off for this file.
#pragma GCC optimize("fp-contract=off")

#include <immintrin.h>

#include <cstring>

#include "adamw_impl.h"

namespace trainstream::kernels::internal {
namespace {

constexpr size_t kLanes = 8;

__m256 LoadHalfWidth(const void* p, DType dtype) {
  const __m128i h = _mm_loadu_si128(static_cast<const __m128i*>(p));
  if (dtype == DType::kFloat16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

__m256 Load(const void* base, DType dtype, size_t i) {
  if (dtype == DType::kFloat32) return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  return LoadHalfWidth(static_cast<const uint16_t*>(base) + i, dtype);
}

// Eight 32-bit lanes holding values < 2^16 -> eight uint16.
__m128i Narrow(__m256i x) {
  return _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
}

__m256i NanMask(__m256 x) { return _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)); }

__m128i ToBf16Rne(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), NanMask(x));
  return Narrow(r);
}

__m128i ToBf16Stochastic(__m256 x, __m256i random16) {
  const __m256i u = _mm256_castps_si256(x);
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, random16), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), NanMask(x));
  return Narrow(r);
}

__m256i LowBias32(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7FEB352D));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846CA68Bu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

struct Pointers {
  float* master;
  void* exp_avg;
  void* exp_avg_sq;
  const void* grad;
  void* param_out;  // null: no separate output
};

// One vector of elements [i, i + 8). `stream` stores param_out non-temporally:
// it is write-only here, so streaming saves the read-for-ownership of its lines.
inline void Step8(const Pointers& ptr, const AdamWRange& r, const AdamWStepScalars& s, RngKey key,
                  uint32_t index, size_t i, bool stream) {
  __m256 g = Load(ptr.grad, r.grad_dtype, i);
  __m256 m = Load(ptr.exp_avg, r.moment_dtype, i);
  __m256 v = Load(ptr.exp_avg_sq, r.moment_dtype, i);
  __m256 p = _mm256_loadu_ps(ptr.master + i);

  g = _mm256_mul_ps(g, _mm256_set1_ps(s.grad_scale));
  p = _mm256_mul_ps(p, _mm256_set1_ps(s.decay));
  const __m256 diff = _mm256_sub_ps(g, m);
  m = _mm256_fmadd_ps(_mm256_set1_ps(s.lerp_coeff), diff, s.lerp_from_end ? g : m);
  v = _mm256_mul_ps(v, _mm256_set1_ps(s.beta2));
  v = _mm256_add_ps(v, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(s.one_minus_beta2), g), g));
  const __m256 denom = _mm256_add_ps(
      _mm256_div_ps(_mm256_sqrt_ps(v), _mm256_set1_ps(s.bias_correction2_sqrt)),
      _mm256_set1_ps(s.eps));
  p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(s.neg_step_size), m), denom));

  _mm256_storeu_ps(ptr.master + i, p);
  if (r.moment_dtype == DType::kBFloat16) {
    const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(index + i)),
                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i k0 = _mm256_set1_epi32(static_cast<int>(key.k0));
    const __m256i k1 = _mm256_set1_epi32(static_cast<int>(key.k1));
    const __m256i bits = LowBias32(_mm256_xor_si256(LowBias32(_mm256_xor_si256(idx, k0)), k1));
    const __m256i lo = _mm256_and_si256(bits, _mm256_set1_epi32(0xFFFF));
    const __m256i hi = _mm256_srli_epi32(bits, 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(ptr.exp_avg) + i),
                     ToBf16Stochastic(m, lo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(ptr.exp_avg_sq) + i),
                     ToBf16Stochastic(v, hi));
  } else {
    _mm256_storeu_ps(static_cast<float*>(ptr.exp_avg) + i, m);
    _mm256_storeu_ps(static_cast<float*>(ptr.exp_avg_sq) + i, v);
  }
  if (ptr.param_out == nullptr) return;
  if (r.param_dtype == DType::kFloat32) {
    float* out = static_cast<float*>(ptr.param_out) + i;
    if (stream) _mm256_stream_ps(out, p);
    else _mm256_storeu_ps(out, p);
    return;
  }
  const __m128i h = r.param_dtype == DType::kBFloat16
                        ? ToBf16Rne(p)
                        : _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  auto* out = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(ptr.param_out) + i);
  if (stream) _mm_stream_si128(out, h);
  else _mm_storeu_si128(out, h);
}

}  // namespace

void AdamWUpdateAvx2(const AdamWRange& r, const AdamWStepScalars& s, RngKey key,
                     uint32_t index_lo) {
  const bool out_is_master = r.param_out == static_cast<void*>(r.master);
  Pointers ptr{r.master, r.exp_avg, r.exp_avg_sq, r.grad, out_is_master ? nullptr : r.param_out};
  const size_t out_bytes = kLanes * DTypeSize(r.param_dtype);
  const bool stream =
      ptr.param_out != nullptr && reinterpret_cast<uintptr_t>(ptr.param_out) % out_bytes == 0;
  const size_t full = r.numel - r.numel % kLanes;
  for (size_t i = 0; i < full; i += kLanes) Step8(ptr, r, s, key, index_lo, i, stream);
  if (stream) _mm_sfence();  // order the streamed stores before completion is signalled

  const size_t tail = r.numel - full;
  if (tail == 0) return;
  // The last < 8 elements go through the same vector code on zero-padded copies.
  alignas(32) float master[kLanes] = {};
  alignas(32) float m[kLanes] = {}, v[kLanes] = {}, g[kLanes] = {}, out[kLanes] = {};
  const size_t ms = DTypeSize(r.moment_dtype), gs = DTypeSize(r.grad_dtype),
               ps = DTypeSize(r.param_dtype);
  std::memcpy(master, r.master + full, tail * 4);
  std::memcpy(m, static_cast<char*>(r.exp_avg) + full * ms, tail * ms);
  std::memcpy(v, static_cast<char*>(r.exp_avg_sq) + full * ms, tail * ms);
  std::memcpy(g, static_cast<const char*>(r.grad) + full * gs, tail * gs);
  Pointers local{master, m, v, g, ptr.param_out != nullptr ? out : nullptr};
  Step8(local, r, s, key, index_lo + static_cast<uint32_t>(full), 0, false);
  std::memcpy(r.master + full, master, tail * 4);
  std::memcpy(static_cast<char*>(r.exp_avg) + full * ms, m, tail * ms);
  std::memcpy(static_cast<char*>(r.exp_avg_sq) + full * ms, v, tail * ms);
  if (ptr.param_out != nullptr) {
    std::memcpy(static_cast<char*>(ptr.param_out) + full * ps, out, tail * ps);
  }
}

double GradSumSquaresAvx2(const void* grad, DType dtype, size_t n) {
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                    _mm256_setzero_pd()};
  size_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    const __m256 a = Load(grad, dtype, i), b = Load(grad, dtype, i + kLanes);
    const __m256d a0 = _mm256_cvtps_pd(_mm256_castps256_ps128(a));
    const __m256d a1 = _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1));
    const __m256d b0 = _mm256_cvtps_pd(_mm256_castps256_ps128(b));
    const __m256d b1 = _mm256_cvtps_pd(_mm256_extractf128_ps(b, 1));
    acc[0] = _mm256_fmadd_pd(a0, a0, acc[0]);
    acc[1] = _mm256_fmadd_pd(a1, a1, acc[1]);
    acc[2] = _mm256_fmadd_pd(b0, b0, acc[2]);
    acc[3] = _mm256_fmadd_pd(b1, b1, acc[3]);
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3])));
  double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  return sum + GradSumSquaresScalar(static_cast<const char*>(grad) + i * DTypeSize(dtype), dtype,
                                    n - i);
}

}  // namespace trainstream::kernels::internal
