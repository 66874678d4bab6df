// BaseCache: the daemon's frozen bases (docs/design.md, "Base cache"). A base
// is one read-only segment (kind SEGMENT_KIND_BASE) holding every tensor of a
// checkpoint, the block-stack linear weights quantized when a format is asked,
// and a manifest (wire/base_manifest.h) clients build views from.
//
// Key: the checkpoint files' identity (device, inode, size, mtime, header hash)
// + format + block size + the owning uid (a base segment belongs to one uid; see
// docs/base-cache.md). Loading the same key again returns the cached base;
// concurrent loads of one key wait for the first.
//
// Reference counts: a session that loads (or attaches) a base holds one
// reference until it releases it or ends. A base with no references stays
// cached; it is evicted, least recently used first, when a budget reservation
// (a new base, or any session's allocation) needs room, and never while a
// session holds it. Drop removes an unreferenced base at once.
//
// VRAM copies (share_vram): a session holding a reference may ask for the base
// on a GPU (ShareVram). The first request per (base, device) copies the whole
// segment into one device allocation and exports it as a CUDA IPC handle; later
// ones get the same handle. A copy is held by the sessions that asked for it and
// freed when the last of them releases the base or ends (so an unreferenced base,
// the only kind Drop and eviction touch, never holds VRAM), or when the cache is
// destroyed. Note [CUDA in the daemon only on request] (vram_export.h).
//
// Locking: mu_ guards the entry table. Reserving budget and filling a segment
// happen without mu_ (the budget's reclaimer calls EvictUnreferenced, which
// takes it). share_mu_ serialises making VRAM copies and is taken before mu_;
// the copy itself runs without mu_ (the entry is marked busy meanwhile).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "base/base_fill.h"
#include "base/base_loader.h"
#include "base/vram_export.h"
#include "memory/budget.h"
#include "memory/shm_segment.h"
#include "process/config.h"
#include "security/caller.h"
#include "trainstream/status.h"

namespace trainstream::daemon::base {

struct BaseLoadOptions {
  std::string path;
  std::string format;      // "", "none", "int8", "nf4", "fp8", "nvfp4"
  int64_t block_size = 0;  // 0: 64
  uint32_t threads = 0;    // loader threads; 0 or more than the daemon's load_threads: those
};

// What status and clients see of one base.
struct BaseInfo {
  std::string key;
  std::string path;
  std::string format;
  int64_t block_size = 0;
  uint32_t owner_uid = 0;
  std::string segment_name;
  uint64_t segment_bytes = 0;
  uint64_t source_bytes = 0;
  uint32_t tensors = 0;
  uint32_t quantized_tensors = 0;
  uint32_t refcount = 0;
  std::vector<uint64_t> sessions;  // holders
  double load_seconds = 0;
  double allocate_seconds = 0;  // of load_seconds: reserving and creating the segment
  uint32_t load_threads = 0;    // loader threads the load ran
  uint64_t scratch_peak_bytes = 0;
  bool cached = false;       // true when Load found it already loaded
  uint32_t vram_copies = 0;  // GPUs holding a VRAM copy (share_vram)
  uint64_t vram_bytes = 0;
};

// What a session gets from ShareVram.
struct VramShareInfo {
  std::string ipc_handle;  // cudaIpcMemHandle_t bytes
  uint64_t bytes = 0;
  int device = -1;
  std::string pci_bus_id;
  bool cached = false;  // the copy existed already
  double copy_seconds = 0;
  uint32_t holders = 0;
};

class BaseCache {
 public:
  // `budget` must outlive the cache.
  BaseCache(const DaemonConfig& config, Budget* budget);
  BaseCache(const BaseCache&) = delete;
  BaseCache& operator=(const BaseCache&) = delete;
  ~BaseCache();

  // Loads `options.path` for `caller` (or finds it cached). With `session_id` != 0
  // the session takes a reference. The tensors are read on min(options.threads,
  // the config's load_threads) threads (base_fill.h), whose scratch is reserved
  // from the budget beside the segment for the length of the load (a budget too
  // full for it loads on one thread). `progress` may return false to cancel: it is
  // polled while headers are parsed (with an empty LoadProgress), then about
  // every 10 ms while the tensors are read, always on the calling thread. A
  // cancelled load gives back its budget and segment and returns CANCELLED
  // (base_loader.h).
  Status Load(const PeerCredentials& caller, const BaseLoadOptions& options, uint64_t session_id,
              const std::function<bool(const LoadProgress&)>& progress, BaseInfo* out);
  // Gives `session_id`'s reference to `key` back. NOT_FOUND if it holds none.
  Status Release(uint64_t session_id, const std::string& key);
  // Gives back every reference the session holds (it ended). Idempotent.
  void ReleaseSession(uint64_t session_id);
  // Removes an unreferenced base now. FAILED_PRECONDITION while referenced.
  // Only its owner or an admin may drop it.
  Status Drop(const PeerCredentials& caller, const std::string& key, uint64_t* bytes_freed);
  // Evicts unreferenced bases, least recently used first, until at least
  // `bytes_needed` were freed or none is left. Returns the bytes freed.
  uint64_t EvictUnreferenced(uint64_t bytes_needed);
  // Every base (admins) or the caller's own.
  std::vector<BaseInfo> List(const PeerCredentials& caller);
  uint64_t bytes() const;
  // The base `key` on a GPU for `session_id`, which must hold a reference to it
  // (NOT_FOUND otherwise). Errors: see VramExporter (FAILED_PRECONDITION without
  // CUDA or a GPU, INVALID_ARGUMENT for an unknown device, RESOURCE_EXHAUSTED).
  Status ShareVram(uint64_t session_id, const std::string& key, const VramDevice& device,
                   VramShareInfo* out);

 private:
  struct VramCopy {
    VramAllocation allocation;
    std::set<uint64_t> holders;  // sessions that asked for it; a subset of Entry::sessions
  };
  struct Entry {
    enum class State { kLoading, kReady } state = State::kLoading;
    BaseInfo info;
    std::unique_ptr<ShmSegment> segment;
    std::set<uint64_t> sessions;
    uint64_t last_used = 0;        // tick of the LRU clock
    std::map<int, VramCopy> vram;  // by the daemon's CUDA device index
    int busy = 0;                  // VRAM copies in progress: not dropped or evicted meanwhile
  };
  void FillInfo(const Entry& e, BaseInfo* out) const;
  void DropLocked(std::map<std::string, Entry>::iterator it,
                  std::vector<std::unique_ptr<ShmSegment>>* dead,
                  std::vector<VramAllocation>* dead_vram);
  void Free(std::vector<std::unique_ptr<ShmSegment>> dead);
  // Removes `session_id` from the holders of e's VRAM copies; moves copies left
  // with none to `dead_vram`.
  static void ReleaseVramLocked(Entry* e, uint64_t session_id,
                                std::vector<VramAllocation>* dead_vram);
  void FreeVram(const std::vector<VramAllocation>& dead);

  const DaemonConfig config_;
  Budget* const budget_;
  mutable std::mutex mu_;
  std::condition_variable loaded_cv_;     // signalled when a load finishes or fails
  std::map<std::string, Entry> entries_;  // Guarded by mu_.
  uint64_t tick_ = 0;                     // Guarded by mu_.
  std::mutex share_mu_;                   // serialises ShareVram's copies; before mu_
  VramExporter vram_;
};

}  // namespace trainstream::daemon::base
