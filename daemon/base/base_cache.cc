#include "base/base_cache.h"

#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cstdio>

#include "logging/log_safe.h"
#include "trainstream/platform/user.h"
#include "trainstream/v1/control.pb.h"

namespace trainstream::daemon::base {
namespace {

std::string MakeKey(const BasePlan& plan, platform::UserId owner) {
  char buf[96];
  std::snprintf(buf, sizeof(buf), "%016" PRIx64 "-%s-%" PRId64 "-u%u", plan.identity_hash,
                plan.format_name.c_str(), plan.block_size, static_cast<unsigned>(owner));
  return buf;
}

}  // namespace

BaseCache::BaseCache(const DaemonConfig& config, Budget* budget)
    : config_(config), budget_(budget) {}

BaseCache::~BaseCache() {
  std::vector<std::unique_ptr<ShmSegment>> dead;
  std::vector<VramAllocation> dead_vram;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [key, e] : entries_) {
      if (e.segment) dead.push_back(std::move(e.segment));
      for (auto& [device, copy] : e.vram) dead_vram.push_back(copy.allocation);
    }
    entries_.clear();
  }
  FreeVram(dead_vram);
  Free(std::move(dead));
}

void BaseCache::FreeVram(const std::vector<VramAllocation>& dead) {
  for (const auto& a : dead) {
    vram_.Free(a);
    spdlog::info("share_vram: freed the {} byte VRAM copy on device {} ({})", a.bytes, a.device,
                 a.pci_bus_id);
  }
}

void BaseCache::ReleaseVramLocked(Entry* e, uint64_t session_id,
                                  std::vector<VramAllocation>* dead_vram) {
  for (auto it = e->vram.begin(); it != e->vram.end();) {
    it->second.holders.erase(session_id);
    if (it->second.holders.empty()) {
      dead_vram->push_back(it->second.allocation);
      it = e->vram.erase(it);
    } else {
      ++it;
    }
  }
}

void BaseCache::Free(std::vector<std::unique_ptr<ShmSegment>> dead) {
  for (auto& seg : dead) {
    const uint64_t bytes = seg->size();
    seg.reset();  // unmaps and unlinks; clients that still map it keep their pages
    budget_->Release(bytes);
  }
}

void BaseCache::FillInfo(const Entry& e, BaseInfo* out) const {
  *out = e.info;
  out->refcount = static_cast<uint32_t>(e.sessions.size());
  out->sessions.assign(e.sessions.begin(), e.sessions.end());
  out->vram_copies = static_cast<uint32_t>(e.vram.size());
  out->vram_bytes = 0;
  for (const auto& [device, copy] : e.vram) out->vram_bytes += copy.allocation.bytes;
}

Status BaseCache::Load(const PeerCredentials& caller, const BaseLoadOptions& options,
                       uint64_t session_id,
                       const std::function<bool(const LoadProgress&)>& progress, BaseInfo* out) {
  BasePlan plan;
  Status st = ParseBaseFormat(options.format, options.block_size, &plan);
  if (!st.ok()) return st;
  ModelSources sources;
  st = OpenModelAsCaller(caller, options.path, &sources);
  if (!st.ok()) return st;
  spdlog::debug("base load for uid {} pid {}: reading the headers of {} files", caller.uid,
                caller.pid, sources.files.size());
  // Planning parses every header: a long one stops when `progress` says so.
  st = PlanBase(sources, &plan, [&] { return progress && !progress(LoadProgress{}); });
  if (!st.ok()) return st;
  const std::string key = MakeKey(plan, caller.uid);

  {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      auto it = entries_.find(key);
      if (it == entries_.end()) break;
      if (it->second.state == Entry::State::kReady) {
        if (session_id != 0) it->second.sessions.insert(session_id);
        it->second.last_used = ++tick_;
        FillInfo(it->second, out);
        out->cached = true;
        return Status::Ok();
      }
      // Another request is loading this key: wait for it (it may fail; then
      // the entry is gone and this request loads it itself).
      loaded_cv_.wait_for(lock, std::chrono::milliseconds(200));
      lock.unlock();  // the callback may block on the client: never under mu_
      const bool go_on = !progress || progress(LoadProgress{});
      lock.lock();
      if (!go_on) return Status(StatusCode::kCancelled, kLoadCancelled);
    }
    Entry& e = entries_[key];
    e.state = Entry::State::kLoading;
    e.info.key = key;
    e.info.path = options.path;
    e.info.format = plan.format_name;
    e.info.block_size = plan.block_size;
    e.info.owner_uid = caller.uid;
    e.info.source_bytes = plan.source_bytes;
    e.info.tensors = static_cast<uint32_t>(plan.tensors.size());
    e.info.quantized_tensors = plan.quantized_tensors;
  }
  auto fail = [&](Status s) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      entries_.erase(key);
    }
    loaded_cv_.notify_all();
    return s;
  };

  const auto started = std::chrono::steady_clock::now();
  const std::string what = "base " + options.path + " (" + plan.format_name + ")";
  st = budget_->Reserve(plan.total_bytes, what);
  if (!st.ok()) return fail(st);
  SegmentOwner owner;
  owner.uid = caller.uid;
  owner.job = "base";
  std::unique_ptr<ShmSegment> seg;
  // Not prefaulted: the loader threads write every page, and fault them in
  // where they write, in parallel (a prefault is one thread at ~2 GB/s).
  st = ShmSegment::Create(config_.shm_dir, v1::SEGMENT_KIND_BASE, plan.total_bytes, owner,
                          /*lock=*/false, &seg, /*prefault=*/false);
  if (!st.ok()) {
    budget_->Release(plan.total_bytes);
    return fail(st);
  }
  // The loader threads' scratch counts against the budget while they run. A
  // budget too full for N threads' worth loads on one, before it gives up.
  FillOptions fill;
  fill.threads = BaseLoadThreads(config_, options.threads);
  uint64_t scratch = FillScratchBytes(plan, fill);
  st = scratch == 0 ? Status::Ok() : budget_->Reserve(scratch, "the scratch to quantize " + what);
  if (!st.ok() && fill.threads > 1) {
    const uint64_t wanted = scratch;
    fill.threads = 1;
    scratch = FillScratchBytes(plan, fill);
    st = budget_->Reserve(scratch, "the scratch to quantize " + what);
    if (st.ok()) {
      spdlog::info(
          "base load of {}: the budget has no room for {} bytes of scratch; loading "
          "on one thread ({} bytes)",
          LogSafe(options.path), wanted, scratch);
    }
  }
  if (!st.ok()) {
    seg.reset();
    budget_->Release(plan.total_bytes);
    return fail(st);
  }
  const double allocate_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  FillStats stats;
  st = FillBase(sources, plan, key, seg->base(), fill, progress, &stats);
  if (scratch != 0) budget_->Release(scratch);
  if (st.ok()) {
    // Note [Who may open a segment] (shm_segment.h).
    st = seg->ShareReadOnly();
  }
  if (!st.ok()) {
    seg.reset();
    budget_->Release(plan.total_bytes);
    spdlog::info("base load of {} failed: {}", LogSafe(options.path), LogSafe(st.message(), 1024));
    return fail(st);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  {
    std::lock_guard<std::mutex> lock(mu_);
    Entry& e = entries_.at(key);
    e.state = Entry::State::kReady;
    e.info.segment_name = seg->name();
    e.info.segment_bytes = seg->size();
    e.info.load_seconds = seconds;
    e.info.allocate_seconds = allocate_seconds;
    e.info.load_threads = stats.threads;
    e.info.scratch_peak_bytes = stats.scratch_peak_bytes;
    e.segment = std::move(seg);
    if (session_id != 0) e.sessions.insert(session_id);
    e.last_used = ++tick_;
    FillInfo(e, out);
  }
  loaded_cv_.notify_all();
  spdlog::info(
      "base {} loaded from {}: {} tensors ({} quantized to {}), {} checkpoint bytes -> {} "
      "segment bytes in {:.2f} s ({:.2f} GB/s; {:.2f} s of it allocating the segment) on {} "
      "threads, scratch peak {} bytes",
      key, LogSafe(options.path), out->tensors, out->quantized_tensors, out->format,
      out->source_bytes, out->segment_bytes, seconds,
      seconds > 0 ? out->source_bytes / seconds / 1e9 : 0.0, allocate_seconds, stats.threads,
      stats.scratch_peak_bytes);
  return Status::Ok();
}

Status BaseCache::Release(uint64_t session_id, const std::string& key) {
  std::vector<VramAllocation> dead_vram;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(key);
    if (it == entries_.end() || it->second.sessions.erase(session_id) == 0) {
      return Status(StatusCode::kNotFound, "key: session " + std::to_string(session_id) +
                                               " holds no reference to base '" +
                                               key.substr(0, 128) + "'");
    }
    it->second.last_used = ++tick_;
    ReleaseVramLocked(&it->second, session_id, &dead_vram);
  }
  FreeVram(dead_vram);
  return Status::Ok();
}

void BaseCache::ReleaseSession(uint64_t session_id) {
  std::vector<VramAllocation> dead_vram;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [key, e] : entries_) {
      if (e.sessions.erase(session_id) != 0) e.last_used = ++tick_;
      ReleaseVramLocked(&e, session_id, &dead_vram);
    }
  }
  FreeVram(dead_vram);
}

void BaseCache::DropLocked(std::map<std::string, Entry>::iterator it,
                           std::vector<std::unique_ptr<ShmSegment>>* dead,
                           std::vector<VramAllocation>* dead_vram) {
  if (it->second.segment) dead->push_back(std::move(it->second.segment));
  // Holders are a subset of the sessions, so an unreferenced base has no VRAM
  // copy; this only matters if that invariant is ever broken.
  for (auto& [device, copy] : it->second.vram) dead_vram->push_back(copy.allocation);
  entries_.erase(it);
}

Status BaseCache::Drop(const PeerCredentials& caller, const std::string& key,
                       uint64_t* bytes_freed) {
  std::vector<std::unique_ptr<ShmSegment>> dead;
  std::vector<VramAllocation> dead_vram;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(key);
    if (it == entries_.end() || (!caller.admin && caller.uid != it->second.info.owner_uid)) {
      return Status(StatusCode::kNotFound,
                    "key: no base '" + key.substr(0, 128) +
                        "' of yours is cached (see `trainstreamctl base list`)");
    }
    Entry& e = it->second;
    if (e.state != Entry::State::kReady) {
      return Status(StatusCode::kFailedPrecondition, "base '" + key + "' is still loading");
    }
    if (!e.sessions.empty()) {
      std::string ids;
      for (uint64_t s : e.sessions) ids += (ids.empty() ? "" : ", ") + std::to_string(s);
      return Status(StatusCode::kFailedPrecondition,
                    "base '" + key + "' is in use by session(s) " + ids +
                        "; it can be dropped once they release it or detach");
    }
    if (e.busy > 0) {
      return Status(StatusCode::kFailedPrecondition,
                    "base '" + key + "' is being copied to a GPU (share_vram); try again");
    }
    *bytes_freed = e.segment->size();
    DropLocked(it, &dead, &dead_vram);
  }
  spdlog::info("base {} dropped by uid {}", key, caller.uid);
  FreeVram(dead_vram);
  Free(std::move(dead));
  return Status::Ok();
}

uint64_t BaseCache::EvictUnreferenced(uint64_t bytes_needed) {
  std::vector<std::unique_ptr<ShmSegment>> dead;
  std::vector<VramAllocation> dead_vram;
  uint64_t freed = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    while (freed < bytes_needed) {
      auto victim = entries_.end();
      for (auto it = entries_.begin(); it != entries_.end(); ++it) {
        const Entry& e = it->second;
        if (e.state != Entry::State::kReady || !e.sessions.empty() || e.busy > 0) continue;
        if (victim == entries_.end() || e.last_used < victim->second.last_used) victim = it;
      }
      if (victim == entries_.end()) break;
      freed += victim->second.segment->size();
      spdlog::info("evicting unreferenced base {} ({} bytes) to make room", victim->first,
                   victim->second.segment->size());
      DropLocked(victim, &dead, &dead_vram);
    }
  }
  FreeVram(dead_vram);
  Free(std::move(dead));
  return freed;
}

std::vector<BaseInfo> BaseCache::List(const PeerCredentials& caller) {
  std::vector<BaseInfo> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [key, e] : entries_) {
    if (e.state != Entry::State::kReady) continue;
    if (!caller.admin && caller.uid != e.info.owner_uid) continue;
    out.emplace_back();
    FillInfo(e, &out.back());
  }
  return out;
}

uint64_t BaseCache::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t total = 0;
  for (const auto& [key, e] : entries_)
    if (e.segment) total += e.segment->size();
  return total;
}

Status BaseCache::ShareVram(uint64_t session_id, const std::string& key, const VramDevice& device,
                            VramShareInfo* out) {
  auto not_held = [&] {
    return Status(StatusCode::kNotFound,
                  "key: session " + std::to_string(session_id) + " holds no reference to base '" +
                      key.substr(0, 128) +
                      "' (load it with this session before sharing its VRAM copy)");
  };
  auto holds = [&](std::map<std::string, Entry>::iterator it) {
    return it != entries_.end() && it->second.state == Entry::State::kReady &&
           it->second.sessions.count(session_id) != 0;
  };
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!holds(entries_.find(key))) return not_held();
  }
  // Note [CUDA in the daemon only on request]: the first CUDA call is here.
  int index = -1;
  std::string pci_bus_id;
  Status st = vram_.Resolve(device, &index, &pci_bus_id);
  if (!st.ok()) {
    spdlog::info("share_vram of base {} for session {} refused: {}", LogSafe(key), session_id,
                 LogSafe(st.message(), 1024));
    return st;
  }

  std::lock_guard<std::mutex> share_lock(share_mu_);
  const void* host = nullptr;
  uint64_t bytes = 0;
  auto fill = [&](const VramCopy& copy, bool cached) {
    out->ipc_handle = copy.allocation.ipc_handle;
    out->bytes = copy.allocation.bytes;
    out->device = copy.allocation.device;
    out->pci_bus_id = copy.allocation.pci_bus_id;
    out->cached = cached;
    out->copy_seconds = copy.allocation.copy_seconds;
    out->holders = static_cast<uint32_t>(copy.holders.size());
  };
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(key);
    if (!holds(it)) return not_held();
    Entry& e = it->second;
    auto v = e.vram.find(index);
    if (v != e.vram.end()) {
      v->second.holders.insert(session_id);
      e.last_used = ++tick_;
      fill(v->second, /*cached=*/true);
      return Status::Ok();
    }
    ++e.busy;  // keeps the segment mapped while it is copied without mu_
    host = e.segment->base();
    bytes = e.segment->size();
  }
  VramAllocation allocation;
  st = vram_.Export(index, host, bytes, &allocation);
  std::vector<VramAllocation> dead_vram;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(key);  // still there: busy kept Drop and eviction away
    Entry& e = it->second;
    --e.busy;
    if (st.ok() && e.sessions.count(session_id) == 0) {
      dead_vram.push_back(allocation);  // released (or ended) while the copy ran
      st = not_held();
    } else if (st.ok()) {
      VramCopy& copy = e.vram[index];
      copy.allocation = allocation;
      copy.holders.insert(session_id);
      e.last_used = ++tick_;
      fill(copy, /*cached=*/false);
    }
  }
  FreeVram(dead_vram);
  if (!st.ok()) {
    spdlog::info("share_vram of base {} on device {} refused: {}", key, index,
                 LogSafe(st.message(), 1024));
    return st;
  }
  spdlog::info("share_vram: base {} copied to device {} ({}): {} bytes in {:.3f} s", key,
               allocation.device, allocation.pci_bus_id, allocation.bytes, allocation.copy_seconds);
  return Status::Ok();
}

}  // namespace trainstream::daemon::base
