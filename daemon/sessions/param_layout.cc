#include "sessions/param_layout.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "trainstream/wire/dtype.h"
#include "trainstream/wire/grad_pool.h"
#include "trainstream/wire/segment_header.h"
#include "trainstream/wire/state_record.h"

namespace trainstream::daemon {
namespace {

Status Invalid(const std::string& field, const std::string& what) {
  return Status(StatusCode::kInvalidArgument, field + ": " + what);
}

std::string Num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

}  // namespace

int MomentDType(const v1::RegisterParametersRequest& req) {
  return req.moment_dtype() == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_FLOAT32 : req.moment_dtype();
}

int GradDType(const v1::ParameterSpec& p) {
  return p.grad_dtype() == v1::DTYPE_UNSPECIFIED ? p.dtype() : p.grad_dtype();
}

// The request's trainstream.v1.DType is the wire's DType, number for number
// (Note [DType numbers are the wire's]): it is cast, never mapped.
static_assert(static_cast<int>(wire::DType::kFloat32) == v1::DTYPE_FLOAT32, "wire format");
static_assert(static_cast<int>(wire::DType::kBFloat16) == v1::DTYPE_BFLOAT16, "wire format");
static_assert(static_cast<int>(wire::DType::kFloat16) == v1::DTYPE_FLOAT16, "wire format");

size_t DTypeBytes(int dtype) {
  return wire::DTypeSize(static_cast<wire::DType>(static_cast<uint32_t>(dtype)));
}

Status ValidateRegistration(const v1::RegisterParametersRequest& req,
                            const std::set<uint64_t>& registered) {
  if (req.groups_size() == 0) return Invalid("groups", "at least one parameter group is required");
  if (static_cast<size_t>(req.groups_size()) > kMaxGroups) {
    return Invalid("groups", std::to_string(req.groups_size()) + " groups (at most " +
                                 std::to_string(kMaxGroups) + ")");
  }
  for (int g = 0; g < req.groups_size(); ++g) {
    const auto& h = req.groups(g);
    const std::string f = "groups[" + std::to_string(g) + "].";
    if (!std::isfinite(h.lr()) || h.lr() < 0)
      return Invalid(f + "lr", Num(h.lr()) + " must be finite and >= 0");
    if (!(h.beta1() >= 0 && h.beta1() < 1))
      return Invalid(f + "beta1", Num(h.beta1()) + " must be in [0, 1)");
    if (!(h.beta2() >= 0 && h.beta2() < 1))
      return Invalid(f + "beta2", Num(h.beta2()) + " must be in [0, 1)");
    if (!std::isfinite(h.eps()) || !(h.eps() > 0))
      return Invalid(f + "eps", Num(h.eps()) + " must be finite and > 0");
    if (!std::isfinite(h.weight_decay()) || h.weight_decay() < 0) {
      return Invalid(f + "weight_decay", Num(h.weight_decay()) + " must be finite and >= 0");
    }
  }
  const int moment = MomentDType(req);
  if (moment != v1::DTYPE_FLOAT32 && moment != v1::DTYPE_BFLOAT16) {
    return Invalid("moment_dtype", std::to_string(req.moment_dtype()) +
                                       " is not supported (DTYPE_FLOAT32 or DTYPE_BFLOAT16)");
  }
  if (!std::isfinite(req.max_grad_norm()) || req.max_grad_norm() < 0) {
    return Invalid("max_grad_norm",
                   Num(req.max_grad_norm()) + " must be finite and >= 0 (0 disables clipping)");
  }
  if (req.grad_pool_bytes() > kMaxGradPoolBytes)
    return Invalid("grad_pool_bytes", std::to_string(req.grad_pool_bytes()) + " (at most " +
                                          std::to_string(kMaxGradPoolBytes) + ")");
  if (req.grad_pool_bytes() != 0 && req.max_grad_norm() != 0) {
    // Note [Clipping keeps gradient slots] (python/trainstream/optim/grad_pool.py).
    return Invalid("grad_pool_bytes",
                   "a gradient pool needs max_grad_norm 0: clipping holds every gradient of "
                   "a step until its global norm is known");
  }
  if (req.params_size() == 0) return Invalid("params", "no parameters to register");
  if (static_cast<size_t>(req.params_size()) > kMaxParamsPerRequest) {
    return Invalid("params", std::to_string(req.params_size()) +
                                 " parameters in one request (at most " +
                                 std::to_string(kMaxParamsPerRequest) + ")");
  }
  std::set<uint64_t> seen;
  uint64_t total_numel = 0;
  for (int i = 0; i < req.params_size(); ++i) {
    const auto& p = req.params(i);
    const std::string f = "params[" + std::to_string(i) + "].";
    if (registered.count(p.param_id()) != 0) {
      return Invalid(f + "param_id",
                     std::to_string(p.param_id()) + " is already registered in this session");
    }
    if (!seen.insert(p.param_id()).second) {
      return Invalid(f + "param_id",
                     std::to_string(p.param_id()) + " appears twice in this request");
    }
    if (p.shape_size() > kMaxParamDims) {
      return Invalid(f + "shape", std::to_string(p.shape_size()) + " dimensions (at most " +
                                      std::to_string(kMaxParamDims) + ")");
    }
    uint64_t numel = 1;
    for (int d = 0; d < p.shape_size(); ++d) {
      const int64_t dim = p.shape(d);
      if (dim <= 0) {
        return Invalid(f + "shape[" + std::to_string(d) + "]",
                       std::to_string(dim) + " must be > 0");
      }
      if (static_cast<uint64_t>(dim) > kMaxParamNumel ||
          numel > kMaxParamNumel / static_cast<uint64_t>(dim)) {
        return Invalid(f + "shape", "more than " + std::to_string(kMaxParamNumel) + " elements");
      }
      numel *= static_cast<uint64_t>(dim);
    }
    total_numel += numel;  // each <= 2^36 and at most 2^20 of them: no overflow
    if (total_numel > kMaxRequestNumel) {
      return Invalid("params", "more than " + std::to_string(kMaxRequestNumel) +
                                   " elements in one request (through params[" + std::to_string(i) +
                                   "])");
    }
    if (DTypeBytes(p.dtype()) == 0) {
      return Invalid(f + "dtype", std::to_string(p.dtype()) +
                                      " is not a known dtype (float32, bfloat16, float16)");
    }
    if (p.grad_dtype() != v1::DTYPE_UNSPECIFIED && DTypeBytes(p.grad_dtype()) == 0) {
      return Invalid(f + "grad_dtype", std::to_string(p.grad_dtype()) + " is not a known dtype");
    }
    if (p.group() >= static_cast<uint32_t>(req.groups_size())) {
      return Invalid(f + "group", std::to_string(p.group()) + " is out of range (" +
                                      std::to_string(req.groups_size()) + " groups)");
    }
  }
  return Status::Ok();
}

RegistrationLayout ComputeRegistrationLayout(const v1::RegisterParametersRequest& req,
                                             uint32_t grad_slots, bool sum_slot,
                                             const RecoveryLayoutOptions& recovery) {
  constexpr uint64_t kSlotAlign = 64;
  constexpr uint64_t kPage = 4096;
  RegistrationLayout layout;
  layout.grad_slots = grad_slots;
  layout.sum_slot = sum_slot;
  layout.params.resize(static_cast<size_t>(req.params_size()));
  const uint64_t moment_bytes = DTypeBytes(MomentDType(req));

  layout.manifest_offset = wire::kSegmentHeaderBytes;
  layout.manifest_bytes = sizeof(wire::StateManifest) + static_cast<uint64_t>(req.params_size()) *
                                                            sizeof(wire::StateManifestEntry);
  uint64_t staging = wire::kSegmentHeaderBytes;
  uint64_t records_end = layout.manifest_offset + layout.manifest_bytes;
  if (recovery.enabled) {
    // Note [Optimizer state outlives the daemon] (trainstream/wire/state_record.h).
    const uint64_t chunk = recovery.chunk_elems;
    layout.chunk_elems = chunk;
    layout.recovery_offset = AlignUp(records_end, kSlotAlign);
    layout.records_offset =
        AlignUp(layout.recovery_offset + sizeof(wire::RecoveryHeader), kSlotAlign);
    layout.progress_offset =
        AlignUp(layout.records_offset +
                    static_cast<uint64_t>(req.params_size()) * sizeof(wire::ParamRecord),
                kSlotAlign);
    for (int i = 0; i < req.params_size(); ++i) {
      ParamPlacement& pl = layout.params[static_cast<size_t>(i)];
      uint64_t numel = 1;
      for (int64_t d : req.params(i).shape()) numel *= static_cast<uint64_t>(d);
      pl.chunk_first = layout.total_chunks;
      pl.chunks = (numel + chunk - 1) / chunk;
      layout.total_chunks += pl.chunks;
    }
    layout.journal_slots = recovery.journal_slots;
    layout.journal_slot_bytes =
        wire::JournalSlotLayoutFor(wire::kSubChunkElems, moment_bytes).bytes;
    layout.journal_offset = AlignUp(
        layout.progress_offset + layout.total_chunks * sizeof(wire::ChunkProgress), kSlotAlign);
    records_end = layout.journal_offset + layout.journal_slots * layout.journal_slot_bytes;
  }
  uint64_t state = AlignUp(records_end, kPage);
  const bool pooled = req.grad_pool_bytes() != 0 && grad_slots == 1 && !sum_slot;
  if (pooled) {
    uint64_t largest = 0;
    for (int i = 0; i < req.params_size(); ++i) {
      uint64_t numel = 1;
      for (int64_t d : req.params(i).shape()) numel *= static_cast<uint64_t>(d);
      largest =
          std::max(largest, AlignUp(numel * DTypeBytes(GradDType(req.params(i))), kSlotAlign));
    }
    layout.grad_pool_offset = wire::kGradPoolOffset;
    layout.grad_pool_bytes = AlignUp(std::max(req.grad_pool_bytes(), largest), kPage);
    staging = layout.grad_pool_offset + layout.grad_pool_bytes;
  }
  for (int i = 0; i < req.params_size(); ++i) {
    const auto& p = req.params(i);
    ParamPlacement& pl = layout.params[static_cast<size_t>(i)];
    pl.numel = 1;
    for (int64_t d : p.shape()) pl.numel *= static_cast<uint64_t>(d);
    if (!pooled) {
      pl.grad_offset = AlignUp(staging, kSlotAlign);
      pl.grad_stride = AlignUp(pl.numel * DTypeBytes(GradDType(p)), kSlotAlign);
      staging =
          pl.grad_offset + (grad_slots - 1) * pl.grad_stride + pl.numel * DTypeBytes(GradDType(p));
    }
    if (sum_slot) {
      pl.sum_offset = AlignUp(staging, kSlotAlign);
      staging = pl.sum_offset + pl.numel * 4;
    }
    pl.param_offset = AlignUp(staging, kSlotAlign);
    staging = pl.param_offset + pl.numel * DTypeBytes(p.dtype());
    pl.master_layout = wire::MasterLayoutFor(static_cast<wire::DType>(p.dtype()));
    if (const uint64_t master_bytes = wire::MasterStateBytes(pl.master_layout); master_bytes != 0) {
      pl.master_offset = AlignUp(state, kSlotAlign);
      state = pl.master_offset + pl.numel * master_bytes;
    }
    pl.exp_avg_offset = AlignUp(state, kSlotAlign);
    state = pl.exp_avg_offset + pl.numel * moment_bytes;
    pl.exp_avg_sq_offset = AlignUp(state, kSlotAlign);
    state = pl.exp_avg_sq_offset + pl.numel * moment_bytes;
  }
  layout.staging_bytes = AlignUp(staging, kPage);
  layout.state_bytes = AlignUp(state, kPage);
  return layout;
}

wire::StateManifestEntry* WriteStateManifest(char* state_base, const RegistrationLayout& layout,
                                             const v1::RegisterParametersRequest& req,
                                             const RecoveryOwner* owner) {
  auto* header = reinterpret_cast<wire::SegmentHeader*>(state_base);
  header->manifest_offset = layout.manifest_offset;
  header->manifest_bytes = layout.manifest_bytes;
  auto* manifest = reinterpret_cast<wire::StateManifest*>(state_base + layout.manifest_offset);
  manifest->magic = wire::kSegmentMagic;
  manifest->entries = static_cast<uint32_t>(req.params_size());
  manifest->moment_dtype = static_cast<uint32_t>(MomentDType(req));
  manifest->step = 0;
  manifest->seed = req.seed();
  auto* entries = reinterpret_cast<wire::StateManifestEntry*>(manifest + 1);
  for (int i = 0; i < req.params_size(); ++i) {
    const auto& p = req.params(i);
    const ParamPlacement& pl = layout.params[static_cast<size_t>(i)];
    wire::StateManifestEntry& e = entries[i];
    std::memset(static_cast<void*>(&e), 0, sizeof(e));
    e.param_id = p.param_id();
    e.numel = pl.numel;
    e.dtype = static_cast<uint32_t>(p.dtype());
    e.group = p.group();
    e.master_offset = pl.master_offset;
    e.master_layout = static_cast<uint32_t>(pl.master_layout);
    e.exp_avg_offset = pl.exp_avg_offset;
    e.exp_avg_sq_offset = pl.exp_avg_sq_offset;
    std::strncpy(e.name, p.name().c_str(), sizeof(e.name) - 1);
  }
  if (layout.recovery_offset == 0 || owner == nullptr) return entries;
  // The segment is fresh (zero pages): marks, progress and journals start empty.
  manifest->recovery_offset = layout.recovery_offset;
  auto* rh = reinterpret_cast<wire::RecoveryHeader*>(state_base + layout.recovery_offset);
  rh->magic = wire::kRecoveryMagic;
  rh->version = layout.grad_pool_bytes != 0 ? wire::kRecoveryVersionPooled : wire::kRecoveryVersion;
  rh->grad_pool_offset = layout.grad_pool_offset;
  rh->grad_pool_bytes = layout.grad_pool_bytes;
  rh->registration = owner->registration;
  std::memcpy(rh->owner_proof, owner->proof, sizeof(rh->owner_proof));
  rh->owner_uid = static_cast<uint32_t>(owner->uid);
  rh->owner_pid = static_cast<int32_t>(owner->pid);
  rh->owner_start = owner->start;
  rh->chunk_elems = layout.chunk_elems;
  rh->sub_chunk_elems = wire::kSubChunkElems;
  rh->records_offset = layout.records_offset;
  rh->progress_offset = layout.progress_offset;
  rh->total_chunks = layout.total_chunks;
  rh->journal_offset = layout.journal_offset;
  rh->journal_slot_bytes = layout.journal_slot_bytes;
  rh->journal_slots = layout.journal_slots;
  rh->staging_bytes = owner->staging_bytes;
  std::strncpy(rh->staging_name, owner->staging_name.c_str(), sizeof(rh->staging_name) - 1);
  rh->max_grad_norm = req.max_grad_norm();
  rh->threads = req.threads();
  if (layout.sum_slot) {
    rh->group_ranks = layout.grad_slots;
    rh->world_size = owner->world_size;
    rh->nnodes = owner->nnodes;
  }
  auto* records = reinterpret_cast<wire::ParamRecord*>(state_base + layout.records_offset);
  for (int i = 0; i < req.params_size(); ++i) {
    const auto& p = req.params(i);
    const ParamPlacement& pl = layout.params[static_cast<size_t>(i)];
    wire::ParamRecord& r = records[i];
    // The slot the engine reads: a group's fp32 sum slot, else the client's.
    r.grad_dtype = layout.sum_slot ? static_cast<uint32_t>(wire::DType::kFloat32)
                                   : static_cast<uint32_t>(GradDType(p));
    // A pooled parameter never submitted names the pool's first bytes.
    const uint64_t grad = layout.grad_pool_bytes != 0 ? layout.grad_pool_offset : pl.grad_offset;
    r.grad_offset = layout.sum_slot ? pl.sum_offset : grad;
    r.param_offset = pl.param_offset;
    r.chunk_first = pl.chunk_first;
    r.chunks = pl.chunks;
    r.rank_grad_offset = grad;
    r.rank_grad_stride = pl.grad_stride;
    r.rank_grad_dtype = static_cast<uint32_t>(GradDType(p));
  }
  return entries;
}

}  // namespace trainstream::daemon
