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
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "trainstream/status.h"
#include "trainstream/wire/dtype.h"
#include "trainstream/wire/segment_kind.h"

namespace trainstream {

// The socket a client uses when none is given: $TRAINSTREAM_SOCKET, else the
// system service's /run/trainstream/trainstreamd.sock if it exists (or its
// directory keeps this uid out: Connect then says so), else the
// per-user embedded socket ($XDG_RUNTIME_DIR/trainstream/trainstreamd.sock or
// /tmp/trainstream-$UID/trainstreamd.sock).
std::string DefaultSocketPath();
// The per-user embedded socket path (see above), whether or not it exists.
std::string EmbeddedSocketPath();

// Element types: the wire's one DType (Note [DType numbers are the wire's]);
// DTypeSize(d) is its bytes per element. What a segment holds: the wire's
// SegmentKind (Note [Segment kind numbers are the wire's]).
using wire::DType;
using wire::DTypeSize;
using wire::SegmentKind;

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

namespace platform {
class ShmMapping;  // the platform seam's mapping (not part of this API)
}  // namespace platform

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
  MappedRegion(RegionInfo info, std::unique_ptr<platform::ShmMapping> mapping);
  RegionInfo info_;
  std::unique_ptr<platform::ShmMapping> mapping_;  // the whole segment
  void* base_ = nullptr;                           // mapping_'s first byte
};

struct PingResult {
  std::string version;
  uint32_t protocol_version = 0;
  int64_t pid = 0;
  double uptime_s = 0;
};

// Data-parallel membership (proto GroupMembership; docs/data-parallel.md).
// An empty key means "not in a group".
struct GroupOptions {
  std::string key;
  int32_t local_rank = 0;
  int32_t local_world_size = 1;
  int32_t node_rank = 0;
  int32_t nnodes = 1;
  int32_t world_size = 1;
  double timeout_s = 60;  // to wait for every local rank to attach and register
};

struct AttachOptions {
  std::string job;
  int32_t rank = -1;
  int32_t local_rank = -1;
  uint64_t control_bytes = 0;  // 0: the daemon's default
  GroupOptions group;          // key empty: an independent session
  // Non-empty: take over the optimizer state a restarted daemon adopted for
  // the session this token was issued to (Session::recovery_token(); see
  // docs/recovery.md). Session::resumed() then describes it.
  std::string resume_token;
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
  uint32_t threads = 0;          // daemon worker threads for this session's updates (0: all)
  std::string weights_checksum;  // group sessions: digest of the initial weights
  uint64_t grad_pool_bytes = 0;  // a gradient staging pool of about this size (0: slots)
};

struct ParameterSlots {
  uint64_t param_id = 0;
  uint64_t grad_offset = 0;   // into the staging region's segment
  uint64_t param_offset = 0;  // into the staging region's segment
  uint64_t numel = 0;
  uint64_t sum_offset = 0;  // group sessions: the fp32 machine-sum slot
};

struct Registration {
  std::unique_ptr<MappedRegion> staging;
  std::vector<ParameterSlots> slots;
  uint64_t grad_pool_offset = 0;  // the gradient staging pool granted (0 bytes: slots)
  uint64_t grad_pool_bytes = 0;
};

// A resumed session's state (proto ResumedState; docs/recovery.md).
struct ResumedParam {
  uint64_t param_id = 0;
  uint64_t applied_step = 0;  // last step whose update of it landed
  bool skipped = false;       // that update was skipped (non-finite gradient)
  uint64_t torch_step = 0;
};
struct ResumedRegistration {
  RegionInfo staging;  // the same segment as before: not mapped again here
  std::vector<ParameterSlots> slots;
  std::vector<ResumedParam> params;
  uint64_t grad_pool_offset = 0;
  uint64_t grad_pool_bytes = 0;
};
struct ResumedState {
  std::vector<ResumedRegistration> registrations;
  uint64_t completed_step = 0;  // the last step whose STEP_DONE the dead daemon sent
  double completed_grad_norm = 0;
  int32_t completed_status = 0;
  uint32_t completed_params_updated = 0;
  uint64_t restored_subchunks = 0;  // what the adopting daemon did
  uint64_t rolled_forward = 0;
  double waited_s = 0;
};

// How a session ended (Session::end_kind).
enum class SessionEnd {
  kNone,        // still attached
  kDaemonGone,  // the stream broke: the daemon died (its state may be adopted)
  kShutdown,    // the daemon shut down cleanly (sessions and their state freed)
  kEnded,       // the daemon ended this session (why says why)
  kDetached,    // this process detached
};

// What Client::Shutdown asks for (Note [A restart keeps the optimizer state] in
// daemon/process/daemon.cc).
enum class ShutdownMode {
  kKeepState,     // stop now, leaving the sessions' optimizer state for the next
                  // daemon to adopt for recovery_grace (as a crash does)
  kDrain,         // refuse new sessions, stop cleanly once the last one detaches
  kDiscardState,  // stop now cleanly: end the sessions and free their state
};
struct ShutdownResult {
  uint32_t sessions = 0;          // attached when the daemon got the request
  bool state_kept = false;        // it stops keeping their state (kKeepState with something
                                  // to keep and recovery_grace > 0); false from an older daemon
  uint64_t recovery_grace_s = 0;  // how long a kept state waits for its client
};

// Frozen bases (docs/base-cache.md).
struct BaseLoadOptions {
  std::string path;         // a .safetensors file or model folder; made absolute here
  std::string format;       // "" / "none", "int8", "nf4", "fp8", "nvfp4"
  uint32_t block_size = 0;  // int8 / nf4; 0 takes 64
  uint32_t threads = 0;     // loader threads; 0: the daemon's load_threads (also the cap)
};

struct BaseProgress {
  uint64_t bytes_read = 0, bytes_total = 0;
  uint32_t tensors_done = 0, tensors_total = 0;
  uint32_t threads = 0;  // loader threads at work
};
// Called on the calling thread as the daemon reports progress.
using BaseProgressFn = std::function<void(const BaseProgress&)>;

struct BaseInfo {
  std::string key, path, format;
  uint32_t block_size = 0;
  uint32_t owner_uid = 0;
  std::string segment_name;
  uint64_t segment_bytes = 0;
  uint64_t source_bytes = 0;
  uint32_t tensors = 0, quantized_tensors = 0;
  uint32_t refcount = 0;
  std::vector<uint64_t> sessions;
  double load_seconds = 0;
  double allocate_seconds = 0;  // of load_seconds: reserving and creating the segment
  uint32_t load_threads = 0;    // threads the daemon read and quantized on
  uint64_t scratch_peak_bytes = 0;
  bool cached = false;
  uint32_t vram_copies = 0;  // GPUs holding a VRAM copy (share_vram)
  uint64_t vram_bytes = 0;
};

// A base's VRAM copy on one GPU, as Session::ShareBaseVram hands it out.
struct VramShare {
  std::string ipc_handle;  // cudaIpcMemHandle_t (64 bytes); open with cudaIpcOpenMemHandle
  uint64_t bytes = 0;      // the allocation: the whole base segment, same offsets
  int32_t device = -1;     // the daemon's device index
  std::string pci_bus_id;  // the device, as cudaDeviceGetPCIBusId writes it
  bool cached = false;     // false when this call made the copy
  double copy_seconds = 0;
  uint32_t holders = 0;  // sessions sharing it now
};

class Session;

// A connection to one daemon. Thread-safe.
class Client {
 public:
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;
  ~Client();

  // Connects to the daemon at `socket_path`. Fails with kPermissionDenied at once
  // when this uid may not open the socket (naming its group to join), with
  // kResourceExhausted when the daemon accepts and closes this uid's connection
  // (its max_connections_per_uid, or out of fds), and with kUnavailable (naming
  // the path and what is there) when nothing answers within `timeout_ms`.
  static Status Connect(const std::string& socket_path, int timeout_ms,
                        std::unique_ptr<Client>* out);

  const std::string& socket_path() const;

  Status Ping(PingResult* out);
  // The daemon's status as JSON (the format `trainstreamctl status --json`
  // prints; documented in docs/status-json.md).
  Status StatusJson(std::string* out);
  // Admin: asks the daemon to stop (docs/daemon.md, "Stopping"); `out` (may be
  // null) gets its answer.
  Status Shutdown(ShutdownMode mode, ShutdownResult* out);

  // Opens a session stream; the Session keeps it open.
  Status Attach(const AttachOptions& options, std::unique_ptr<Session>* out);

  // Loads a base into the daemon's cache (or finds it there) without taking a
  // reference: it stays cached until dropped or evicted. `progress` may be null.
  Status LoadBase(const BaseLoadOptions& options, const BaseProgressFn& progress, BaseInfo* out);
  // The caller's cached bases (every base for admins).
  Status ListBases(std::vector<BaseInfo>* out);
  // Removes an unreferenced base now; kFailedPrecondition while sessions hold it.
  Status DropBase(const std::string& key, uint64_t* bytes_freed);

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

  // Loads (or finds) a base, takes a reference for this session (given back by
  // ReleaseBase or when the session ends) and maps its segment read-only into
  // `mapped` (offset 0: the SegmentHeader, whose manifest_offset leads to the
  // manifest, wire/base_manifest.h). `mapped` may outlive the reference, not
  // the process's need for it: keep the reference while you use the mapping.
  Status LoadBase(const BaseLoadOptions& options, const BaseProgressFn& progress, BaseInfo* info,
                  std::unique_ptr<MappedRegion>* mapped);
  Status ReleaseBase(const std::string& key);
  // The base `key` (this session must hold a reference) copied once to a GPU by
  // the daemon and handed out as a CUDA IPC handle (docs/base-cache.md,
  // "share_vram"). The GPU is `pci_bus_id` (from cudaDeviceGetPCIBusId in this
  // process) or, when that is empty, the daemon's device index `device`. The copy
  // lives until every session that asked for it has released the base or ended.
  // kFailedPrecondition: the daemon was built without CUDA or sees no GPU;
  // kInvalidArgument: no such device; kResourceExhausted: not enough VRAM.
  Status ShareBaseVram(const std::string& key, const std::string& pci_bus_id, int32_t device,
                       VramShare* out);

  // False once the daemon closed the stream or went away; `why` says what
  // happened (e.g. "daemon shut down: SIGTERM").
  bool alive(std::string* why) const;
  SessionEnd end_kind() const;

  // Proves ownership of this session's optimizer state to a daemon that
  // adopts it after this one dies (AttachOptions::resume_token). Empty when
  // the daemon runs with recovery off. A secret: keep it in memory. A group
  // session's becomes its group's at RegisterParameters.
  std::string recovery_token() const;
  // Attached with a resume token: the state taken over; else null.
  const ResumedState* resumed() const;

  // Ends the session now (the destructor does the same).
  void Detach();

  struct Impl;

 private:
  friend class Client;
  explicit Session(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace trainstream
