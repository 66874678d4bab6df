// SessionRegistry without the transport: sessions attach (Create) with no
// stream, register parameters, allocate regions and end, against a real
// OptimizerService and segments in a temporary /dev/shm folder (where there is
// none, as on Windows, one in the system's temporary folder).
#include "sessions/session_registry.h"

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "catch_compat.h"
#include "memory/budget.h"
#include "planes/optimizer_service.h"
#include "trainstream/platform/this_process.h"
#include "trainstream/platform/user.h"

using namespace trainstream;
using namespace trainstream::daemon;
namespace fs = std::filesystem;
using trainstream::platform::CurrentUserId;

namespace {

// A new empty folder for one test's segments.
std::string NewSegmentFolder() {
  static int made = 0;
  const fs::path base =
      fs::is_directory("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
  const fs::path dir = base / ("ts-registry-" + std::to_string(platform::CurrentProcessId()) + "-" +
                               std::to_string(++made));
  fs::remove_all(dir);
  fs::create_directory(dir);
  return dir.string();
}

// Files of this daemon's segments in `dir`.
size_t SegmentFiles(const std::string& dir) {
  size_t n = 0;
  for (auto& e : fs::directory_iterator(dir))
    n += e.path().filename().string().rfind("trainstream-", 0) == 0;
  return n;
}

struct Daemon {
  Daemon() : budget(uint64_t{1} << 32), optimizer(2) {
    dir = NewSegmentFolder();
    config.shm_dir = dir;
    config.lock_memory = false;
    registry = std::make_unique<SessionRegistry>(config, &budget, &optimizer);
  }
  ~Daemon() {
    registry.reset();  // ends every session: its segments go
    fs::remove_all(dir);
  }
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  static PeerCredentials Caller(platform::UserId uid) {
    PeerCredentials c;
    c.pid = static_cast<pid_t>(platform::CurrentProcessId());
    c.uid = uid;
    c.allowed = true;
    return c;
  }

  Status Attach(platform::UserId uid, std::shared_ptr<Session>* out) {
    v1::AttachRequest req;
    req.set_protocol_version(1);
    req.set_job("test");
    v1::Attached attached;
    return registry->Create(Caller(uid), req, nullptr, out, &attached);
  }

  static v1::RegisterParametersRequest OneParam(uint64_t id, uint64_t numel) {
    v1::RegisterParametersRequest req;
    auto* g = req.add_groups();
    g->set_lr(0.1);
    g->set_beta1(0.9);
    g->set_beta2(0.999);
    g->set_eps(1e-8);
    auto* p = req.add_params();
    p->set_param_id(id);
    p->set_name("w" + std::to_string(id));
    p->add_shape(static_cast<int64_t>(numel));
    p->set_dtype(v1::DTYPE_FLOAT32);
    return req;
  }

  std::string dir;
  DaemonConfig config;
  Budget budget;
  OptimizerService optimizer;
  std::unique_ptr<SessionRegistry> registry;  // last: ends its sessions first
};

}  // namespace

TEST_CASE("SessionRegistry: attach, find, end", "[registry]") {
  Daemon d;
  std::shared_ptr<Session> s;
  REQUIRE(d.Attach(CurrentUserId(), &s).ok());
  REQUIRE(s);
  CHECK(d.registry->size() == 1);
  CHECK(SegmentFiles(d.dir) == 1);  // the control region

  std::shared_ptr<Session> found;
  CHECK(d.registry->Find(s->id, s->token, Daemon::Caller(CurrentUserId()), &found).ok());
  CHECK(found == s);
  CHECK(d.registry->Find(s->id, "wrong", Daemon::Caller(CurrentUserId()), &found).code() ==
        StatusCode::kPermissionDenied);
  CHECK(d.registry->Find(s->id, s->token, Daemon::Caller(CurrentUserId() + 1000), &found).code() ==
        StatusCode::kPermissionDenied);
  CHECK(d.registry->Find(s->id + 1, s->token, Daemon::Caller(CurrentUserId()), &found).code() ==
        StatusCode::kNotFound);

  d.registry->End(s->id, "test over", false);
  CHECK(d.registry->size() == 0);
  CHECK(SegmentFiles(d.dir) == 0);
  {
    std::lock_guard<std::mutex> lock(s->mu);
    CHECK(s->closed);
  }
  CHECK(d.registry->Find(s->id, s->token, Daemon::Caller(CurrentUserId()), &found).code() ==
        StatusCode::kNotFound);
  d.registry->End(s->id, "again", false);  // idempotent
}

TEST_CASE("SessionRegistry: register gives slots and a staging region; the end frees them",
          "[registry]") {
  Daemon d;
  std::shared_ptr<Session> s;
  REQUIRE(d.Attach(CurrentUserId(), &s).ok());
  v1::RegisterParametersResponse resp;
  REQUIRE(d.registry->RegisterParameters(*s, Daemon::OneParam(3, 100), &resp).ok());
  REQUIRE(resp.slots_size() == 1);
  CHECK(resp.slots(0).param_id() == 3);
  CHECK(resp.slots(0).numel() == 100);
  CHECK(resp.staging().segment_size() > resp.slots(0).param_offset());
  CHECK(SegmentFiles(d.dir) == 3);  // control, optimizer state, staging

  // The same id twice is refused, and nothing is created for it.
  v1::RegisterParametersResponse again;
  CHECK(d.registry->RegisterParameters(*s, Daemon::OneParam(3, 100), &again).code() ==
        StatusCode::kInvalidArgument);
  CHECK(SegmentFiles(d.dir) == 3);
  // Another parameter in a second call is fine (add_param_group).
  CHECK(d.registry->RegisterParameters(*s, Daemon::OneParam(4, 10), &again).ok());
  CHECK(SegmentFiles(d.dir) == 5);
  {
    std::lock_guard<std::mutex> lock(s->mu);
    CHECK(s->param_ids.size() == 2);
  }
  d.registry->End(s->id, "test over", false);
  CHECK(SegmentFiles(d.dir) == 0);
  v1::RegisterParametersResponse late;
  CHECK(d.registry->RegisterParameters(*s, Daemon::OneParam(5, 10), &late).code() ==
        StatusCode::kNotFound);
}

TEST_CASE("SessionRegistry: one uid holds at most kMaxSessionsPerUid sessions", "[registry]") {
  Daemon d;
  std::vector<std::shared_ptr<Session>> held;
  for (size_t i = 0; i < kMaxSessionsPerUid; ++i) {
    std::shared_ptr<Session> s;
    REQUIRE(d.Attach(CurrentUserId(), &s).ok());
    held.push_back(std::move(s));
  }
  std::shared_ptr<Session> one_more;
  Status st = d.Attach(CurrentUserId(), &one_more);
  CHECK(st.code() == StatusCode::kResourceExhausted);
  CHECK(st.message().find("detach some first") != std::string::npos);
  // Another uid is not held back by this one's sessions.
  std::shared_ptr<Session> other;
  CHECK(d.Attach(CurrentUserId() + 1000, &other).ok());
  // Ending one makes room again.
  d.registry->End(held.front()->id, "room", false);
  CHECK(d.Attach(CurrentUserId(), &one_more).ok());
}

TEST_CASE("SessionRegistry: one session holds at most kMaxRegionsPerSession regions",
          "[registry]") {
  Daemon d;
  std::shared_ptr<Session> s;
  REQUIRE(d.Attach(CurrentUserId(), &s).ok());
  v1::AllocateRegionRequest req;
  req.set_bytes(64);
  req.set_label("r");
  size_t made = 1;  // the control region counts
  Status st;
  v1::Region region;
  while (made < kMaxRegionsPerSession) {
    st = d.registry->AllocateRegion(*s, req, &region);
    REQUIRE(st.ok());
    ++made;
  }
  st = d.registry->AllocateRegion(*s, req, &region);
  CHECK(st.code() == StatusCode::kResourceExhausted);
  CHECK(st.message().find("free some") != std::string::npos);
  // Freeing one (no parameters registered: unmapped at once) makes room.
  v1::FreeRegionRequest free_req;
  free_req.set_region_id(region.region_id());
  uint64_t freed = 0;
  REQUIRE(d.registry->FreeRegion(*s, free_req, &freed).ok());
  CHECK(freed > 0);
  CHECK(d.registry->AllocateRegion(*s, req, &region).ok());
  // The control region is the session's, not the client's to free.
  free_req.set_region_id(s->control_region_id);
  CHECK(d.registry->FreeRegion(*s, free_req, &freed).code() == StatusCode::kInvalidArgument);
}
