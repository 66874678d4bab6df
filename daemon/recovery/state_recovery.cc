#include "recovery/state_recovery.h"

#include <algorithm>
#include <cstddef>
#include <cstring>

#include "trainstream/kernels/adamw.h"
#include "trainstream/kernels/cpu_features.h"
#include "trainstream/optimizer/journaled_update.h"
#include "trainstream/wire/grad_pool.h"

namespace trainstream::daemon {
namespace {

constexpr uint64_t kMaxNumel = 1ull << 36;  // param_layout.h's kMaxParamNumel
constexpr uint32_t kMaxEntries = 1u << 20;
constexpr uint32_t kMaxJournalSlots = 4096;

Status Bad(const std::string& what) {
  return Status(StatusCode::kFailedPrecondition, "state segment: " + what);
}

// [offset, offset + length) lies inside [0, total), without overflow.
bool Within(uint64_t offset, uint64_t length, uint64_t total) {
  return offset <= total && length <= total - offset;
}

bool KnownDType(uint32_t d) {
  return d == static_cast<uint32_t>(wire::DType::kFloat32) ||
         d == static_cast<uint32_t>(wire::DType::kBFloat16) ||
         d == static_cast<uint32_t>(wire::DType::kFloat16);
}

// A NUL-terminated copy of a fixed-size field, or "" when it is not terminated.
std::string FixedString(const char* field, size_t size) {
  const void* nul = std::memchr(field, '\0', size);
  return nul == nullptr ? std::string() : std::string(field);
}

}  // namespace

Status CheckStateSegment(char* base, uint64_t bytes, StateSegmentView* out) {
  StateSegmentView v;
  v.base = base;
  v.bytes = bytes;
  if (bytes < wire::kSegmentHeaderBytes + sizeof(wire::StateManifest))
    return Bad("smaller than its header and manifest");
  const wire::SegmentHeader& h = *reinterpret_cast<const wire::SegmentHeader*>(base);
  if (h.magic != wire::kSegmentMagic) return Bad("bad magic");
  if (h.version != wire::kSegmentVersion)
    return Bad("version " + std::to_string(h.version) + ", this daemon adopts " +
               std::to_string(wire::kSegmentVersion));
  if (h.total_bytes != bytes) return Bad("its header's size differs from the file's");
  const uint64_t mo = h.manifest_offset;
  if (mo % 8 != 0 || !Within(mo, sizeof(wire::StateManifest), bytes))
    return Bad("manifest_offset out of range");
  const wire::StateManifest m = *reinterpret_cast<const wire::StateManifest*>(base + mo);
  if (m.magic != wire::kSegmentMagic) return Bad("bad manifest magic");
  if (m.entries == 0 || m.entries > kMaxEntries) return Bad("manifest entries out of range");
  if (m.moment_dtype != static_cast<uint32_t>(wire::DType::kFloat32) &&
      m.moment_dtype != static_cast<uint32_t>(wire::DType::kBFloat16))
    return Bad("moment dtype " + std::to_string(m.moment_dtype));
  v.moment_dtype = static_cast<wire::DType>(m.moment_dtype);
  v.seed = m.seed;
  const uint64_t entries_offset = mo + sizeof(wire::StateManifest);
  if (!Within(entries_offset, uint64_t{m.entries} * sizeof(wire::StateManifestEntry), bytes))
    return Bad("manifest entries past the end");
  const uint64_t ro = m.recovery_offset;
  if (ro == 0) return Bad("no recovery records (written with recovery off)");
  if (ro % 64 != 0 || !Within(ro, sizeof(wire::RecoveryHeader), bytes))
    return Bad("recovery_offset out of range");
  auto* rh = reinterpret_cast<wire::RecoveryHeader*>(base + ro);
  if (rh->magic != wire::kRecoveryMagic) return Bad("bad recovery header magic");
  if (rh->version == wire::kRecoveryVersionUndo || rh->version == wire::kRecoveryVersionUndoPooled)
    return Bad("recovery version " + std::to_string(rh->version) +
               ": written by an older daemon, whose undo journal this one does not read "
               "(resume from a checkpoint, or recover with that daemon's version)");
  if (rh->version != wire::kRecoveryVersion && rh->version != wire::kRecoveryVersionPooled)
    return Bad("unknown recovery version " + std::to_string(rh->version) + " (this daemon reads " +
               std::to_string(wire::kRecoveryVersion) + " and " +
               std::to_string(wire::kRecoveryVersionPooled) + ")");
  if ((rh->flags.load(std::memory_order_acquire) & wire::kRecoveryInitialized) == 0)
    return Bad("not initialised (its registration never finished)");
  v.recovery_offset = ro;
  v.recovery = rh;
  v.chunk_elems = rh->chunk_elems;
  if (v.chunk_elems < 64 || v.chunk_elems > (1ull << 30)) return Bad("chunk_elems out of range");
  if (rh->sub_chunk_elems != wire::kSubChunkElems) return Bad("sub_chunk_elems differs");
  const uint64_t rec_off = rh->records_offset;
  if (rec_off % 64 != 0 || !Within(rec_off, uint64_t{m.entries} * sizeof(wire::ParamRecord), bytes))
    return Bad("records_offset out of range");
  v.total_chunks = rh->total_chunks;
  const uint64_t prog_off = rh->progress_offset;
  if (v.total_chunks > (1ull << 40) || prog_off % 16 != 0 ||
      !Within(prog_off, v.total_chunks * sizeof(wire::ChunkProgress), bytes))
    return Bad("progress records out of range");
  v.journal_slots = rh->journal_slots;
  v.journal_slot_bytes = rh->journal_slot_bytes;
  const uint64_t jo = rh->journal_offset;
  const uint64_t moment_bytes = wire::DTypeSize(v.moment_dtype);
  if (v.journal_slots == 0 || v.journal_slots > kMaxJournalSlots ||
      v.journal_slot_bytes !=
          wire::JournalSlotLayoutFor(wire::kSubChunkElems, moment_bytes).bytes ||
      jo % 64 != 0 || !Within(jo, uint64_t{v.journal_slots} * v.journal_slot_bytes, bytes))
    return Bad("journal out of range");
  v.records = reinterpret_cast<wire::ParamRecord*>(base + rec_off);
  v.progress = reinterpret_cast<wire::ChunkProgress*>(base + prog_off);
  v.journal = base + jo;
  v.registration = rh->registration;
  v.owner_uid = rh->owner_uid;
  v.owner_pid = rh->owner_pid;
  v.owner_start = rh->owner_start;
  std::memcpy(v.owner_proof, rh->owner_proof, sizeof(v.owner_proof));
  v.staging_name = FixedString(rh->staging_name, sizeof(rh->staging_name));
  if (v.staging_name.rfind("trainstream-", 0) != 0 || v.staging_name.find('/') != std::string::npos)
    return Bad("staging segment name");
  v.staging_bytes = rh->staging_bytes;
  if (v.staging_bytes < wire::kSegmentHeaderBytes) return Bad("staging size");
  v.max_grad_norm = rh->max_grad_norm;
  if (!(v.max_grad_norm >= 0) || v.max_grad_norm > 1e300) return Bad("max_grad_norm");
  v.threads = rh->threads;
  if (v.threads > 4096) return Bad("threads");
  v.group_ranks = rh->group_ranks;
  v.world_size = rh->world_size;
  v.nnodes = rh->nnodes;
  if (v.group_ranks > 64 || (v.group_ranks != 0 && (v.world_size < v.group_ranks || v.nnodes == 0 ||
                                                    v.world_size < v.nnodes)))
    return Bad("group geometry");
  if (rh->version == wire::kRecoveryVersionPooled) {
    // The pool lies where this daemon puts it (param_layout.h), inside the staging.
    v.grad_pool_offset = rh->grad_pool_offset;
    v.grad_pool_bytes = rh->grad_pool_bytes;
    if (v.grad_pool_offset != wire::kGradPoolOffset || v.grad_pool_bytes == 0 ||
        v.grad_pool_bytes % 4096 != 0 || v.group_ranks != 0 || v.max_grad_norm != 0 ||
        !Within(v.grad_pool_offset, v.grad_pool_bytes, v.staging_bytes))
      return Bad("gradient pool out of range");
  }

  const auto* entries = reinterpret_cast<const wire::StateManifestEntry*>(base + entries_offset);
  uint64_t chunks_seen = 0;
  for (uint32_t i = 0; i < m.entries; ++i) {
    const wire::StateManifestEntry e = entries[i];
    const wire::ParamRecord& r = v.records[i];
    const std::string what = "entry " + std::to_string(i);
    CheckedParam p;
    p.param_id = e.param_id;
    p.name = FixedString(e.name, sizeof(e.name));
    p.numel = e.numel;
    p.group = e.group;
    if (p.numel == 0 || p.numel > kMaxNumel) return Bad(what + ": numel out of range");
    if (!KnownDType(e.dtype) || !KnownDType(r.grad_dtype)) return Bad(what + ": dtype");
    p.dtype = static_cast<wire::DType>(e.dtype);
    p.grad_dtype = static_cast<wire::DType>(r.grad_dtype);
    const uint64_t mb = p.numel * moment_bytes;
    // Only the layout this daemon writes for the dtype (MasterLayoutFor): a
    // split master of anything but bf16 weights would be read as garbage.
    if (e.master_layout != static_cast<uint32_t>(wire::MasterLayoutFor(p.dtype)))
      return Bad(what + ": master layout " + std::to_string(e.master_layout) + " for its dtype");
    p.master_layout = static_cast<wire::MasterLayout>(e.master_layout);
    const uint64_t master_bytes = wire::MasterStateBytes(p.master_layout);
    p.master_offset = e.master_offset;
    p.exp_avg_offset = e.exp_avg_offset;
    p.exp_avg_sq_offset = e.exp_avg_sq_offset;
    const bool master_ok = master_bytes == 0
                               ? p.master_offset == 0
                               : p.master_offset % 4 == 0 && p.master_offset >= jo &&
                                     Within(p.master_offset, p.numel * master_bytes, bytes);
    if (!master_ok || p.exp_avg_offset % 4 != 0 || p.exp_avg_sq_offset % 4 != 0 ||
        !Within(p.exp_avg_offset, mb, bytes) || !Within(p.exp_avg_sq_offset, mb, bytes))
      return Bad(what + ": state arrays out of range");
    p.grad_offset = r.grad_offset;
    p.param_offset = r.param_offset;
    if (p.grad_offset % 4 != 0 || p.param_offset % wire::DTypeSize(p.dtype) != 0 ||
        p.grad_offset < wire::kSegmentHeaderBytes || p.param_offset < wire::kSegmentHeaderBytes ||
        !Within(p.grad_offset, p.numel * wire::DTypeSize(p.grad_dtype), v.staging_bytes) ||
        !Within(p.param_offset, p.numel * wire::DTypeSize(p.dtype), v.staging_bytes))
      return Bad(what + ": staging slots out of range");
    // A pooled parameter's last submission read a pool extent, which never wraps.
    if (v.grad_pool_bytes != 0 &&
        (p.grad_offset < v.grad_pool_offset ||
         !Within(p.grad_offset - v.grad_pool_offset, p.numel * wire::DTypeSize(p.grad_dtype),
                 v.grad_pool_bytes) ||
         r.rank_grad_offset != p.grad_offset))
      return Bad(what + ": gradient outside the pool");
    if (!KnownDType(r.rank_grad_dtype)) return Bad(what + ": rank gradient dtype");
    p.rank_grad_dtype = static_cast<wire::DType>(r.rank_grad_dtype);
    p.rank_grad_offset = r.rank_grad_offset;
    p.rank_grad_stride = r.rank_grad_stride;
    const uint64_t ranks = v.group_ranks == 0 ? 1 : v.group_ranks;
    const uint64_t rank_bytes = p.numel * wire::DTypeSize(p.rank_grad_dtype);
    if (p.rank_grad_offset % 2 != 0 || p.rank_grad_offset < wire::kSegmentHeaderBytes ||
        (ranks > 1 && (p.rank_grad_stride < rank_bytes || p.rank_grad_stride > v.staging_bytes)) ||
        !Within(p.rank_grad_offset, (ranks - 1) * p.rank_grad_stride + rank_bytes, v.staging_bytes))
      return Bad(what + ": gradient slots out of range");
    p.chunk_first = r.chunk_first;
    p.chunks = r.chunks;
    if (p.chunks != (p.numel + v.chunk_elems - 1) / v.chunk_elems || p.chunk_first != chunks_seen)
      return Bad(what + ": chunk records");
    chunks_seen += p.chunks;
    if (chunks_seen > v.total_chunks) return Bad(what + ": more chunks than recorded");
    p.step_offset = entries_offset + uint64_t{i} * sizeof(wire::StateManifestEntry) +
                    offsetof(wire::StateManifestEntry, step);
    v.params.push_back(std::move(p));
  }
  if (chunks_seen != v.total_chunks) return Bad("chunk records do not add up");
  *out = std::move(v);
  return Status::Ok();
}

wire::StepRecord CurrentStepRecord(const StateSegmentView& v) {
  const uint32_t i = v.recovery->current_step_record.load(std::memory_order_acquire) & 1u;
  return v.recovery->step_records[i];
}

namespace {

struct Finisher {
  const StateSegmentView& v;
  char* staging;
  uint64_t staging_bytes;
  RecoveryReport* report;

  char* SlotPointer(uint32_t slot) const {
    return v.journal + uint64_t{slot} * v.journal_slot_bytes;
  }

  void Lose(const CheckedParam& p, uint64_t step, const std::string& why) {
    if (!report->lost.empty()) return;
    report->lost = "step " + std::to_string(step) + " was lost: the update of '" + p.name +
                   "' (param " + std::to_string(p.param_id) + ") " + why;
    report->lost_step = step;
  }

  // Parameter p's arrays (every pointer at element 0), its master where its
  // layout keeps it; false when that needs the staging segment and it is gone.
  bool Arrays(const CheckedParam& p, kernels::AdamWRange* whole) const {
    kernels::AdamWRange w;
    w.exp_avg = v.base + p.exp_avg_offset;
    w.exp_avg_sq = v.base + p.exp_avg_sq_offset;
    w.numel = p.numel;
    w.grad_dtype = p.grad_dtype;
    w.moment_dtype = v.moment_dtype;
    w.param_dtype = p.dtype;
    if (staging != nullptr) {
      w.grad = staging + p.grad_offset;
      w.param_out = staging + p.param_offset;
    }
    switch (p.master_layout) {
      case wire::MasterLayout::kFp32:
        w.master = reinterpret_cast<float*>(v.base + p.master_offset);
        break;
      case wire::MasterLayout::kSplitBf16:
        w.master_lo = reinterpret_cast<uint16_t*>(v.base + p.master_offset);
        break;
      case wire::MasterLayout::kWeightSlot:
        w.master = static_cast<float*>(w.param_out);
        break;
    }
    *whole = w;
    return staging != nullptr || p.master_layout == wire::MasterLayout::kFp32;
  }

  // Finishes every sub-chunk whose redo record is whole and not yet recorded, for
  // parameter i's update of `step` (its chunk's progress points at it): the slot
  // copied into the state again, then the progress (Note [Redo journal],
  // optimizer/journaled_update.h). A master in a staging segment that is gone
  // cannot be: RollForward reports it lost.
  void CompleteTorn(uint32_t i, uint64_t step) {
    const CheckedParam& p = v.params[i];
    kernels::AdamWRange whole;
    if (!Arrays(p, &whole)) return;
    for (uint32_t s = 0; s < v.journal_slots; ++s) {
      char* slot = SlotPointer(s);
      const auto* jh = reinterpret_cast<const wire::JournalSlotHeader*>(slot);
      if (jh->valid.load(std::memory_order_acquire) != 1 || jh->entry != i || jh->step != step)
        continue;
      const uint64_t off = jh->offset, count = jh->count;
      if (count == 0 || count > wire::kSubChunkElems || !Within(off, count, p.numel)) continue;
      const uint64_t c = off / v.chunk_elems;
      wire::ChunkProgress& pr = v.progress[p.chunk_first + c];
      const uint64_t done = pr.done_elems.load();
      if (pr.done_step.load() >= step || c * v.chunk_elems + done != off) continue;
      const uint64_t chunk_count = std::min<uint64_t>(v.chunk_elems, p.numel - c * v.chunk_elems);
      if (done + count > chunk_count) continue;
      optimizer::CommitJournaled(whole, slot, off, count);
      optimizer::RecordProgress(&pr, step, done + count, chunk_count);
      ++report->restored_subchunks;
    }
  }

  // True when no chunk of parameter i has progress of `step` (nothing changed).
  bool Untouched(const CheckedParam& p, uint64_t step) const {
    for (uint64_t c = 0; c < p.chunks; ++c) {
      const wire::ChunkProgress& pr = v.progress[p.chunk_first + c];
      if (pr.done_step.load() >= step || pr.done_elems.load() != 0) return false;
    }
    return true;
  }

  // Finishes parameter i's update of `step` from its chunks' progress.
  bool RollForward(uint32_t i, uint64_t step) {
    const CheckedParam& p = v.params[i];
    const wire::ParamRecord& r = v.records[i];
    if (staging == nullptr) {
      Lose(p, step, "was under way and its gradient went with its staging segment");
      return false;
    }
    if (r.state_step == 0 || !(r.grad_scale > 0)) {
      Lose(p, step, "has an unreadable record");
      return false;
    }
    optimizer::JournaledChunk j;
    Arrays(p, &j.whole);  // staging is there: every array is
    const kernels::AdamWHyperParams hp{r.lr, r.beta1, r.beta2, r.eps, r.weight_decay};
    j.scalars = kernels::ComputeAdamWStepScalars(hp, r.state_step, r.grad_scale);
    j.key = kernels::RoundingKey{v.seed, p.param_id, r.state_step, 0};
    j.isa = kernels::BestIsa();
    j.entry = i;
    j.step = step;
    j.journal_slot = SlotPointer(0);  // every whole redo record is in the state by now
    for (uint64_t c = 0; c < p.chunks; ++c) {
      wire::ChunkProgress& pr = v.progress[p.chunk_first + c];
      const uint64_t done_step = pr.done_step.load();
      if (done_step > step) {
        Lose(p, step, "has a chunk recorded past its step");
        return false;
      }
      if (done_step == step) continue;
      j.chunk_offset = c * v.chunk_elems;
      j.chunk_count = std::min<uint64_t>(v.chunk_elems, p.numel - j.chunk_offset);
      const uint64_t done = pr.done_elems.load();
      if (done >= j.chunk_count || done % wire::kSubChunkElems != 0) {
        Lose(p, step, "has a chunk's progress out of range");
        return false;
      }
      j.progress = &pr;
      optimizer::ApplyJournaled(j, done);
    }
    return true;
  }
};

}  // namespace

RecoveryReport CompleteUpdates(const StateSegmentView& v, char* staging, uint64_t staging_bytes,
                               const wire::StepRecord& decision) {
  RecoveryReport report;
  if (staging != nullptr && staging_bytes != v.staging_bytes) staging = nullptr;
  Finisher f{v, staging, staging_bytes, &report};
  const bool clipping = v.max_grad_norm > 0;
  const uint32_t n = static_cast<uint32_t>(v.params.size());
  // What each parameter's records say, read once.
  std::vector<uint64_t> mark(n), applied(n);
  for (uint32_t i = 0; i < n; ++i) {
    mark[i] = v.records[i].mark.load(std::memory_order_acquire);
    applied[i] = v.records[i].applied.load(std::memory_order_acquire);
  }
  // First every whole redo record, so the roll-forward may reuse a journal slot.
  for (uint32_t i = 0; i < n; ++i) {
    const uint64_t step = mark[i] >> 2;
    if (step > (applied[i] >> 1) && (mark[i] & 3) == wire::kMarkUpdating) f.CompleteTorn(i, step);
  }
  for (uint32_t i = 0; i < n; ++i) {
    const CheckedParam& p = v.params[i];
    wire::ParamRecord& r = v.records[i];
    const uint64_t step = mark[i] >> 2, phase = mark[i] & 3;
    ParamOutcome o;
    o.param_id = p.param_id;
    if (step > (applied[i] >> 1)) {
      // The engine took step's gradient and did not commit the update.
      const bool decided = decision.decided_step == step;
      if (clipping && decided && decision.decided_skipped != 0) {
        r.applied.store(step * 2 + 1, std::memory_order_release);  // the whole step is skipped
      } else if (phase == wire::kMarkUpdating && (!clipping || decided)) {
        if (f.RollForward(i, step)) {
          *reinterpret_cast<uint64_t*>(v.base + p.step_offset) = r.state_step;
          r.applied.store(step * 2, std::memory_order_release);
          o.rolled_forward = true;
          ++report.rolled_forward;
        }
      } else if (!f.Untouched(p, step)) {
        f.Lose(p, step, "changed memory before its update was recorded as started");
      }
      // else: nothing of the update happened; the client posts the gradient again.
    }
    const uint64_t now = r.applied.load(std::memory_order_acquire);
    o.applied_step = now >> 1;
    o.skipped = (now & 1) != 0;
    o.torch_step = *reinterpret_cast<const uint64_t*>(v.base + p.step_offset);
    o.grad_sumsq = r.grad_sumsq;
    report.params.push_back(o);
  }
  return report;
}

}  // namespace trainstream::daemon
