// The platform seam for what a process asks about itself: its id (which the
// daemon watches for liveness: platform/process_watcher.h), the program file
// it runs, and the name a program of this project has on this system. Two
// sides, picked by platform/CMakeLists.txt: this_process_linux.cc
// (getpid, /proc/self/exe, access) and this_process_windows.cc
// (GetCurrentProcessId, GetModuleFileNameW, ".exe").
#pragma once

#include <cstdint>
#include <string>

namespace trainstream::platform {

// This process's id, as the system numbers processes (a pid; a Windows
// process id), as clients state it in AttachRequest.pid.
int64_t CurrentProcessId();

// The full path of the program this process runs. Returns 0 or an errno value.
int CurrentExecutablePath(std::string* out);

// The file name of the program `name` on this system: `name` on Linux,
// `name` + ".exe" on Windows.
std::string ProgramFileName(const std::string& name);

// True when this process may run the file at `path`: Linux, access(X_OK);
// Windows, a regular file exists there (Windows asks about the right to
// execute only when it starts one).
bool MayExecute(const std::string& path);

// True when this process's standard error is a terminal (progress lines go
// only there).
bool StderrIsTerminal();

}  // namespace trainstream::platform
