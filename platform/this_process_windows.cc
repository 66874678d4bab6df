// The Windows side of trainstream/platform/this_process.h.
#include <io.h>
#include <windows.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "trainstream/platform/this_process.h"
#include "windows_common.h"

namespace trainstream::platform {

int64_t CurrentProcessId() { return static_cast<int64_t>(GetCurrentProcessId()); }

int CurrentExecutablePath(std::string* out) {
  // GetModuleFileNameW truncates silently to the buffer: grow until it fits.
  std::vector<wchar_t> buffer(MAX_PATH);
  for (;;) {
    const DWORD n = GetModuleFileNameW(nullptr, buffer.data(), static_cast<DWORD>(buffer.size()));
    if (n == 0) return internal::LastErrno();
    if (n < buffer.size()) {
      *out = std::filesystem::path(std::wstring(buffer.data(), n)).u8string();
      return 0;
    }
    buffer.resize(buffer.size() * 2);
  }
}

std::string ProgramFileName(const std::string& name) { return name + ".exe"; }

bool MayExecute(const std::string& path) {
  std::error_code ec;
  return std::filesystem::is_regular_file(std::filesystem::u8path(path), ec);
}

bool StderrIsTerminal() { return _isatty(_fileno(stderr)) != 0; }

}  // namespace trainstream::platform
