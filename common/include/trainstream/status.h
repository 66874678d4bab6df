// Status: the result of every fallible call in TrainStream, the client library
// and the daemon alike. Success is cheap (no allocation); an error carries a
// code and a message a user can act on.
//
// Note [One Status below the transport]: the daemon's layers under transport/
// (memory, base, sessions, planes, the AdamW engine, the process in
// daemon/process/) and the client library speak this type and never include
// grpcpp. gRPC codes exist only at the edge: the daemon's ControlService
// converts with ToGrpc, the client with FromGrpc (trainstream/grpc_status.h, in
// trainstream_proto beside the generated stubs). This header depends on the
// standard library alone, so any layer, and the torch extension, can use it
// without linking gRPC.
//
// Each code answers to one gRPC code of the same name (ToGrpc); a code the
// daemon returns must have a member here, so that what a client sees does not
// change when an error travels through Status.
#pragma once

#include <string>
#include <utility>

namespace trainstream {

// The numbering is part of no wire format (gRPC carries its own codes), but
// members are only ever appended so that a rebuilt client and a log stay alike.
enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // the caller asked for something malformed (names the field)
  kNotFound,         // no such session, region, parameter or daemon socket
  kAlreadyExists,
  kPermissionDenied,    // peer not allowed, or a file the caller may not read
  kResourceExhausted,   // budget or /dev/shm full (says asked, free and limit)
  kFailedPrecondition,  // e.g. not attached, daemon draining
  kUnavailable,         // no daemon answers, or it went away
  kDeadlineExceeded,
  kInternal,
  kCancelled,  // the work was stopped (a base load whose client went away)
  kDataLoss,   // a source file ended early or changed under a read
};

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "INVALID_ARGUMENT: bytes must be > 0" (or "OK").
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// "INVALID_ARGUMENT", as gRPC spells the code of the same name.
const char* StatusCodeName(StatusCode code);

}  // namespace trainstream
