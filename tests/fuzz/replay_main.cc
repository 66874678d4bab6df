// Replays fuzz inputs without libFuzzer: runs LLVMFuzzerTestOneInput once on
// every regular file in the folders (or on the files) named on the command
// line, in name order, so a build with any compiler checks that the committed
// corpora still pass (ctest fuzz_replay_<target>, tests/fuzz/CMakeLists.txt).
// A broken invariant abort()s, which fails the test; with -v each file is named
// before it runs, so the last name printed is the one that crashed.
//
// Exit status: 0 when every input ran; 1 on a usage error, an unreadable input
// or no input at all (an empty or missing corpus is a mistake, not a pass).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
// Optional in a target, as with libFuzzer.
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) __attribute__((weak));

namespace {

namespace fs = std::filesystem;

bool ReadFile(const fs::path& path, std::vector<uint8_t>* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  out->assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return !in.bad();
}

}  // namespace

int main(int argc, char** argv) {
  bool verbose = false;
  std::vector<fs::path> inputs;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "-v") == 0) {
      verbose = true;
      continue;
    }
    const fs::path arg(argv[i]);
    std::error_code ec;
    if (fs::is_directory(arg, ec)) {
      std::vector<fs::path> files;
      for (const auto& entry : fs::directory_iterator(arg, ec)) {
        if (entry.is_regular_file()) files.push_back(entry.path());
      }
      if (ec) {
        std::fprintf(stderr, "%s: cannot list: %s\n", argv[i], ec.message().c_str());
        return 1;
      }
      std::sort(files.begin(), files.end());
      inputs.insert(inputs.end(), files.begin(), files.end());
    } else if (fs::is_regular_file(arg, ec)) {
      inputs.push_back(arg);
    } else {
      std::fprintf(stderr, "%s: not a file or folder\n", argv[i]);
      return 1;
    }
  }
  if (inputs.empty()) {
    std::fprintf(stderr,
                 "usage: %s [-v] <corpus folder or file>...\n"
                 "(no inputs found: a corpus folder must hold at least one file)\n",
                 argv[0]);
    return 1;
  }
  if (LLVMFuzzerInitialize != nullptr) LLVMFuzzerInitialize(&argc, &argv);
  uint64_t bytes = 0;
  std::vector<uint8_t> data;
  for (const auto& path : inputs) {
    if (!ReadFile(path, &data)) {
      std::fprintf(stderr, "%s: cannot read\n", path.c_str());
      return 1;
    }
    if (verbose) std::fprintf(stderr, "replaying %s (%zu bytes)\n", path.c_str(), data.size());
    // A copy of exactly `size` bytes, so an over-read is past the allocation
    // (as under libFuzzer) rather than into the vector's spare capacity.
    std::unique_ptr<uint8_t[]> exact(new uint8_t[data.size() > 0 ? data.size() : 1]);
    if (!data.empty()) std::memcpy(exact.get(), data.data(), data.size());
    LLVMFuzzerTestOneInput(exact.get(), data.size());
    bytes += data.size();
  }
  std::printf("replayed %zu inputs (%llu bytes)\n", inputs.size(),
              static_cast<unsigned long long>(bytes));
  return 0;
}
