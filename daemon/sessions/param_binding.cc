#include "sessions/param_binding.h"

namespace trainstream::daemon {

SessionOptimizerOptions OptimizerOptionsOf(const v1::RegisterParametersRequest& req) {
  SessionOptimizerOptions o;
  o.moment_dtype = static_cast<wire::DType>(
      req.moment_dtype() == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_FLOAT32 : req.moment_dtype());
  o.max_grad_norm = req.max_grad_norm();
  o.seed = req.seed();
  o.threads = req.threads();
  return o;
}

PlaneRegistration BindRegistration(const v1::RegisterParametersRequest& req,
                                   const RegistrationLayout& layout, char* state_base,
                                   char* staging_base) {
  PlaneRegistration out;
  out.options = OptimizerOptionsOf(req);
  wire::StateManifestEntry* entries = WriteStateManifest(state_base, layout, req);
  for (int i = 0; i < req.params_size(); ++i) {
    const auto& p = req.params(i);
    const ParamPlacement& pl = layout.params[static_cast<size_t>(i)];
    ParamBinding b;
    b.param_id = p.param_id();
    b.name = p.name();
    b.numel = pl.numel;
    b.group = p.group();
    b.param_dtype = static_cast<wire::DType>(p.dtype());
    b.grad_dtype = static_cast<wire::DType>(p.grad_dtype() == v1::DTYPE_UNSPECIFIED ? p.dtype()
                                                                                  : p.grad_dtype());
    b.master = reinterpret_cast<float*>(state_base + pl.master_offset);
    b.exp_avg = state_base + pl.exp_avg_offset;
    b.exp_avg_sq = state_base + pl.exp_avg_sq_offset;
    b.param_slot = staging_base + pl.param_offset;
    b.step_counter = &entries[i].step;
    if (layout.sum_slot) {
      for (uint32_t r = 0; r < layout.grad_slots; ++r)
        b.rank_grads.push_back(staging_base + pl.grad_offset + r * pl.grad_stride);
      b.sum_slot = reinterpret_cast<float*>(staging_base + pl.sum_offset);
    } else {
      b.grad_slot = staging_base + pl.grad_offset;
    }
    out.params.push_back(std::move(b));
  }
  return out;
}

}  // namespace trainstream::daemon
