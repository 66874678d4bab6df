// The test client's commands on a segment's file, as a hostile client would
// run them (tests/python/test_hostile*.py): each system's file calls, picked by
// tests/cpp/client/CMakeLists.txt.
#pragma once

#include <string>

// Runs `command` on the segment file at `path`:
//   truncate <bytes>  open it read-write and set its size
//   try_open r|rw     open it, then close it
//   try_chmod <octal> change its mode (Windows: the read-only attribute, as
//                     the C runtime's _chmod does)
// Returns 0 or the errno value of the call that failed.
int RunSegmentFileCommand(const std::string& command, const std::string& path,
                          const std::string& arg);
