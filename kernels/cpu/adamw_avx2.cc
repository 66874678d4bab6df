// AVX2 + FMA + F16C AdamW path: 8 elements per iteration, the same operations as
// AdamWElement (Note [AdamW operation order]) so results match the scalar path.
//
// GCC lowers _mm256_mul_ps/_mm256_add_ps to plain vector arithmetic and would
// contract them into FMAs, changing rounding; contraction is off for this file.
#pragma GCC optimize("fp-contract=off")

#include <immintrin.h>

#include "adamw_impl.h"
#include "adamw_vector_inl.h"

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

// bf16 round to nearest even (NaN -> 0x7FC0), one per 32-bit lane.
__m256i Bf16RneLanes(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), NanMask(x));
}

__m128i ToBf16Rne(__m256 x) { return Narrow(Bf16RneLanes(x)); }

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

// Eight split masters (Note [Split master]) -> fp32: upper half hi, less one where lo
// says rounding went up.
__m256 LoadSplit(const uint16_t* hi, const uint16_t* lo) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)));
  const __m256i l = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo)));
  const __m256i up = _mm256_cmpgt_epi32(l, _mm256_set1_epi32(0x8000));  // -1 where rounded up
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_slli_epi32(_mm256_add_epi32(h, up), 16), l));
}

void StoreSplit(__m256 x, uint16_t* hi, uint16_t* lo) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i h = Bf16RneLanes(x);
  __m256i l = _mm256_and_si256(u, _mm256_set1_epi32(0xFFFF));
  // A tie that rounded up has no code of its own: one ulp further out (lo 0x8001).
  const __m256i tie_up = _mm256_andnot_si256(_mm256_cmpeq_epi32(_mm256_srli_epi32(u, 16), h),
                                             _mm256_cmpeq_epi32(l, _mm256_set1_epi32(0x8000)));
  l = _mm256_or_si256(l, _mm256_and_si256(tie_up, _mm256_set1_epi32(1)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), Narrow(h));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), Narrow(l));
}

// Scalars broadcast once per call, not once per vector.
struct Consts {
  __m256 grad_scale, decay, lerp_coeff, beta2, one_minus_beta2, eps_scaled, neg_step_scaled;
  __m256i k0;
  explicit Consts(const AdamWStepScalars& s, RngKey key)
      : grad_scale(_mm256_set1_ps(s.grad_scale)),
        decay(_mm256_set1_ps(s.decay)),
        lerp_coeff(_mm256_set1_ps(s.lerp_coeff)),
        beta2(_mm256_set1_ps(s.beta2)),
        one_minus_beta2(_mm256_set1_ps(s.one_minus_beta2)),
        eps_scaled(_mm256_set1_ps(s.eps_scaled)),
        neg_step_scaled(_mm256_set1_ps(s.neg_step_scaled)),
        k0(_mm256_set1_epi32(static_cast<int>(key.k0))) {}
};

// One vector of elements [i, i + 8), specialised for its dtypes (no per-vector
// branches). `stream` stores param_out non-temporally: it is write-only here, so
// streaming saves the read-for-ownership of its lines.
template <DType kG, DType kM, Out kOut, bool kFromEnd>
inline void Step8(const Pointers& ptr, const Consts& c, uint32_t index, size_t i, bool stream) {
  __m256 g = Load(ptr.grad, kG, i);
  __m256 m = Load(ptr.exp_avg_in, kM, i);
  __m256 v = Load(ptr.exp_avg_sq_in, kM, i);
  __m256 p;
  if constexpr (kOut == Out::kSplit)
    p = LoadSplit(ptr.hi_in + i, ptr.lo_in + i);
  else
    p = _mm256_loadu_ps(ptr.master_in + i);

  g = _mm256_mul_ps(g, c.grad_scale);
  p = _mm256_mul_ps(p, c.decay);
  const __m256 diff = _mm256_sub_ps(g, m);
  m = _mm256_fmadd_ps(c.lerp_coeff, diff, kFromEnd ? g : m);
  v = _mm256_mul_ps(v, c.beta2);
  v = _mm256_add_ps(v, _mm256_mul_ps(_mm256_mul_ps(c.one_minus_beta2, g), g));
  const __m256 denom = _mm256_add_ps(_mm256_sqrt_ps(v), c.eps_scaled);
  p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(c.neg_step_scaled, m), denom));

  if constexpr (kOut != Out::kSplit) _mm256_storeu_ps(ptr.master + i, p);
  if constexpr (kM == DType::kBFloat16) {
    const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(index + i)),
                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i bits = LowBias32(_mm256_xor_si256(idx, c.k0));
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
  if constexpr (kOut == Out::kNone) {
    return;
  } else if constexpr (kOut == Out::kSplit) {
    StoreSplit(p, static_cast<uint16_t*>(ptr.param_out) + i, ptr.master_lo + i);
  } else if constexpr (kOut == Out::kF32) {
    float* out = static_cast<float*>(ptr.param_out) + i;
    if (stream)
      _mm256_stream_ps(out, p);
    else
      _mm256_storeu_ps(out, p);
  } else {
    const __m128i h = kOut == Out::kBf16
                          ? ToBf16Rne(p)
                          : _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    auto* out = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(ptr.param_out) + i);
    if (stream)
      _mm_stream_si128(out, h);
    else
      _mm_storeu_si128(out, h);
  }
}

template <DType kG, DType kM, Out kOut, bool kFromEnd>
void Update(const AdamWRange& r, const AdamWStepScalars& s, RngKey key, uint32_t index_lo) {
  const Pointers ptr = PointersOf<kOut>(r);
  const Consts c(s, key);
  constexpr size_t kOutBytes = kLanes * (kOut == Out::kF32 ? 4 : 2);
  // A split master's halves are read first: their lines are owned, nothing to stream.
  const bool stream = kOut != Out::kNone && kOut != Out::kSplit &&
                      reinterpret_cast<uintptr_t>(ptr.param_out) % kOutBytes == 0;
  const size_t full = r.numel - r.numel % kLanes;
  size_t i = 0;
  // Two vectors (one 64-byte line of fp32 master) per iteration, prefetching
  // the lines kPrefetchElems ahead of each read stream.
  for (; i + 2 * kLanes <= full; i += 2 * kLanes) {
    if (i + kPrefetchElems < r.numel) PrefetchAhead<kG, kM, kOut>(ptr, i + kPrefetchElems);
    Step8<kG, kM, kOut, kFromEnd>(ptr, c, index_lo, i, stream);
    Step8<kG, kM, kOut, kFromEnd>(ptr, c, index_lo, i + kLanes, stream);
  }
  for (; i < full; i += kLanes) Step8<kG, kM, kOut, kFromEnd>(ptr, c, index_lo, i, stream);
  if (stream) _mm_sfence();  // order the streamed stores before completion is signalled

  UpdateTail<kLanes, kG, kM, kOut>(r, ptr, full, [&](const Pointers& local, uint32_t index) {
    Step8<kG, kM, kOut, kFromEnd>(local, c, index_lo + index, 0, false);
  });
}

template <DType kG, DType kM, Out kOut>
void DispatchLerp(const AdamWRange& r, const AdamWStepScalars& s, RngKey key, uint32_t index_lo) {
  if (s.lerp_from_end)
    Update<kG, kM, kOut, true>(r, s, key, index_lo);
  else
    Update<kG, kM, kOut, false>(r, s, key, index_lo);
}

template <DType kG, DType kM>
void DispatchOut(const AdamWRange& r, const AdamWStepScalars& s, RngKey key, uint32_t index_lo) {
  if (r.master_lo != nullptr) {
    DispatchLerp<kG, kM, Out::kSplit>(r, s, key, index_lo);
    return;
  }
  if (r.param_out == nullptr || r.param_out == static_cast<void*>(r.master)) {
    DispatchLerp<kG, kM, Out::kNone>(r, s, key, index_lo);
    return;
  }
  switch (r.param_dtype) {
    case DType::kFloat32:
      return DispatchLerp<kG, kM, Out::kF32>(r, s, key, index_lo);
    case DType::kBFloat16:
      return DispatchLerp<kG, kM, Out::kBf16>(r, s, key, index_lo);
    case DType::kFloat16:
      return DispatchLerp<kG, kM, Out::kF16>(r, s, key, index_lo);
  }
}

template <DType kG>
void DispatchMoments(const AdamWRange& r, const AdamWStepScalars& s, RngKey key,
                     uint32_t index_lo) {
  if (r.moment_dtype == DType::kBFloat16)
    DispatchOut<kG, DType::kBFloat16>(r, s, key, index_lo);
  else
    DispatchOut<kG, DType::kFloat32>(r, s, key, index_lo);
}

}  // namespace

void AdamWUpdateAvx2(const AdamWRange& r, const AdamWStepScalars& s, RngKey key,
                     uint32_t index_lo) {
  switch (r.grad_dtype) {
    case DType::kFloat32:
      return DispatchMoments<DType::kFloat32>(r, s, key, index_lo);
    case DType::kBFloat16:
      return DispatchMoments<DType::kBFloat16>(r, s, key, index_lo);
    case DType::kFloat16:
      return DispatchMoments<DType::kFloat16>(r, s, key, index_lo);
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
  _mm256_store_pd(lanes,
                  _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3])));
  double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  return sum +
         GradSumSquaresScalar(static_cast<const char*>(grad) + i * DTypeSize(dtype), dtype, n - i);
}

}  // namespace trainstream::kernels::internal
