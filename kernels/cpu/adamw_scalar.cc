// The reference AdamW path: plain C++, one element at a time (adamw_impl.h).
#include "adamw_impl.h"
#include "trainstream/kernels/bf16.h"

namespace trainstream::kernels::internal {
namespace {

float Load(const void* base, DType dtype, size_t i) {
  switch (dtype) {
    case DType::kBFloat16:
      return Bf16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kFloat16:
      return Fp16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kFloat32:
      break;
  }
  return static_cast<const float*>(base)[i];
}

}  // namespace

void AdamWUpdateScalar(const AdamWRange& r, const AdamWStepScalars& s, RngKey key,
                       uint32_t index_lo) {
  const bool bf16_moments = r.moment_dtype == DType::kBFloat16;
  const bool split = r.master_lo != nullptr;
  const bool out_is_master = !split && r.param_out == static_cast<void*>(r.master);
  auto* hi = static_cast<uint16_t*>(r.param_out);
  const AdamWRange::Inputs in = InputsOf(r);
  for (size_t i = 0; i < r.numel; ++i) {
    const float g = Load(r.grad, r.grad_dtype, i);
    float m = Load(in.exp_avg, r.moment_dtype, i);
    float v = Load(in.exp_avg_sq, r.moment_dtype, i);
    float p = split ? SplitMasterDecode(in.master_hi[i], in.master_lo[i]) : in.master[i];
    AdamWElement(g, &p, &m, &v, s);
    if (split)
      SplitMasterEncode(p, &hi[i], &r.master_lo[i]);
    else
      r.master[i] = p;
    if (bf16_moments) {
      const uint32_t bits = CounterRandom(key, index_lo + static_cast<uint32_t>(i));
      static_cast<uint16_t*>(r.exp_avg)[i] = FloatToBf16Stochastic(m, bits);
      static_cast<uint16_t*>(r.exp_avg_sq)[i] = FloatToBf16Stochastic(v, bits >> 16);
    } else {
      static_cast<float*>(r.exp_avg)[i] = m;
      static_cast<float*>(r.exp_avg_sq)[i] = v;
    }
    if (r.param_out == nullptr || out_is_master || split) continue;
    switch (r.param_dtype) {
      case DType::kFloat32:
        static_cast<float*>(r.param_out)[i] = p;
        break;
      case DType::kBFloat16:
        static_cast<uint16_t*>(r.param_out)[i] = FloatToBf16Rne(p);
        break;
      case DType::kFloat16:
        static_cast<uint16_t*>(r.param_out)[i] = FloatToFp16Rne(p);
        break;
    }
  }
}

double GradSumSquaresScalar(const void* grad, DType dtype, size_t n) {
  double sum = 0;
  for (size_t i = 0; i < n; ++i) {
    const double g = Load(grad, dtype, i);
    sum += g * g;
  }
  return sum;
}

}  // namespace trainstream::kernels::internal
