// The platform seam for a daemon that leaves the terminal that started it, and
// for the process limits it raises at start.
//
// Linux: `trainstreamd` without --foreground forks before any thread exists;
// the parent waits on a pipe until the child reports that it serves (or why it
// could not) and exits with that result, and the child starts a new session
// and, once ready, points its standard streams at /dev/null (the daemon's
// main.cc code, moved). Windows has no fork: a daemon that runs on without a
// console is a service (`trainstreamd --install-service`, platform/service.h),
// so StartInBackground answers ENOTSUP there and says so.
//
// Two sides, picked by platform/CMakeLists.txt: background_linux.cc and
// background_windows.cc.
#pragma once

#include <cstdint>
#include <string>

namespace trainstream::platform {

// Starts running in the background. Returns 0 in the process that goes on as
// the daemon (*is_parent false), or in the waiting parent once the daemon
// reported (*is_parent true, *exit_code what it should exit with, its error
// already printed to stderr). Else an errno value with `*error` saying why
// (then nothing was started: ENOTSUP on Windows).
int StartInBackground(bool* is_parent, int* exit_code, std::string* error);

// In the background daemon: tells the waiting parent it serves (`error` null)
// or why it cannot; after success its standard streams go to the null device.
// Does nothing in a process that StartInBackground did not start, or the
// second time.
void ReportBackgroundReady(const char* error);

// Raises this process's open-file limit to its hard limit (each connection and
// segment holds a descriptor on Linux). Returns 0 with *from and *to the soft
// limit before and after (equal when it was at the hard limit already), or an
// errno value: ENOTSUP on Windows, whose handles have no such limit.
int RaiseOpenFileLimit(uint64_t* from, uint64_t* to);

}  // namespace trainstream::platform
