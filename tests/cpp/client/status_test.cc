#include "catch_compat.h"
#include "trainstream/client.h"

using trainstream::Status;
using trainstream::StatusCode;

TEST_CASE("Status renders code and message", "[client]") {
  CHECK(Status::Ok().ToString() == "OK");
  Status s(StatusCode::kInvalidArgument, "bytes: must be > 0");
  CHECK_FALSE(s.ok());
  CHECK(s.ToString() == "INVALID_ARGUMENT: bytes: must be > 0");
  CHECK(std::string(trainstream::StatusCodeName(StatusCode::kResourceExhausted)) ==
        "RESOURCE_EXHAUSTED");
}

TEST_CASE("Connect to a missing socket is UNAVAILABLE naming the path", "[client]") {
  std::unique_ptr<trainstream::Client> c;
  Status s = trainstream::Client::Connect("/nonexistent/trainstream.sock", 200, &c);
  CHECK(s.code() == StatusCode::kUnavailable);
  CHECK(s.message().find("/nonexistent/trainstream.sock") != std::string::npos);
}

TEST_CASE("MappedRegion refuses names with slashes and out-of-range regions", "[client]") {
  std::unique_ptr<trainstream::MappedRegion> r;
  trainstream::RegionInfo info;
  info.segment_name = "../etc/passwd";
  info.segment_size = 8192;
  info.length = 10;
  CHECK(trainstream::MappedRegion::Map("/dev/shm", info, &r).code() ==
        StatusCode::kInvalidArgument);
  info.segment_name = "trainstream-x";
  info.offset = 8190;
  CHECK(trainstream::MappedRegion::Map("/dev/shm", info, &r).code() ==
        StatusCode::kInvalidArgument);
}
