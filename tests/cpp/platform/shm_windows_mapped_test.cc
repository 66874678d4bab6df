// Note [A mapped segment cannot shrink on Windows]. On Linux a client can
// ftruncate a segment the daemon maps, and the daemon's next touch past the new
// end is a SIGBUS; ClientMemoryGuard (daemon/memory/client_memory_guard.h)
// exists for that. Windows refuses to shrink a file below a mapped view
// (ERROR_USER_MAPPED_FILE), whoever asks, so while the daemon holds its view
// no client can take pages from under it, and the Windows daemon needs no
// guard. This pins that rule, through the seam's own files and views, against
// what a client could do with a handle of its own (SetEndOfFile,
// FileEndOfFileInfo); Wine 8.0 follows it too.
#include <windows.h>

#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <system_error>

#include "catch_compat.h"
#include "trainstream/platform/shm.h"

using namespace trainstream::platform;
namespace fs = std::filesystem;

TEST_CASE("a segment the daemon maps cannot be shrunk through another handle", "[shm]") {
  std::random_device seed;
  const fs::path dir = fs::temp_directory_path() / ("ts-shmmapped-" + std::to_string(seed()));
  fs::create_directory(dir);
  constexpr uint64_t kBytes = uint64_t{1} << 20;
  {
    ShmFile file;
    REQUIRE(ShmFile::Create(dir.string(), "seg", &file) == 0);
    REQUIRE(file.Allocate(kBytes) == 0);
    std::unique_ptr<ShmMapping> view;
    REQUIRE(ShmMapping::Map(file, ShmAccess::kReadWrite, kBytes, false, &view) == 0);
    auto* bytes = static_cast<volatile unsigned char*>(view->data());
    bytes[kBytes - 1] = 0x7e;

    // The client's own handle, opened as the seam opens segments.
    HANDLE client = CreateFileW((dir / "seg").wstring().c_str(), GENERIC_READ | GENERIC_WRITE,
                                FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE, nullptr,
                                OPEN_EXISTING, FILE_ATTRIBUTE_NORMAL, nullptr);
    REQUIRE(client != INVALID_HANDLE_VALUE);
    LARGE_INTEGER page;
    page.QuadPart = 4096;
    REQUIRE(SetFilePointerEx(client, page, nullptr, FILE_BEGIN));
    CHECK(!SetEndOfFile(client));
    CHECK(GetLastError() == ERROR_USER_MAPPED_FILE);
    FILE_END_OF_FILE_INFO empty{};
    CHECK(!SetFileInformationByHandle(client, FileEndOfFileInfo, &empty, sizeof(empty)));
    CHECK(GetLastError() == ERROR_USER_MAPPED_FILE);
    CloseHandle(client);

    uint64_t size = 0;
    REQUIRE(file.GetSize(&size) == 0);
    CHECK(size == kBytes);
    CHECK(bytes[kBytes - 1] == 0x7e);  // still there, no fault
    REQUIRE(ShmFile::Remove(dir.string(), "seg") == 0);
  }
  std::error_code ignored;
  fs::remove_all(dir, ignored);
}
