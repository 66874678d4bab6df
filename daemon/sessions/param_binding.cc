#include "sessions/param_binding.h"

#include <cstddef>

#include "trainstream/wire/segment_header.h"

namespace trainstream::daemon {
namespace {

// Points b's master where `layout` keeps it (Note [One host copy of a trained
// weight], trainstream/wire/segment_header.h), its param_slot set first.
void BindMaster(ParamBinding* b, wire::MasterLayout layout, char* state_base,
                uint64_t master_offset) {
  if (layout == wire::MasterLayout::kFp32)
    b->master = reinterpret_cast<float*>(state_base + master_offset);
  if (layout == wire::MasterLayout::kSplitBf16)
    b->master_lo = reinterpret_cast<uint16_t*>(state_base + master_offset);
  if (layout == wire::MasterLayout::kWeightSlot) b->master = static_cast<float*>(b->param_slot);
}

// The engine's records of manifest entry `index` (all null without recovery).
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

template <class Response>
void FillLayout(const Registration& r, int32_t local_rank, Response* out) {
  const StateSegmentView& v = r.view;
  v1::Region* region = out->mutable_staging();
  region->set_segment_name(r.staging->name());
  region->set_offset(wire::kSegmentHeaderBytes);
  region->set_length(r.staging->size() - wire::kSegmentHeaderBytes);
  region->set_segment_size(r.staging->size());
  region->set_kind(v1::SEGMENT_KIND_SESSION);
  out->set_grad_pool_offset(v.grad_pool_offset);
  out->set_grad_pool_bytes(v.grad_pool_bytes);
  const auto rank = static_cast<uint64_t>(local_rank);
  for (const CheckedParam& p : v.params) {
    auto* slot = out->add_slots();
    slot->set_param_id(p.param_id);
    if (v.group_ranks != 0) {
      slot->set_grad_offset(p.rank_grad_offset + rank * p.rank_grad_stride);
      slot->set_sum_offset(p.grad_offset);
    } else {
      slot->set_grad_offset(v.grad_pool_bytes != 0 ? 0 : p.grad_offset);
    }
    slot->set_param_offset(p.param_offset);
    slot->set_numel(p.numel);
  }
}

}  // namespace

Status CreateRegistration(const StateMemory& memory, const v1::RegisterParametersRequest& req,
                          uint32_t group_ranks, const SegmentOwner& owner, RecoveryOwner client,
                          const std::string& who, Registration* out) {
  const RegistrationLayout layout = ComputeRegistrationLayout(
      req, group_ranks == 0 ? 1 : group_ranks, group_ranks != 0, memory.recovery);
  Status st = memory.create(v1::SEGMENT_KIND_STATE, layout.state_bytes, "optimizer state of " + who,
                            owner, &out->state);
  if (!st.ok()) return st;
  st = memory.create(
      v1::SEGMENT_KIND_SESSION, layout.staging_bytes,
      (layout.grad_pool_bytes != 0 ? "gradient pool and weight slots of " : "staging slots of ") +
          who,
      owner, &out->staging);
  if (!st.ok()) {
    DropRegistration(memory, *out);
    return st;
  }
  client.staging_name = out->staging->name();
  client.staging_bytes = out->staging->size();
  out->view =
      WriteState(out->state->base(), layout, req, memory.recovery.enabled ? &client : nullptr);
  return Status::Ok();
}

StateSegmentView WriteState(char* state_base, const RegistrationLayout& layout,
                            const v1::RegisterParametersRequest& req, const RecoveryOwner* owner) {
  WriteStateManifest(state_base, layout, req, owner);
  StateSegmentView v;
  v.moment_dtype = static_cast<wire::DType>(MomentDType(req));
  v.seed = req.seed();
  v.max_grad_norm = req.max_grad_norm();
  v.threads = req.threads();
  v.recovery_offset = owner != nullptr ? layout.recovery_offset : 0;
  v.group_ranks = layout.sum_slot ? layout.grad_slots : 0;
  v.grad_pool_offset = layout.grad_pool_offset;
  v.grad_pool_bytes = layout.grad_pool_bytes;
  const uint64_t entries = layout.manifest_offset + sizeof(wire::StateManifest);
  for (int i = 0; i < req.params_size(); ++i) {
    const v1::ParameterSpec& s = req.params(i);
    const ParamPlacement& pl = layout.params[static_cast<size_t>(i)];
    CheckedParam p;  // as WriteStateManifest wrote its entry and record
    p.param_id = s.param_id();
    p.name = s.name();
    p.numel = pl.numel;
    p.group = s.group();
    p.dtype = static_cast<wire::DType>(s.dtype());
    p.rank_grad_dtype = static_cast<wire::DType>(GradDType(s));
    p.grad_dtype = layout.sum_slot ? wire::DType::kFloat32 : p.rank_grad_dtype;
    p.master_layout = pl.master_layout;
    p.master_offset = pl.master_offset;
    p.exp_avg_offset = pl.exp_avg_offset;
    p.exp_avg_sq_offset = pl.exp_avg_sq_offset;
    p.rank_grad_offset = layout.grad_pool_bytes != 0 ? layout.grad_pool_offset : pl.grad_offset;
    p.rank_grad_stride = pl.grad_stride;
    p.grad_offset = layout.sum_slot ? pl.sum_offset : p.rank_grad_offset;
    p.param_offset = pl.param_offset;
    p.chunk_first = pl.chunk_first;
    p.chunks = pl.chunks;
    p.step_offset = entries + static_cast<uint64_t>(i) * sizeof(wire::StateManifestEntry) +
                    offsetof(wire::StateManifestEntry, step);
    v.params.push_back(std::move(p));
  }
  return v;
}

Registration ResumeRegistration(AdoptedRegistration adopted, const wire::StepRecord& done,
                                uint32_t group_ranks) {
  Registration r;
  r.state = std::move(adopted.state);
  r.staging = std::move(adopted.staging);
  r.view = std::move(adopted.view);
  r.view.group_ranks = group_ranks;  // the caller's kind decides how it is bound
  r.report = std::move(adopted.report);
  r.adopted = true;
  for (size_t i = 0; i < r.view.params.size(); ++i) {
    // An update that landed in a step whose STEP_DONE never went out: its
    // norm belongs to that step, which the client ends again.
    const ParamOutcome& o = r.report.params[i];
    const uint64_t marked = r.view.records[i].mark.load() >> 2;
    if (o.applied_step > done.completed_step && marked == o.applied_step)
      r.carried.push_back({o.applied_step, o.param_id, o.grad_sumsq, !o.skipped});
  }
  return r;
}

void SetOwner(Registration& r, uint64_t session_id, pid_t pid, uint64_t start) {
  r.view.recovery->owner_pid = static_cast<int32_t>(pid);
  r.view.recovery->owner_start = start;
  r.state->SetOwner(session_id);
  r.staging->SetOwner(session_id);
}

void DropRegistration(const StateMemory& memory, Registration& r) {
  memory.drop(std::move(r.staging));
  memory.drop(std::move(r.state));
}

PlaneRegistration BindState(Registration& r) {
  PlaneRegistration out = BindState(r.view, r.state->base(), r.staging->base(), r.adopted);
  out.carried = std::move(r.carried);
  return out;
}

PlaneRegistration BindState(const StateSegmentView& v, char* state_base, char* staging_base,
                            bool adopted) {
  PlaneRegistration out;
  out.options = SessionOptimizerOptions{v.moment_dtype, v.max_grad_norm, v.seed, v.threads};
  out.adopted = adopted;
  if (v.grad_pool_bytes != 0) {
    out.pool = std::make_unique<GradientPool>(staging_base, v.grad_pool_offset, v.grad_pool_bytes,
                                              /*fresh=*/!adopted);
  }
  for (size_t i = 0; i < v.params.size(); ++i) {
    const CheckedParam& p = v.params[i];
    ParamBinding b;
    b.param_id = p.param_id;
    b.name = p.name;
    b.numel = p.numel;
    b.group = p.group;
    b.param_dtype = p.dtype;
    b.param_slot = staging_base + p.param_offset;
    BindMaster(&b, p.master_layout, state_base, p.master_offset);
    b.exp_avg = state_base + p.exp_avg_offset;
    b.exp_avg_sq = state_base + p.exp_avg_sq_offset;
    b.durable = DurableRecordsOf(state_base, v.recovery_offset, p.step_offset, i);
    if (v.group_ranks != 0) {
      b.grad_dtype = p.rank_grad_dtype;  // what the ranks post; the engine reads the fp32 sum
      for (uint32_t rank = 0; rank < v.group_ranks; ++rank)
        b.rank_grads.push_back(staging_base + p.rank_grad_offset + rank * p.rank_grad_stride);
      b.sum_slot = reinterpret_cast<float*>(staging_base + p.grad_offset);
    } else {
      b.grad_dtype = p.grad_dtype;
      if (out.pool != nullptr) {
        b.pool = out.pool.get();
      } else {
        b.grad_slot = staging_base + p.grad_offset;
      }
    }
    out.params.push_back(std::move(b));
  }
  return out;
}

void FillSlots(const Registration& r, int32_t local_rank, v1::RegisterParametersResponse* out) {
  FillLayout(r, local_rank, out);
}

void FillSlots(const Registration& r, int32_t local_rank, v1::ResumedRegistration* out) {
  FillLayout(r, local_rank, out);
  for (const ParamOutcome& o : r.report.params) {
    auto* rp = out->add_params();
    rp->set_param_id(o.param_id);
    rp->set_applied_step(o.applied_step);
    rp->set_skipped(o.skipped);
    rp->set_torch_step(o.torch_step);
  }
}

}  // namespace trainstream::daemon
