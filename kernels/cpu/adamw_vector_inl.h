// What the AVX2 and AVX-512 AdamW paths share apart from their vector step: the
// pointer set, the software prefetch of every read stream and the tail. Included by
// adamw_avx2.cc and adamw_avx512.cc, each compiled for its own instruction set, so
// everything here has internal linkage: one TU's copy (which may use AVX-512) can
// never be picked by the linker for the other's.
#pragma once

#include <xmmintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "adamw_impl.h"

namespace trainstream::kernels::internal {
namespace {

// What the kernel writes besides master and moments. kSplit: the master is the bf16
// param_out plus master_lo (Note [Split master] in bf16.h), read and written in place.
enum class Out { kNone, kF32, kBf16, kF16, kSplit };

// What the step writes, then what it reads (AdamWRange::from: the same arrays when
// the update is in place).
struct Pointers {
  float* master;  // kSplit: unused
  void* exp_avg;
  void* exp_avg_sq;
  const void* grad;
  void* param_out;      // kNone: unused
  uint16_t* master_lo;  // kSplit only
  const float* master_in;
  const void* exp_avg_in;
  const void* exp_avg_sq_in;
  const uint16_t* hi_in;  // kSplit only: the old master's halves
  const uint16_t* lo_in;
};

template <Out kOut>
inline Pointers PointersOf(const AdamWRange& r) {
  const AdamWRange::Inputs in = InputsOf(r);
  void* out = kOut == Out::kNone ? nullptr : r.param_out;
  return Pointers{r.master,  r.exp_avg,  r.exp_avg_sq,  r.grad,       out,         r.master_lo,
                  in.master, in.exp_avg, in.exp_avg_sq, in.master_hi, in.master_lo};
}

// Software prefetch distance in elements (1 KiB of fp32 master; the other streams
// follow proportionally). The hardware prefetchers stop at 4 KiB page boundaries; with
// five or six concurrent streams per core a software prefetch ~1 KiB ahead keeps the
// line fill buffers busy across them.
constexpr size_t kPrefetchElems = 256;

// Prefetches element j of every stream the step reads. Called once per 16 elements:
// a 4-byte stream's 64-byte line each time, a 2-byte stream's every other time.
template <DType kG, DType kM, Out kOut>
inline void PrefetchAhead(const Pointers& ptr, size_t j) {
  constexpr size_t kGB = kG == DType::kFloat32 ? 4 : 2;
  constexpr size_t kMB = kM == DType::kFloat32 ? 4 : 2;
  if constexpr (kOut == Out::kSplit) {
    if (j % 32 == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(ptr.lo_in + j), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(ptr.hi_in + j), _MM_HINT_T0);
    }
  } else {
    _mm_prefetch(reinterpret_cast<const char*>(ptr.master_in + j), _MM_HINT_T0);
  }
  if (kMB == 4 || j % 32 == 0) {
    _mm_prefetch(static_cast<const char*>(ptr.exp_avg_in) + j * kMB, _MM_HINT_T0);
    _mm_prefetch(static_cast<const char*>(ptr.exp_avg_sq_in) + j * kMB, _MM_HINT_T0);
  }
  if (kGB == 4 || j % 32 == 0) {
    _mm_prefetch(static_cast<const char*>(ptr.grad) + j * kGB, _MM_HINT_T0);
  }
}

// The last r.numel - full (< kLanes) elements go through the same vector step on
// zero-padded copies: step(local, index) updates kLanes elements of `local` starting
// at element 0, `index` being the first one's index in the range (for the stochastic
// rounding keys).
template <size_t kLanes, DType kG, DType kM, Out kOut, typename StepFn>
inline void UpdateTail(const AdamWRange& r, const Pointers& ptr, size_t full, StepFn step) {
  const size_t tail = r.numel - full;
  if (tail == 0) return;
  constexpr size_t kGB = kG == DType::kFloat32 ? 4 : 2;
  constexpr size_t kMB = kM == DType::kFloat32 ? 4 : 2;
  alignas(64) float master[kLanes] = {};
  alignas(64) float m[kLanes] = {}, v[kLanes] = {}, g[kLanes] = {}, out[kLanes] = {};
  alignas(64) uint16_t lo[kLanes] = {};
  const size_t ps = kOut == Out::kF32 ? 4 : 2;
  constexpr bool kSplit = kOut == Out::kSplit;
  if constexpr (kSplit) {
    std::memcpy(out, ptr.hi_in + full, tail * 2);
    std::memcpy(lo, ptr.lo_in + full, tail * 2);
  } else {
    std::memcpy(master, ptr.master_in + full, tail * 4);
  }
  std::memcpy(m, static_cast<const char*>(ptr.exp_avg_in) + full * kMB, tail * kMB);
  std::memcpy(v, static_cast<const char*>(ptr.exp_avg_sq_in) + full * kMB, tail * kMB);
  std::memcpy(g, static_cast<const char*>(r.grad) + full * kGB, tail * kGB);
  const Pointers local{master, m, v, g, out, lo, master, m, v, reinterpret_cast<uint16_t*>(out),
                       lo};
  step(local, static_cast<uint32_t>(full));
  if constexpr (kSplit) {
    std::memcpy(static_cast<char*>(ptr.param_out) + full * 2, out, tail * 2);
    std::memcpy(ptr.master_lo + full, lo, tail * 2);
  } else {
    std::memcpy(ptr.master + full, master, tail * 4);
  }
  std::memcpy(static_cast<char*>(ptr.exp_avg) + full * kMB, m, tail * kMB);
  std::memcpy(static_cast<char*>(ptr.exp_avg_sq) + full * kMB, v, tail * kMB);
  if constexpr (kOut != Out::kNone && !kSplit) {
    std::memcpy(static_cast<char*>(ptr.param_out) + full * ps, out, tail * ps);
  }
}

}  // namespace
}  // namespace trainstream::kernels::internal
