// A failed call's words (trainstream/platform/sys_call.h): the system's text for
// an errno value, the one "<what>: <text>" form, and the Status built from it.
#include "trainstream/platform/sys_call.h"

#include <cerrno>
#include <string>
#include <thread>
#include <vector>

#include "catch_compat.h"

using trainstream::Status;
using trainstream::StatusCode;
using namespace trainstream::platform;

TEST_CASE("an errno value reads as the system's text for it", "[sys_call]") {
  // The C runtime's words, on Linux (glibc) and Windows (the CRT) alike.
  CHECK(ErrnoMessage(ENOENT) == "No such file or directory");
  CHECK(ErrnoMessage(EACCES) == "Permission denied");
  CHECK(ErrnoMessage(ENOENT) != ErrnoMessage(EACCES));
}

TEST_CASE("a number the system does not know still reads as words", "[sys_call]") {
  const std::string text = ErrnoMessage(987654);
  CHECK(!text.empty());
  CHECK(text.find("987654") != std::string::npos);
}

TEST_CASE("the message names what failed, then why", "[sys_call]") {
  CHECK(ErrnoText("cannot open /x", ENOENT) == "cannot open /x: No such file or directory");
  const Status st = ErrnoStatus(StatusCode::kPermissionDenied, "cannot bind /s", EACCES);
  CHECK(st.code() == StatusCode::kPermissionDenied);
  CHECK(st.message() == "cannot bind /s: Permission denied");
}

TEST_CASE("threads asking at once each get their own number's text", "[sys_call]") {
  // strerror may share one buffer between threads; ErrnoMessage must not.
  const int numbers[] = {ENOENT, EACCES, EEXIST, EINVAL};
  std::vector<std::string> expected;
  for (int err : numbers) expected.push_back(ErrnoMessage(err));
  std::vector<int> wrong(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20000; ++i) {
        if (ErrnoMessage(numbers[t]) != expected[t]) ++wrong[t];
        // Unknown numbers are formatted into the buffer, not read from a table.
        if (ErrnoMessage(100000 + t) != ErrnoMessage(100000 + t)) ++wrong[t];
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) CHECK(wrong[t] == 0);
}
