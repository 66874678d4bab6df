// ControlService's handlers through a real in-process gRPC server: the fixture
// plays the accept loop (a socketpair per connection, its server end recorded in
// the PeerTable with the credentials the test chooses, then handed to gRPC), so
// every call goes through Authorize, WithSession and the status conversion as a
// client's does (Note [Peer credentials for fd channels], peer_credentials.h).
#include "transport/control_service.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/server_posix.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

#include "base/base_cache.h"
#include "catch_compat.h"
#include "planes/optimizer_service.h"

using namespace trainstream::daemon;
namespace v1 = trainstream::v1;

namespace {

bool Has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

struct TempShmDir {
  std::string path;
  TempShmDir() {
    char tmpl[] = "/dev/shm/ts-control-XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TempShmDir() { std::filesystem::remove_all(path); }
};

// A daemon without its process: the registries, the service and a gRPC server
// with no listening port.
struct Daemon {
  Daemon() {
    config.shm_dir = shm.path;
    config.lock_memory = false;
    state.socket_path = "/test/trainstreamd.sock";
    registry = std::make_unique<SessionRegistry>(config, &budget, &optimizer);
    bases = std::make_unique<base::BaseCache>(config, &budget);
    service = std::make_unique<ControlService>(config, &policy, &peers, registry.get(), &budget,
                                               &state, bases.get());
    grpc::ServerBuilder builder;
    builder.RegisterService(service.get());
    server = builder.BuildAndStart();
    REQUIRE(server);
  }
  ~Daemon() {
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    server->Wait();
  }
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // A connection whose peer the daemon knows as `creds` (record = false: a
  // connection the accept loop never recorded).
  std::unique_ptr<v1::Control::Stub> Connect(const PeerCredentials& creds, bool record = true) {
    int fds[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, fds) == 0);
    if (record) peers.Set(fds[0], creds);
    grpc::AddInsecureChannelFromFd(server.get(), fds[0]);
    return v1::Control::NewStub(grpc::CreateInsecureChannelFromFd("control-test", fds[1]));
  }

  TempShmDir shm;
  DaemonConfig config;
  Budget budget{64ull << 20};
  OptimizerService optimizer{1};
  std::unique_ptr<SessionRegistry> registry;
  std::unique_ptr<base::BaseCache> bases;
  AccessPolicy policy;
  PeerTable peers;
  DaemonState state;
  std::unique_ptr<ControlService> service;
  std::unique_ptr<grpc::Server> server;
};

PeerCredentials Allowed() {
  PeerCredentials c;
  c.pid = getpid();
  c.uid = getuid();
  c.gid = getgid();
  c.allowed = true;
  return c;
}

// An attached session: the Attach stream stays open until Detach.
struct Attached {
  explicit Attached(v1::Control::Stub* stub) {
    stream = stub->Attach(&ctx);
    v1::SessionMessage first;
    first.mutable_attach()->set_protocol_version(kProtocolVersion);
    first.mutable_attach()->set_pid(getpid());
    first.mutable_attach()->set_job("control-test");
    REQUIRE(stream->Write(first));
    v1::SessionEvent event;
    REQUIRE(stream->Read(&event));
    REQUIRE(event.has_attached());
    attached = event.attached();
  }
  grpc::Status Detach() {
    stream->WritesDone();
    return stream->Finish();
  }
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionMessage, v1::SessionEvent>> stream;
  v1::Attached attached;
};

}  // namespace

TEST_CASE("A caller that is not allowed is PERMISSION_DENIED, told who may connect",
          "[control_service]") {
  Daemon d;
  PeerCredentials stranger;
  stranger.pid = 77;
  stranger.uid = 4242;
  stranger.allowed = false;
  auto stub = d.Connect(stranger);

  grpc::ClientContext ctx;
  v1::PingResponse pong;
  const grpc::Status st = stub->Ping(&ctx, v1::PingRequest(), &pong);
  CHECK(st.error_code() == grpc::StatusCode::PERMISSION_DENIED);
  CHECK(
      Has(st.error_message(),
          "uid 4242 (pid 77) may not use trainstreamd at /test/trainstreamd.sock; allowed: root"));

  // A session request is refused before any session is looked up.
  grpc::ClientContext ctx2;
  v1::AllocateRegionRequest req;
  req.set_session_id(1);
  v1::AllocateRegionResponse resp;
  CHECK(stub->AllocateRegion(&ctx2, req, &resp).error_code() ==
        grpc::StatusCode::PERMISSION_DENIED);
}

TEST_CASE("A connection the accept loop never recorded is PERMISSION_DENIED", "[control_service]") {
  Daemon d;
  auto stub = d.Connect(Allowed(), /*record=*/false);
  grpc::ClientContext ctx;
  v1::PingResponse pong;
  const grpc::Status st = stub->Ping(&ctx, v1::PingRequest(), &pong);
  CHECK(st.error_code() == grpc::StatusCode::PERMISSION_DENIED);
  CHECK(Has(st.error_message(), "trainstreamd cannot identify the caller (peer 'fd:"));
}

TEST_CASE("Ping answers the daemon's version, protocol and pid", "[control_service]") {
  Daemon d;
  auto stub = d.Connect(Allowed());
  grpc::ClientContext ctx;
  v1::PingResponse pong;
  const grpc::Status st = stub->Ping(&ctx, v1::PingRequest(), &pong);
  REQUIRE(st.ok());
  CHECK(pong.version() == kDaemonVersion);
  CHECK(pong.protocol_version() == kProtocolVersion);
  CHECK(pong.pid() == getpid());
}

TEST_CASE("A request for an unknown session is NOT_FOUND naming session_id", "[control_service]") {
  Daemon d;
  auto stub = d.Connect(Allowed());
  grpc::ClientContext ctx;
  v1::FreeRegionRequest req;
  req.set_session_id(999);
  req.set_session_token("0123");
  req.set_region_id(1);
  v1::FreeRegionResponse resp;
  const grpc::Status st = stub->FreeRegion(&ctx, req, &resp);
  CHECK(st.error_code() == grpc::StatusCode::NOT_FOUND);
  CHECK(st.error_message() ==
        "session_id: no session 999 (it ended or never existed; attach first)");
}

TEST_CASE("A malformed request is INVALID_ARGUMENT naming the field", "[control_service]") {
  Daemon d;
  auto stub = d.Connect(Allowed());

  SECTION("the first message on the session stream is not an AttachRequest") {
    grpc::ClientContext ctx;
    auto stream = stub->Attach(&ctx);
    v1::SessionMessage not_attach;  // no body
    REQUIRE(stream->Write(not_attach));
    stream->WritesDone();
    v1::SessionEvent event;
    CHECK_FALSE(stream->Read(&event));
    const grpc::Status st = stream->Finish();
    CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(st.error_message() ==
          "attach: the first message on the session stream must be an AttachRequest");
  }
  SECTION("a job name with a newline (checked in the service)") {
    grpc::ClientContext ctx;
    auto stream = stub->Attach(&ctx);
    v1::SessionMessage first;
    first.mutable_attach()->set_protocol_version(kProtocolVersion);
    first.mutable_attach()->set_job("two\nlines");
    REQUIRE(stream->Write(first));
    stream->WritesDone();
    const grpc::Status st = stream->Finish();
    CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(st.error_message().rfind("attach.job: 'two", 0) == 0);
    CHECK(Has(st.error_message(), "job names must be printable UTF-8 text"));
  }
  SECTION("a control_bytes out of range (checked in the registry, below the transport)") {
    grpc::ClientContext ctx;
    auto stream = stub->Attach(&ctx);
    v1::SessionMessage first;
    first.mutable_attach()->set_protocol_version(kProtocolVersion);
    first.mutable_attach()->set_control_bytes(1);
    REQUIRE(stream->Write(first));
    stream->WritesDone();
    const grpc::Status st = stream->Finish();
    CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(st.error_message().rfind("attach.control_bytes: 1 is out of range [", 0) == 0);
  }
}

TEST_CASE("Attach, then session requests through WithSession, then detach", "[control_service]") {
  Daemon d;
  auto stub = d.Connect(Allowed());
  Attached session(stub.get());
  CHECK(session.attached.session_id() != 0);
  CHECK(session.attached.shm_dir() == d.shm.path);
  CHECK(session.attached.control().length() > 0);
  CHECK(d.registry->size() == 1);

  v1::AllocateRegionRequest req;
  req.set_session_id(session.attached.session_id());
  req.set_session_token(session.attached.session_token());
  req.set_bytes(4096);
  req.set_kind(v1::SEGMENT_KIND_SESSION);
  req.set_label("activations");
  {
    grpc::ClientContext ctx;
    v1::AllocateRegionResponse resp;
    const grpc::Status st = stub->AllocateRegion(&ctx, req, &resp);
    REQUIRE(st.ok());
    CHECK(resp.region().length() == 4096);
    CHECK(resp.region().region_id() != 0);
  }
  {
    // A malformed field of a known session: the handler's own check.
    grpc::ClientContext ctx;
    v1::AllocateRegionRequest bad = req;
    bad.set_label("tab\there");
    v1::AllocateRegionResponse resp;
    const grpc::Status st = stub->AllocateRegion(&ctx, bad, &resp);
    CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(st.error_message().rfind("label: 'tab", 0) == 0);
  }
  {
    // The wrong token: the registry's PERMISSION_DENIED, converted unchanged.
    grpc::ClientContext ctx;
    v1::AllocateRegionRequest wrong = req;
    wrong.set_session_token("not-the-token");
    v1::AllocateRegionResponse resp;
    const grpc::Status st = stub->AllocateRegion(&ctx, wrong, &resp);
    CHECK(st.error_code() == grpc::StatusCode::PERMISSION_DENIED);
    CHECK(st.error_message() ==
          "session_token: does not match session " + std::to_string(session.attached.session_id()));
  }
  {
    // More than the budget: the memory layer's RESOURCE_EXHAUSTED, converted unchanged.
    grpc::ClientContext ctx;
    v1::AllocateRegionRequest big = req;
    big.set_bytes(1ull << 30);
    v1::AllocateRegionResponse resp;
    const grpc::Status st = stub->AllocateRegion(&ctx, big, &resp);
    CHECK(st.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
    CHECK(st.error_message().rfind("memory budget exhausted: asked ", 0) == 0);
  }

  CHECK(session.Detach().ok());
  CHECK(d.registry->size() == 0);
}
