// trainstream::Status <-> grpc::Status (Note [One Status below the transport],
// trainstream/status.h). The daemon's side must answer every code with the gRPC
// code clients saw before Status existed; the client's side folds what it does
// not tell apart, as it always has.
#include "trainstream/grpc_status.h"

#include <string>
#include <utility>
#include <vector>

#include "catch_compat.h"

using trainstream::Status;
using trainstream::StatusCode;
using G = grpc::StatusCode;

namespace {

// Every StatusCode, its name and the gRPC code the daemon answers it with.
struct Row {
  StatusCode code;
  const char* name;
  G grpc;
};
const std::vector<Row>& AllCodes() {
  static const std::vector<Row> rows = {
      {StatusCode::kOk, "OK", G::OK},
      {StatusCode::kInvalidArgument, "INVALID_ARGUMENT", G::INVALID_ARGUMENT},
      {StatusCode::kNotFound, "NOT_FOUND", G::NOT_FOUND},
      {StatusCode::kAlreadyExists, "ALREADY_EXISTS", G::ALREADY_EXISTS},
      {StatusCode::kPermissionDenied, "PERMISSION_DENIED", G::PERMISSION_DENIED},
      {StatusCode::kResourceExhausted, "RESOURCE_EXHAUSTED", G::RESOURCE_EXHAUSTED},
      {StatusCode::kFailedPrecondition, "FAILED_PRECONDITION", G::FAILED_PRECONDITION},
      {StatusCode::kUnavailable, "UNAVAILABLE", G::UNAVAILABLE},
      {StatusCode::kDeadlineExceeded, "DEADLINE_EXCEEDED", G::DEADLINE_EXCEEDED},
      {StatusCode::kInternal, "INTERNAL", G::INTERNAL},
      {StatusCode::kCancelled, "CANCELLED", G::CANCELLED},
      {StatusCode::kDataLoss, "DATA_LOSS", G::DATA_LOSS},
  };
  return rows;
}

}  // namespace

TEST_CASE("ToGrpc answers each code with the gRPC code of its name, message unchanged",
          "[status]") {
  // The table covers the enum: its last member is the row count less one.
  CHECK(static_cast<size_t>(StatusCode::kDataLoss) + 1 == AllCodes().size());
  for (const Row& r : AllCodes()) {
    INFO(r.name);
    CHECK(std::string(trainstream::StatusCodeName(r.code)) == r.name);
    CHECK(trainstream::ToGrpcCode(r.code) == r.grpc);
    if (r.code == StatusCode::kOk) {
      CHECK(trainstream::ToGrpc(Status::Ok()).ok());
      continue;
    }
    const grpc::Status g = trainstream::ToGrpc(Status(r.code, "field: what is wrong"));
    CHECK(g.error_code() == r.grpc);
    CHECK(g.error_message() == "field: what is wrong");
  }
}

TEST_CASE("FromGrpc gives the client back what the daemon meant", "[status]") {
  const std::string sock = "/run/trainstream/trainstreamd.sock";
  // Round trip daemon -> wire -> client: the codes the client tells apart.
  for (StatusCode c :
       {StatusCode::kInvalidArgument, StatusCode::kNotFound, StatusCode::kAlreadyExists,
        StatusCode::kPermissionDenied, StatusCode::kResourceExhausted,
        StatusCode::kFailedPrecondition, StatusCode::kInternal}) {
    INFO(trainstream::StatusCodeName(c));
    const Status back =
        trainstream::internal::FromGrpc(trainstream::ToGrpc(Status(c, "the message")), sock);
    CHECK(back.code() == c);
    CHECK(back.message() == "the message");
  }
  CHECK(trainstream::internal::FromGrpc(grpc::Status::OK, sock).ok());

  // Transport failures name the socket.
  const Status gone = trainstream::internal::FromGrpc(
      trainstream::ToGrpc(Status(StatusCode::kUnavailable, "trainstreamd shut down")), sock);
  CHECK(gone.code() == StatusCode::kUnavailable);
  CHECK(gone.message() == "trainstreamd at " + sock + " is unavailable: trainstreamd shut down");
  const Status late = trainstream::internal::FromGrpc(
      grpc::Status(G::DEADLINE_EXCEEDED, "Deadline Exceeded"), sock);
  CHECK(late.code() == StatusCode::kDeadlineExceeded);
  CHECK(late.message() == "trainstreamd at " + sock + " did not answer in time: Deadline Exceeded");

  // What the client folds together (as before Status was shared).
  const std::vector<std::pair<G, StatusCode>> folded = {
      {G::OUT_OF_RANGE, StatusCode::kInvalidArgument},
      {G::UNAUTHENTICATED, StatusCode::kPermissionDenied},
      {G::CANCELLED, StatusCode::kUnavailable},
      {G::DATA_LOSS, StatusCode::kInternal},
      {G::UNKNOWN, StatusCode::kInternal},
      {G::UNIMPLEMENTED, StatusCode::kInternal},
      {G::ABORTED, StatusCode::kInternal},
  };
  for (const auto& [g, c] : folded) {
    INFO(static_cast<int>(g));
    CHECK(trainstream::internal::FromGrpc(grpc::Status(g, "m"), sock).code() == c);
  }
}

TEST_CASE("Status renders the new codes by their gRPC names", "[status]") {
  CHECK(Status(StatusCode::kCancelled, "load cancelled").ToString() == "CANCELLED: load cancelled");
  CHECK(Status(StatusCode::kDataLoss, "short read").ToString() == "DATA_LOSS: short read");
}
