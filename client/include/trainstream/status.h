// Status: the result of every fallible call in the client library. Success is
// cheap (no allocation); an error carries a code and a message a user can act on.
#pragma once

#include <string>
#include <utility>

namespace trainstream {

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

const char* StatusCodeName(StatusCode code);

}  // namespace trainstream
