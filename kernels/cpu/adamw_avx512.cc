// AVX-512 AdamW path: 16 elements per iteration, the same operations as
// AdamWElement (Note [AdamW operation order]). The bf16 weight output uses
// vcvtneps2bf16 where the CPU has AVX512_BF16, else the integer rounding.
#pragma GCC optimize("fp-contract=off")  // see adamw_avx2.cc
// GCC 12's AVX-512 headers trip -Wuninitialized on their own _mm512_undefined_*
// (GCC bug 105593, fixed in 12.3/13); nothing in this file is uninitialized.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <immintrin.h>

#include "adamw_impl.h"
#include "adamw_vector_inl.h"
#include "trainstream/kernels/cpu_features.h"

namespace trainstream::kernels::internal {
namespace {

constexpr size_t kLanes = 16;

__m512 LoadHalfWidth(const void* p, DType dtype) {
  const __m256i h = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  if (dtype == DType::kFloat16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

__m512 Load(const void* base, DType dtype, size_t i) {
  if (dtype == DType::kFloat32) return _mm512_loadu_ps(static_cast<const float*>(base) + i);
  return LoadHalfWidth(static_cast<const uint16_t*>(base) + i, dtype);
}

// bf16 round to nearest even (NaN -> 0x7FC0), one per 32-bit lane.
__m512i Bf16RneLanes(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r =
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r,
                                 _mm512_set1_epi32(0x7FC0));
}

__m256i ToBf16Rne(__m512 x) { return _mm512_cvtepi32_epi16(Bf16RneLanes(x)); }

__attribute__((target("avx512bf16"))) __m256i ToBf16RneHardware(__m512 x) {
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
}

__m256i ToBf16Stochastic(__m512 x, __m512i random16) {
  const __m512i u = _mm512_castps_si512(x);
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, random16), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

__m512i LowBias32(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846CA68Bu)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// Split masters (Note [Split master] in bf16.h), as in adamw_avx2.cc. The bf16 half is
// always rounded with integer arithmetic: vcvtneps2bf16 flushes subnormals, and a
// flushed half would no longer decode to the master.
__m512 LoadSplit(const uint16_t* hi, const uint16_t* lo) {
  const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)));
  const __m512i l = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo)));
  const __mmask16 up = _mm512_cmpgt_epu32_mask(l, _mm512_set1_epi32(0x8000));
  const __m512i upper = _mm512_mask_sub_epi32(h, up, h, _mm512_set1_epi32(1));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_slli_epi32(upper, 16), l));
}

void StoreSplit(__m512 x, uint16_t* hi, uint16_t* lo) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i h = Bf16RneLanes(x);
  __m512i l = _mm512_and_si512(u, _mm512_set1_epi32(0xFFFF));
  const __mmask16 tie_up = _mm512_cmpeq_epi32_mask(l, _mm512_set1_epi32(0x8000)) &
                           _mm512_cmpneq_epi32_mask(_mm512_srli_epi32(u, 16), h);
  l = _mm512_mask_or_epi32(l, tie_up, l, _mm512_set1_epi32(1));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), _mm512_cvtepi32_epi16(h));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), _mm512_cvtepi32_epi16(l));
}

struct Consts {
  __m512 grad_scale, decay, lerp_coeff, beta2, one_minus_beta2, eps_scaled, neg_step_scaled;
  __m512i k0;
  explicit Consts(const AdamWStepScalars& s, RngKey key)
      : grad_scale(_mm512_set1_ps(s.grad_scale)),
        decay(_mm512_set1_ps(s.decay)),
        lerp_coeff(_mm512_set1_ps(s.lerp_coeff)),
        beta2(_mm512_set1_ps(s.beta2)),
        one_minus_beta2(_mm512_set1_ps(s.one_minus_beta2)),
        eps_scaled(_mm512_set1_ps(s.eps_scaled)),
        neg_step_scaled(_mm512_set1_ps(s.neg_step_scaled)),
        k0(_mm512_set1_epi32(static_cast<int>(key.k0))) {}
};

template <bool kHardwareBf16, DType kG, DType kM, Out kOut, bool kFromEnd>
inline void Step16(const Pointers& ptr, const Consts& c, uint32_t index, size_t i, bool stream) {
  __m512 g = Load(ptr.grad, kG, i);
  __m512 m = Load(ptr.exp_avg_in, kM, i);
  __m512 v = Load(ptr.exp_avg_sq_in, kM, i);
  __m512 p;
  if constexpr (kOut == Out::kSplit)
    p = LoadSplit(ptr.hi_in + i, ptr.lo_in + i);
  else
    p = _mm512_loadu_ps(ptr.master_in + i);

  g = _mm512_mul_ps(g, c.grad_scale);
  p = _mm512_mul_ps(p, c.decay);
  const __m512 diff = _mm512_sub_ps(g, m);
  m = _mm512_fmadd_ps(c.lerp_coeff, diff, kFromEnd ? g : m);
  v = _mm512_mul_ps(v, c.beta2);
  v = _mm512_add_ps(v, _mm512_mul_ps(_mm512_mul_ps(c.one_minus_beta2, g), g));
  const __m512 denom = _mm512_add_ps(_mm512_sqrt_ps(v), c.eps_scaled);
  p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(c.neg_step_scaled, m), denom));

  if constexpr (kOut != Out::kSplit) _mm512_storeu_ps(ptr.master + i, p);
  if constexpr (kM == DType::kBFloat16) {
    const __m512i idx =
        _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(index + i)),
                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512i bits = LowBias32(_mm512_xor_si512(idx, c.k0));
    const __m512i lo = _mm512_and_si512(bits, _mm512_set1_epi32(0xFFFF));
    const __m512i hi = _mm512_srli_epi32(bits, 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(ptr.exp_avg) + i),
                        ToBf16Stochastic(m, lo));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(ptr.exp_avg_sq) + i),
                        ToBf16Stochastic(v, hi));
  } else {
    _mm512_storeu_ps(static_cast<float*>(ptr.exp_avg) + i, m);
    _mm512_storeu_ps(static_cast<float*>(ptr.exp_avg_sq) + i, v);
  }
  if constexpr (kOut == Out::kNone) {
    return;
  } else if constexpr (kOut == Out::kSplit) {
    StoreSplit(p, static_cast<uint16_t*>(ptr.param_out) + i, ptr.master_lo + i);
  } else if constexpr (kOut == Out::kF32) {
    float* out = static_cast<float*>(ptr.param_out) + i;
    if (stream)
      _mm512_stream_ps(out, p);
    else
      _mm512_storeu_ps(out, p);
  } else {
    __m256i h;
    if constexpr (kOut == Out::kBf16) {
      h = kHardwareBf16 ? ToBf16RneHardware(p) : ToBf16Rne(p);
    } else {
      h = _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    auto* out = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(ptr.param_out) + i);
    if (stream)
      _mm256_stream_si256(out, h);
    else
      _mm256_storeu_si256(out, h);
  }
}

template <bool kHardwareBf16, DType kG, DType kM, Out kOut, bool kFromEnd>
void Update(const AdamWRange& r, const AdamWStepScalars& s, RngKey key, uint32_t index_lo) {
  const Pointers ptr = PointersOf<kOut>(r);
  const Consts c(s, key);
  constexpr size_t kOutBytes = kLanes * (kOut == Out::kF32 ? 4 : 2);
  // A split master's halves are read first: their lines are owned, nothing to stream.
  const bool stream = kOut != Out::kNone && kOut != Out::kSplit &&
                      reinterpret_cast<uintptr_t>(ptr.param_out) % kOutBytes == 0;
  const size_t full = r.numel - r.numel % kLanes;
  // One vector = one 64-byte line of fp32 master per iteration; 2-byte streams
  // get a prefetch every other iteration.
  for (size_t i = 0; i < full; i += kLanes) {
    if (i + kPrefetchElems < r.numel) PrefetchAhead<kG, kM, kOut>(ptr, i + kPrefetchElems);
    Step16<kHardwareBf16, kG, kM, kOut, kFromEnd>(ptr, c, index_lo, i, stream);
  }
  if (stream) _mm_sfence();  // order the streamed stores before completion is signalled

  UpdateTail<kLanes, kG, kM, kOut>(r, ptr, full, [&](const Pointers& local, uint32_t index) {
    Step16<kHardwareBf16, kG, kM, kOut, kFromEnd>(local, c, index_lo + index, 0, false);
  });
}

template <bool kHw, DType kG, DType kM, Out kOut>
void DispatchLerp(const AdamWRange& r, const AdamWStepScalars& s, RngKey key, uint32_t index_lo) {
  if (s.lerp_from_end)
    Update<kHw, kG, kM, kOut, true>(r, s, key, index_lo);
  else
    Update<kHw, kG, kM, kOut, false>(r, s, key, index_lo);
}

template <bool kHw, DType kG, DType kM>
void DispatchOut(const AdamWRange& r, const AdamWStepScalars& s, RngKey key, uint32_t index_lo) {
  if (r.master_lo != nullptr) {
    DispatchLerp<kHw, kG, kM, Out::kSplit>(r, s, key, index_lo);
    return;
  }
  if (r.param_out == nullptr || r.param_out == static_cast<void*>(r.master)) {
    DispatchLerp<kHw, kG, kM, Out::kNone>(r, s, key, index_lo);
    return;
  }
  switch (r.param_dtype) {
    case DType::kFloat32:
      return DispatchLerp<kHw, kG, kM, Out::kF32>(r, s, key, index_lo);
    case DType::kBFloat16:
      return DispatchLerp<kHw, kG, kM, Out::kBf16>(r, s, key, index_lo);
    case DType::kFloat16:
      return DispatchLerp<kHw, kG, kM, Out::kF16>(r, s, key, index_lo);
  }
}

template <bool kHw, DType kG>
void DispatchMoments(const AdamWRange& r, const AdamWStepScalars& s, RngKey key,
                     uint32_t index_lo) {
  if (r.moment_dtype == DType::kBFloat16)
    DispatchOut<kHw, kG, DType::kBFloat16>(r, s, key, index_lo);
  else
    DispatchOut<kHw, kG, DType::kFloat32>(r, s, key, index_lo);
}

template <bool kHw>
void DispatchGrad(const AdamWRange& r, const AdamWStepScalars& s, RngKey key, uint32_t index_lo) {
  switch (r.grad_dtype) {
    case DType::kFloat32:
      return DispatchMoments<kHw, DType::kFloat32>(r, s, key, index_lo);
    case DType::kBFloat16:
      return DispatchMoments<kHw, DType::kBFloat16>(r, s, key, index_lo);
    case DType::kFloat16:
      return DispatchMoments<kHw, DType::kFloat16>(r, s, key, index_lo);
  }
}

}  // namespace

void AdamWUpdateAvx512(const AdamWRange& r, const AdamWStepScalars& s, RngKey key,
                       uint32_t index_lo) {
  static const bool hardware_bf16 = CpuHasAvx512Bf16();
  if (hardware_bf16)
    DispatchGrad<true>(r, s, key, index_lo);
  else
    DispatchGrad<false>(r, s, key, index_lo);
}

double GradSumSquaresAvx512(const void* grad, DType dtype, size_t n) {
  __m512d acc[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(),
                    _mm512_setzero_pd()};
  size_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    const __m512 a = Load(grad, dtype, i), b = Load(grad, dtype, i + kLanes);
    const __m512d a0 = _mm512_cvtps_pd(_mm512_castps512_ps256(a));
    const __m512d a1 =
        _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    const __m512d b0 = _mm512_cvtps_pd(_mm512_castps512_ps256(b));
    const __m512d b1 =
        _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(b), 1)));
    acc[0] = _mm512_fmadd_pd(a0, a0, acc[0]);
    acc[1] = _mm512_fmadd_pd(a1, a1, acc[1]);
    acc[2] = _mm512_fmadd_pd(b0, b0, acc[2]);
    acc[3] = _mm512_fmadd_pd(b1, b1, acc[3]);
  }
  const double sum = _mm512_reduce_add_pd(
      _mm512_add_pd(_mm512_add_pd(acc[0], acc[1]), _mm512_add_pd(acc[2], acc[3])));
  return sum +
         GradSumSquaresScalar(static_cast<const char*>(grad) + i * DTypeSize(dtype), dtype, n - i);
}

}  // namespace trainstream::kernels::internal
