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

void BindMaster(ParamBinding* b, wire::MasterLayout layout, char* state_base,
                uint64_t master_offset) {
  switch (layout) {
    case wire::MasterLayout::kFp32:
      b->master = reinterpret_cast<float*>(state_base + master_offset);
      b->master_lo = nullptr;
      return;
    case wire::MasterLayout::kSplitBf16:
      b->master = nullptr;
      b->master_lo = reinterpret_cast<uint16_t*>(state_base + master_offset);
      return;
    case wire::MasterLayout::kWeightSlot:
      b->master = static_cast<float*>(b->param_slot);
      b->master_lo = nullptr;
      return;
  }
}

optimizer::DurableRecords DurableRecordsOf(char* state_base, uint64_t recovery_offset,
                                           uint64_t entry_step_offset, uint64_t index) {
  optimizer::DurableRecords d;
  d.torch_step = reinterpret_cast<uint64_t*>(state_base + entry_step_offset);
  if (recovery_offset == 0) return d;
  auto* h = reinterpret_cast<wire::RecoveryHeader*>(state_base + recovery_offset);
  auto* records = reinterpret_cast<wire::ParamRecord*>(state_base + h->records_offset);
  auto* progress = reinterpret_cast<wire::ChunkProgress*>(state_base + h->progress_offset);
  d.record = &records[index];
  d.progress = progress + d.record->chunk_first;
  d.entry = index;
  d.journal = state_base + h->journal_offset;
  d.journal_slot_bytes = h->journal_slot_bytes;
  d.journal_slots = h->journal_slots;
  d.header = h;
  return d;
}

PlaneRegistration BindRegistration(const v1::RegisterParametersRequest& req,
                                   const RegistrationLayout& layout, char* state_base,
                                   char* staging_base, const RecoveryOwner* owner) {
  PlaneRegistration out;
  out.options = OptimizerOptionsOf(req);
  wire::StateManifestEntry* entries = WriteStateManifest(state_base, layout, req, owner);
  const uint64_t recovery_offset = owner != nullptr ? layout.recovery_offset : 0;
  if (layout.grad_pool_bytes != 0) {
    out.pool = std::make_unique<GradientPool>(staging_base, layout.grad_pool_offset,
                                              layout.grad_pool_bytes, /*fresh=*/true);
  }
  for (int i = 0; i < req.params_size(); ++i) {
    const auto& p = req.params(i);
    const ParamPlacement& pl = layout.params[static_cast<size_t>(i)];
    ParamBinding b;
    b.param_id = p.param_id();
    b.name = p.name();
    b.numel = pl.numel;
    b.group = p.group();
    b.param_dtype = static_cast<wire::DType>(p.dtype());
    b.grad_dtype = static_cast<wire::DType>(
        p.grad_dtype() == v1::DTYPE_UNSPECIFIED ? p.dtype() : p.grad_dtype());
    b.param_slot = staging_base + pl.param_offset;
    BindMaster(&b, pl.master_layout, state_base, pl.master_offset);
    b.exp_avg = state_base + pl.exp_avg_offset;
    b.exp_avg_sq = state_base + pl.exp_avg_sq_offset;
    b.durable = DurableRecordsOf(
        state_base, recovery_offset,
        static_cast<uint64_t>(reinterpret_cast<char*>(&entries[i].step) - state_base),
        static_cast<uint64_t>(i));
    if (layout.sum_slot) {
      for (uint32_t r = 0; r < layout.grad_slots; ++r)
        b.rank_grads.push_back(staging_base + pl.grad_offset + r * pl.grad_stride);
      b.sum_slot = reinterpret_cast<float*>(staging_base + pl.sum_offset);
    } else if (out.pool != nullptr) {
      b.pool = out.pool.get();
    } else {
      b.grad_slot = staging_base + pl.grad_offset;
    }
    out.params.push_back(std::move(b));
  }
  return out;
}

}  // namespace trainstream::daemon
