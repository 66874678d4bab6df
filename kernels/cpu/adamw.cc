// AdamW dispatch, per-step scalars and dtype helpers (adamw.h).
#include "trainstream/kernels/adamw.h"

#include <cmath>
#include <cstring>

#include "adamw_impl.h"
#include "trainstream/kernels/bf16.h"
#include "trainstream/kernels/counter_rng.h"

namespace trainstream::kernels {

AdamWStepScalars ComputeAdamWStepScalars(const AdamWHyperParams& hp, uint64_t step,
                                         float grad_scale) {
  // Python floats in torch's _single_tensor_adam are doubles; the CPU kernels
  // then convert each scalar argument to float (Note [AdamW operation order]).
  const double bias_correction1 = 1.0 - std::pow(hp.beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(hp.beta2, static_cast<double>(step));
  const double step_size = hp.lr / bias_correction1;
  const float weight = static_cast<float>(1.0 - hp.beta1);
  AdamWStepScalars s;
  s.grad_scale = grad_scale;
  s.decay = hp.weight_decay != 0 ? static_cast<float>(1.0 - hp.lr * hp.weight_decay) : 1.0f;
  s.lerp_from_end = !(std::fabs(weight) < 0.5f);
  s.lerp_coeff = s.lerp_from_end ? weight - 1.0f : weight;
  s.beta2 = static_cast<float>(hp.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - hp.beta2);
  s.bias_correction2_sqrt = static_cast<float>(std::pow(bias_correction2, 0.5));
  s.eps = static_cast<float>(hp.eps);
  s.neg_step_size = static_cast<float>(-step_size);
  const double bc2_sqrt = std::pow(bias_correction2, 0.5);
  s.eps_scaled = static_cast<float>(hp.eps * bc2_sqrt);
  s.neg_step_scaled = static_cast<float>(-step_size * bc2_sqrt);
  return s;
}

namespace {

internal::UpdateFn UpdateFor(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return internal::AdamWUpdateAvx512;
    case Isa::kAvx2:
      return internal::AdamWUpdateAvx2;
    case Isa::kScalar:
      break;
  }
  return internal::AdamWUpdateScalar;
}

}  // namespace

AdamWRange AdamWRange::Slice(size_t offset, size_t n) const {
  AdamWRange piece = *this;
  piece.numel = n;
  piece.master = master != nullptr ? master + offset : nullptr;
  piece.master_lo = master_lo != nullptr ? master_lo + offset : nullptr;
  piece.exp_avg = static_cast<char*>(exp_avg) + offset * DTypeSize(moment_dtype);
  piece.exp_avg_sq = static_cast<char*>(exp_avg_sq) + offset * DTypeSize(moment_dtype);
  piece.grad = static_cast<const char*>(grad) + offset * DTypeSize(grad_dtype);
  const size_t mb = DTypeSize(moment_dtype);
  if (from.master != nullptr) piece.from.master = from.master + offset;
  if (from.master_hi != nullptr) piece.from.master_hi = from.master_hi + offset;
  if (from.master_lo != nullptr) piece.from.master_lo = from.master_lo + offset;
  if (from.exp_avg != nullptr)
    piece.from.exp_avg = static_cast<const char*>(from.exp_avg) + offset * mb;
  if (from.exp_avg_sq != nullptr)
    piece.from.exp_avg_sq = static_cast<const char*>(from.exp_avg_sq) + offset * mb;
  if (param_out != nullptr) {
    piece.param_out =
        master != nullptr && param_out == static_cast<void*>(master)
            ? static_cast<void*>(piece.master)
            : static_cast<char*>(param_out) +
                  offset * DTypeSize(master_lo != nullptr ? DType::kBFloat16 : param_dtype);
  }
  return piece;
}

void AdamWUpdate(const AdamWRange& range, const AdamWStepScalars& scalars, const RoundingKey& key,
                 Isa isa) {
  const internal::UpdateFn fn = UpdateFor(isa);
  // Split where the element index crosses a multiple of 2^32 so each piece can
  // count its random-number counter in uint32 (counter_rng.h).
  size_t done = 0;
  while (done < range.numel) {
    const uint64_t index = key.element_offset + done;
    const uint64_t to_boundary = (uint64_t{1} << 32) - (index & 0xFFFFFFFFull);
    const size_t n = static_cast<size_t>(
        std::min<uint64_t>(to_boundary, static_cast<uint64_t>(range.numel - done)));
    const AdamWRange piece = range.Slice(done, n);
    const RngKey rng =
        MakeRngKey(key.seed, key.param_key, key.step, static_cast<uint32_t>(index >> 32));
    fn(piece, scalars, rng, static_cast<uint32_t>(index));
    done += n;
  }
}

double GradSumSquares(const void* grad, DType grad_dtype, size_t numel, Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return internal::GradSumSquaresAvx512(grad, grad_dtype, numel);
    case Isa::kAvx2:
      return internal::GradSumSquaresAvx2(grad, grad_dtype, numel);
    case Isa::kScalar:
      break;
  }
  return internal::GradSumSquaresScalar(grad, grad_dtype, numel);
}

void ConvertToFloat(const void* src, DType src_dtype, float* dst, size_t numel) {
  switch (src_dtype) {
    case DType::kFloat32:
      std::memcpy(dst, src, numel * sizeof(float));
      return;
    case DType::kBFloat16: {
      const auto* h = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < numel; ++i) dst[i] = Bf16ToFloat(h[i]);
      return;
    }
    case DType::kFloat16: {
      const auto* h = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < numel; ++i) dst[i] = Fp16ToFloat(h[i]);
      return;
    }
  }
}

void StochasticRoundToBf16(const float* src, uint16_t* dst, size_t numel, const RoundingKey& key,
                           bool use_high_bits) {
  for (size_t i = 0; i < numel; ++i) {
    const uint64_t index = key.element_offset + i;
    const RngKey rng =
        MakeRngKey(key.seed, key.param_key, key.step, static_cast<uint32_t>(index >> 32));
    const uint32_t r = CounterRandom(rng, static_cast<uint32_t>(index));
    dst[i] = FloatToBf16Stochastic(src[i], use_high_bits ? r >> 16 : r);
  }
}

}  // namespace trainstream::kernels
