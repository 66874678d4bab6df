// Counter-based random bits for stochastic rounding: a keyed hash of the element
// index, so the bits depend only on (seed, parameter key, step, element index) and
// never on thread count, chunking or ISA path.
//
// Note [Why a hash and not Philox]: Philox4x32-10 costs 20 32x32->64 multiplies
// per 128 bits; the AdamW kernel needs 32 bits per element (16 per bf16 moment)
// and must stay memory-bound, so it uses one application of the "lowbias32"
// integer hash (Wellons; two multiply-xorshift rounds, bias 0.17 of the best
// known 2-round hash's search, a bijection of uint32) to the element index xored
// with a per-(seed, parameter, step) key: 2 multiplies per element. The key
// itself comes from SplitMix64, so consecutive steps see unrelated bit streams.
// Stochastic rounding only needs the low and high 16 bits uniform and
// independent of the value being rounded, which the tests check (unbiasedness
// over many roundings, reproducibility, different bits for different seeds).
#pragma once

#include <cstdint>

#include "trainstream/kernels/host_device.h"

namespace trainstream::kernels {

inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

TS_HOST_DEVICE inline uint32_t LowBias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// Per-call key for elements whose index has high 32 bits `index_hi`.
struct RngKey {
  uint32_t k0;
  uint32_t k1;
};

inline RngKey MakeRngKey(uint64_t seed, uint64_t param_key, uint64_t step, uint32_t index_hi) {
  uint64_t k = SplitMix64(seed ^ SplitMix64(param_key ^ SplitMix64(step ^ SplitMix64(index_hi))));
  return RngKey{static_cast<uint32_t>(k), static_cast<uint32_t>(k >> 32)};
}

// 32 random bits for element `index_lo`: low 16 for exp_avg, high 16 for exp_avg_sq.
// (k1 is not used by the hash: the xor with k0 then a bijection already gives
// every key its own stream.)
TS_HOST_DEVICE inline uint32_t CounterRandom(RngKey key, uint32_t index_lo) {
  return LowBias32(index_lo ^ key.k0);
}

}  // namespace trainstream::kernels
