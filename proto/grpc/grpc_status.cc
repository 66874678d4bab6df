#include "trainstream/grpc_status.h"

namespace trainstream {

grpc::StatusCode ToGrpcCode(StatusCode code) {
  using G = grpc::StatusCode;
  switch (code) {
    case StatusCode::kOk:
      return G::OK;
    case StatusCode::kInvalidArgument:
      return G::INVALID_ARGUMENT;
    case StatusCode::kNotFound:
      return G::NOT_FOUND;
    case StatusCode::kAlreadyExists:
      return G::ALREADY_EXISTS;
    case StatusCode::kPermissionDenied:
      return G::PERMISSION_DENIED;
    case StatusCode::kResourceExhausted:
      return G::RESOURCE_EXHAUSTED;
    case StatusCode::kFailedPrecondition:
      return G::FAILED_PRECONDITION;
    case StatusCode::kUnavailable:
      return G::UNAVAILABLE;
    case StatusCode::kDeadlineExceeded:
      return G::DEADLINE_EXCEEDED;
    case StatusCode::kInternal:
      return G::INTERNAL;
    case StatusCode::kCancelled:
      return G::CANCELLED;
    case StatusCode::kDataLoss:
      return G::DATA_LOSS;
  }
  return G::UNKNOWN;
}

grpc::Status ToGrpc(const Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(ToGrpcCode(s.code()), s.message());
}

namespace internal {

Status FromGrpc(const grpc::Status& s, const std::string& socket_path) {
  using G = grpc::StatusCode;
  switch (s.error_code()) {
    case G::OK:
      return Status::Ok();
    case G::INVALID_ARGUMENT:
    case G::OUT_OF_RANGE:
      return Status(StatusCode::kInvalidArgument, s.error_message());
    case G::NOT_FOUND:
      return Status(StatusCode::kNotFound, s.error_message());
    case G::ALREADY_EXISTS:
      return Status(StatusCode::kAlreadyExists, s.error_message());
    case G::PERMISSION_DENIED:
    case G::UNAUTHENTICATED:
      return Status(StatusCode::kPermissionDenied, s.error_message());
    case G::RESOURCE_EXHAUSTED:
      return Status(StatusCode::kResourceExhausted, s.error_message());
    case G::FAILED_PRECONDITION:
      return Status(StatusCode::kFailedPrecondition, s.error_message());
    case G::UNAVAILABLE:
    case G::CANCELLED:
      return Status(StatusCode::kUnavailable,
                    "trainstreamd at " + socket_path + " is unavailable: " + s.error_message());
    case G::DEADLINE_EXCEEDED:
      return Status(
          StatusCode::kDeadlineExceeded,
          "trainstreamd at " + socket_path + " did not answer in time: " + s.error_message());
    default:
      return Status(StatusCode::kInternal, s.error_message());
  }
}

}  // namespace internal
}  // namespace trainstream
