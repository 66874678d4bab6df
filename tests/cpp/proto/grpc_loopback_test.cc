// The control service's generated stubs over a real gRPC connection on
// loopback TCP: built and run on Linux and, against the cross-built gRPC
// (scripts/windows-cross.sh, deps step), under wine64 (docs/windows.md). It
// checks the gRPC runtime itself works there; the daemon's own transport
// (a unix socket) is not this.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>

#include "catch_compat.h"
#include "trainstream/grpc_status.h"
#include "trainstream/v1/control.grpc.pb.h"

namespace v1 = trainstream::v1;

namespace {

// Answers Ping, and Shutdown with a Status through the daemon's conversion;
// every other RPC is the generated "unimplemented".
class PingOnly final : public v1::Control::Service {
 public:
  grpc::Status Ping(grpc::ServerContext*, const v1::PingRequest*,
                    v1::PingResponse* response) override {
    response->set_version("loopback");
    response->set_protocol_version(7);
    response->set_pid(1234);
    return grpc::Status::OK;
  }
  grpc::Status Shutdown(grpc::ServerContext*, const v1::ShutdownRequest*,
                        v1::ShutdownResponse*) override {
    return trainstream::ToGrpc(
        trainstream::Status(trainstream::StatusCode::kFailedPrecondition, "sessions attached"));
  }
};

struct Loopback {
  PingOnly service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<v1::Control::Stub> stub;
  Loopback() {
    int port = 0;
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
    REQUIRE(server != nullptr);
    REQUIRE(port > 0);
    stub = v1::Control::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                                    grpc::InsecureChannelCredentials()));
  }
  ~Loopback() { server->Shutdown(std::chrono::system_clock::now()); }
};

void Deadline(grpc::ClientContext* context) {
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
}

}  // namespace

TEST_CASE("a Ping round-trips over loopback TCP", "[grpc]") {
  Loopback loopback;
  for (int i = 0; i < 3; ++i) {
    grpc::ClientContext context;
    Deadline(&context);
    v1::PingResponse response;
    const grpc::Status s = loopback.stub->Ping(&context, v1::PingRequest(), &response);
    REQUIRE(s.ok());
    CHECK(response.version() == "loopback");
    CHECK(response.protocol_version() == 7);
    CHECK(response.pid() == 1234);
  }
}

TEST_CASE("a handler's Status and an unimplemented RPC arrive as their codes", "[grpc]") {
  Loopback loopback;
  {
    grpc::ClientContext context;
    Deadline(&context);
    v1::ShutdownResponse response;
    const grpc::Status s = loopback.stub->Shutdown(&context, v1::ShutdownRequest(), &response);
    CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK(s.error_message() == "sessions attached");
  }
  {
    grpc::ClientContext context;
    Deadline(&context);
    v1::StatusResponse response;
    const grpc::Status s = loopback.stub->Status(&context, v1::StatusRequest(), &response);
    CHECK(s.error_code() == grpc::StatusCode::UNIMPLEMENTED);
  }
}
