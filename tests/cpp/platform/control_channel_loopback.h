// A gRPC server on loopback TCP whose Ping checks the endpoint secret as the
// daemon's ControlService::Authorize does (platform/control_channel.h), for
// the control channel's tests.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>

#include "catch_compat.h"
#include "trainstream/platform/control_channel.h"
#include "trainstream/v1/control.grpc.pb.h"

class SecretCheckingServer {
 public:
  // `secret` empty: no secret asked for.
  explicit SecretCheckingServer(std::string secret) : service_(std::move(secret)) {
    int port = 0;
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    REQUIRE(server_ != nullptr);
    REQUIRE(port > 0);
    address_ = "127.0.0.1:" + std::to_string(port);
  }
  ~SecretCheckingServer() { server_->Shutdown(std::chrono::system_clock::now()); }
  SecretCheckingServer(const SecretCheckingServer&) = delete;
  SecretCheckingServer& operator=(const SecretCheckingServer&) = delete;

  const std::string& address() const { return address_; }
  // Pings that were let in.
  int calls() const { return service_.calls.load(); }

 private:
  class Service final : public trainstream::v1::Control::Service {
   public:
    explicit Service(std::string secret) : secret_(std::move(secret)) {}
    grpc::Status Ping(grpc::ServerContext* ctx, const trainstream::v1::PingRequest*,
                      trainstream::v1::PingResponse* response) override {
      if (!trainstream::platform::CallCarriesEndpointSecret(*ctx, secret_)) {
        return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, "no endpoint secret");
      }
      ++calls;
      response->set_version("checked");
      return grpc::Status::OK;
    }
    std::atomic<int> calls{0};

   private:
    const std::string secret_;
  };

  Service service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};
