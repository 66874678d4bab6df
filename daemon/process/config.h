// DaemonConfig: every setting of trainstreamd, from defaults, then the config
// file, then command-line flags (later wins). The file format is documented in
// docs/daemon.md: one `key = value` per line, `#` starts a comment.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "trainstream/status.h"

namespace trainstream::daemon {

struct DaemonConfig {
  std::string socket_path;  // empty: the default for this uid (DefaultDaemonSocket)
  std::string shm_dir = "/dev/shm";
  std::string budget = "50%";              // bytes, K/M/G/T suffix, or a percentage of RAM
  std::string log_level = "info";          // trace, debug, info, warn, error, critical, off
  unsigned threads = 0;                    // optimizer worker threads; 0: one per core
  unsigned load_threads = 0;               // base loader threads per load; 0: AvailableCpus()
  uint64_t idle_exit_s = 0;                // embedded mode: exit after this long idle; 0: never
  std::string allow_group;                 // members may use the daemon
  std::string admin_group;                 // members may also shut it down
  uint64_t max_region_bytes = 1ull << 40;  // per AllocateRegion request
  uint32_t max_connections_per_uid = 64;   // open connections one uid may hold; 0: no cap
  bool lock_memory = true;                 // mlock() segments (counted as pinned)
  // Seconds an adopted optimizer state waits for its client after a restart
  // (docs/recovery.md); 0 turns recovery off (no commit records, no adoption).
  uint64_t recovery_grace_s = 300;
  bool foreground = false;
};

// Parses "1073741824", "512M", "64G", "1.5T", "1024K" (binary units) into bytes.
// Fails with INVALID_ARGUMENT naming `field` for anything else.
Status ParseBytes(const std::string& text, const std::string& field, uint64_t* out);

// Like ParseBytes, and also accepts "NN%" of `ram_bytes`.
Status ParseBudget(const std::string& text, uint64_t ram_bytes, uint64_t* out);

// Applies `key = value` lines of `text` (the content of `origin`, used in error
// messages as "origin:line") on top of `config`.
Status ParseConfigText(const std::string& text, const std::string& origin, DaemonConfig* config);

// Reads the file at `path` and applies it with ParseConfigText.
Status LoadConfigFile(const std::string& path, DaemonConfig* config);

// The socket a daemon started without --socket serves: $TRAINSTREAM_SOCKET,
// else /run/trainstream/trainstreamd.sock for root, else the per-user embedded
// socket ($XDG_RUNTIME_DIR/trainstream/... or /tmp/trainstream-$UID/...).
std::string DefaultDaemonSocket();

// Total physical RAM in bytes.
uint64_t PhysicalRamBytes();

// CPUs this process may run on (its affinity mask), at least 1.
unsigned AvailableCpus();

// The loader threads a base load runs: `requested` (0: no wish) capped at
// config.load_threads, whose 0 means AvailableCpus().
unsigned BaseLoadThreads(const DaemonConfig& config, unsigned requested);

}  // namespace trainstream::daemon
