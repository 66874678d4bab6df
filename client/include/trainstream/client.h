// libtrainstream_client: the C++ client of trainstreamd (gRPC over a unix socket,
// plus mapping of the shared-memory segments it hands out). No torch here.
//
// Typical use:
//   auto client = trainstream::Client::Connect(trainstream::DefaultSocketPath());
//   auto session = client->Attach({.job = "run-1"});
//   ... session->RegisterParameters(...), session->AllocateRegion(...)
// A Session holds the session stream open; destroying it (or the process
// dying) ends the session and the daemon frees what it held.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "trainstream/status.h"

namespace trainstream {

// The socket a client uses when none is given: $TRAINSTREAM_SOCKET, else the
// system service's /run/trainstream/trainstreamd.sock if it exists, else the
// per-user embedded socket ($XDG_RUNTIME_DIR/trainstream/trainstreamd.sock or
// /tmp/trainstream-$UID/trainstreamd.sock).
std::string DefaultSocketPath();
// The per-user embedded socket path (see above), whether or not it exists.
std::string EmbeddedSocketPath();

enum class DType { kFloat32 = 1, kBFloat16 = 2, kFloat16 = 3 };
enum class SegmentKind { kBase = 1, kSession = 2, kState = 3 };

size_t DTypeSize(DType dtype);

// A byte range of a daemon segment, as the daemon described it.
struct RegionInfo {
  uint64_t region_id = 0;
  std::string segment_name;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t segment_size = 0;
  SegmentKind kind = SegmentKind::kSession;
  bool read_only = false;
};

// A region mapped into this process. Unmaps on destruction. Non-copyable.
class MappedRegion {
 public:
  MappedRegion(const MappedRegion&) = delete;
  MappedRegion& operator=(const MappedRegion&) = delete;
  ~MappedRegion();

  const RegionInfo& info() const { return info_; }
  // First byte of the region (the segment mapping plus info().offset).
  void* data() const { return static_cast<char*>(base_) + info_.offset; }
  uint64_t size() const { return info_.length; }

  // Maps `info` from `shm_dir`; read-only regions are mapped PROT_READ.
  static Status Map(const std::string& shm_dir, const RegionInfo& info,
                    std::unique_ptr<MappedRegion>* out);

 private:
  MappedRegion(RegionInfo info, void* base, size_t mapped)
      : info_(std::move(info)), base_(base), mapped_(mapped) {}
  RegionInfo info_;
  void* base_ = nullptr;
  size_t mapped_ = 0;
};

struct PingResult {
  std::string version;
  uint32_t protocol_version = 0;
  int64_t pid = 0;
  double uptime_s = 0;
};

struct AttachOptions {
  std::string job;
  int32_t rank = -1;
  int32_t local_rank = -1;
  uint64_t control_bytes = 0;  // 0: the daemon's default
};

struct AdamWHyperParams {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 1e-2;
};

struct ParameterSpec {
  uint64_t param_id = 0;
  std::string name;
  std::vector<int64_t> shape;
  DType dtype = DType::kFloat32;
  DType grad_dtype = DType::kFloat32;
  uint32_t group = 0;
};

struct RegisterOptions {
  std::vector<AdamWHyperParams> groups;
  DType moment_dtype = DType::kFloat32;
  double max_grad_norm = 0;  // 0: no clipping
  uint64_t seed = 0;
  uint32_t threads = 0;  // daemon worker threads for this session's updates (0: all)
};

struct ParameterSlots {
  uint64_t param_id = 0;
  uint64_t grad_offset = 0;   // into the staging region's segment
  uint64_t param_offset = 0;  // into the staging region's segment
  uint64_t numel = 0;
};

struct Registration {
  std::unique_ptr<MappedRegion> staging;
  std::vector<ParameterSlots> slots;
};

class Session;

// A connection to one daemon. Thread-safe.
class Client {
 public:
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;
  ~Client();

  // Connects to the daemon at `socket_path`. Fails with kUnavailable (naming the
  // path) when nothing answers within `timeout_ms`.
  static Status Connect(const std::string& socket_path, int timeout_ms,
                        std::unique_ptr<Client>* out);

  const std::string& socket_path() const;

  Status Ping(PingResult* out);
  // The daemon's status as JSON (the format `trainstreamctl status --json`
  // prints; documented in docs/status-json.md).
  Status StatusJson(std::string* out);
  // Admin: asks the daemon to stop (drain=false) or drain.
  Status Shutdown(bool drain, uint32_t* sessions_attached);

  // Opens a session stream; the Session keeps it open.
  Status Attach(const AttachOptions& options, std::unique_ptr<Session>* out);

  struct Impl;

 private:
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// One attached session. Thread-safe. Destroying it detaches.
class Session {
 public:
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  ~Session();

  uint64_t id() const;
  // The session's secret (sent with every unary RPC). Only for code in this
  // process that must speak the protocol itself (e.g. the Python bindings).
  const std::string& token() const;
  const std::string& shm_dir() const;
  // The control region (rings), mapped read-write.
  MappedRegion& control();

  // Registers parameters with the daemon's optimizer and maps their staging
  // slots. May be called more than once (e.g. add_param_group); param ids must
  // be new each time.
  Status RegisterParameters(const RegisterOptions& options,
                            const std::vector<ParameterSpec>& params, Registration* out);
  Status AllocateRegion(uint64_t bytes, const std::string& label,
                        std::unique_ptr<MappedRegion>* out);
  Status FreeRegion(uint64_t region_id, uint64_t* bytes_freed);

  // False once the daemon closed the stream or went away; `why` says what
  // happened (e.g. "daemon shut down: SIGTERM").
  bool alive(std::string* why) const;

  // Ends the session now (the destructor does the same).
  void Detach();

  struct Impl;

 private:
  friend class Client;
  explicit Session(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace trainstream
