// The Windows side of the threads seam (trainstream/platform/threads.h): the
// process affinity mask, the topology from GetLogicalProcessorInformation,
// SetThreadAffinityMask and the thread description.
#include <windows.h>

#include <cstdint>
#include <string>

#include "trainstream/platform/threads.h"

namespace trainstream::platform {
namespace {

constexpr int kMaskBits = static_cast<int>(sizeof(DWORD_PTR) * 8);

// Note [Thread descriptions by lookup]: SetThreadDescription and
// GetThreadDescription exist from Windows 10 1607 (and in Wine), but the
// MinGW-w64 headers of Debian 12 do not declare them, so they are looked up in
// kernel32 at run time; where they are missing, threads stay unnamed.
using SetDescription = HRESULT(WINAPI*)(HANDLE, PCWSTR);
using GetDescription = HRESULT(WINAPI*)(HANDLE, PWSTR*);

template <class F>
F Kernel32(const char* name) {
  HMODULE kernel32 = GetModuleHandleW(L"kernel32.dll");
  if (kernel32 == nullptr) return nullptr;
  return reinterpret_cast<F>(reinterpret_cast<void*>(GetProcAddress(kernel32, name)));
}

}  // namespace

std::vector<int> AllowedCpus() {
  DWORD_PTR process = 0, system = 0;
  std::vector<int> cpus;
  if (GetProcessAffinityMask(GetCurrentProcess(), &process, &system)) {
    for (int cpu = 0; cpu < kMaskBits; ++cpu) {
      if (process & (DWORD_PTR{1} << cpu)) cpus.push_back(cpu);
    }
  }
  return cpus;
}

bool CoreOfCpu(int cpu, CpuCore* out) {
  if (cpu < 0 || cpu >= kMaskBits) return false;
  DWORD bytes = 0;
  GetLogicalProcessorInformation(nullptr, &bytes);
  if (GetLastError() != ERROR_INSUFFICIENT_BUFFER || bytes == 0) return false;
  std::vector<SYSTEM_LOGICAL_PROCESSOR_INFORMATION> info(
      bytes / sizeof(SYSTEM_LOGICAL_PROCESSOR_INFORMATION) + 1);
  if (!GetLogicalProcessorInformation(info.data(), &bytes)) return false;
  info.resize(bytes / sizeof(SYSTEM_LOGICAL_PROCESSOR_INFORMATION));
  // Cores and packages have no ids here: each is an entry with the mask of its
  // logical processors, so its ordinal among entries of its kind is its id.
  const DWORD_PTR bit = DWORD_PTR{1} << cpu;
  int cores = 0, packages = 0;
  CpuCore found{-1, -1};
  for (const SYSTEM_LOGICAL_PROCESSOR_INFORMATION& entry : info) {
    if (entry.Relationship == RelationProcessorCore) {
      if (entry.ProcessorMask & bit) found.core = cores;
      ++cores;
    } else if (entry.Relationship == RelationProcessorPackage) {
      if (entry.ProcessorMask & bit) found.package = packages;
      ++packages;
    }
  }
  if (found.core < 0 || found.package < 0) return false;
  *out = found;
  return true;
}

bool PinCurrentThread(int cpu) {
  if (cpu < 0 || cpu >= kMaskBits) return false;
  return SetThreadAffinityMask(GetCurrentThread(), DWORD_PTR{1} << cpu) != 0;
}

int CurrentCpu() { return static_cast<int>(GetCurrentProcessorNumber()); }

void NameCurrentThread(const char* name) {
  static const SetDescription set = Kernel32<SetDescription>("SetThreadDescription");
  if (set == nullptr) return;
  std::wstring wide;
  for (const char* c = name; *c != '\0'; ++c) wide.push_back(static_cast<unsigned char>(*c));
  set(GetCurrentThread(), wide.c_str());
}

std::string CurrentThreadName() {
  static const GetDescription get = Kernel32<GetDescription>("GetThreadDescription");
  PWSTR wide = nullptr;
  if (get == nullptr || FAILED(get(GetCurrentThread(), &wide)) || wide == nullptr) return "";
  std::string name;
  for (const wchar_t* c = wide; *c != L'\0'; ++c) name.push_back(static_cast<char>(*c));
  LocalFree(wide);
  return name;
}

}  // namespace trainstream::platform
