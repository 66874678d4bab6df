// Sleeping on a word in shared memory (trainstream/platform/shared_word.h), as
// the rings do: the waiter and the waker use two mappings of one segment file,
// as a client and the daemon do (on Linux the futex is keyed by the file's
// page, so the wake has to cross mappings; on Windows the waiter polls).
#include "trainstream/platform/shared_word.h"

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>

#include "catch_compat.h"
#include "trainstream/platform/shm.h"

using namespace trainstream::platform;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

// A one-page segment file mapped twice.
struct TwoMappings {
  std::string dir;
  ShmFile file;
  std::unique_ptr<ShmMapping> waiter_view, waker_view;
  TwoMappings() {
    std::random_device seed;
    dir = (fs::temp_directory_path() / ("ts-sharedword-" + std::to_string(seed()))).u8string();
    fs::create_directory(fs::u8path(dir));
    REQUIRE(ShmFile::Create(dir, "word", &file) == 0);
    REQUIRE(file.Allocate(4096) == 0);
    REQUIRE(ShmMapping::Map(file, ShmAccess::kReadWrite, 4096, false, &waiter_view) == 0);
    REQUIRE(ShmMapping::Map(file, ShmAccess::kReadWrite, 4096, false, &waker_view) == 0);
  }
  ~TwoMappings() {
    waiter_view.reset();
    waker_view.reset();
    file = ShmFile();
    ShmFile::Remove(dir, "word");
    std::error_code ignored;
    fs::remove_all(fs::u8path(dir), ignored);
  }
  std::atomic<uint32_t>* waiter_word() const {
    return static_cast<std::atomic<uint32_t>*>(waiter_view->data());
  }
  std::atomic<uint32_t>* waker_word() const {
    return static_cast<std::atomic<uint32_t>*>(waker_view->data());
  }
};

}  // namespace

TEST_CASE("a word that no longer holds the expected value does not sleep", "[shared_word]") {
  TwoMappings m;
  m.waker_word()->store(7);
  const auto start = std::chrono::steady_clock::now();
  CHECK(SharedWordWait(m.waiter_word(), 6, 5'000'000'000) == EAGAIN);
  CHECK(std::chrono::steady_clock::now() - start < 1s);
}

TEST_CASE("a wait with nobody waking ends at its timeout", "[shared_word]") {
  TwoMappings m;
  const auto start = std::chrono::steady_clock::now();
  const int rc = SharedWordWait(m.waiter_word(), 0, 50'000'000);
  const auto waited = std::chrono::steady_clock::now() - start;
  CHECK(rc == ETIMEDOUT);
  CHECK(waited >= 45ms);  // the clocks' resolutions differ a little
  CHECK(waited < 5s);
}

TEST_CASE("a change and a wake through another mapping end the wait", "[shared_word]") {
  TwoMappings m;
  for (uint32_t round = 0; round < 20; ++round) {
    std::atomic<bool> waiting{false};
    int rc = -1;
    std::chrono::steady_clock::duration waited{};
    std::thread waiter([&] {
      waiting.store(true);
      const auto start = std::chrono::steady_clock::now();
      // Spurious returns are allowed: wait again while the word is unchanged.
      do {
        rc = SharedWordWait(m.waiter_word(), round, 10'000'000'000);
      } while (rc == 0 && m.waiter_word()->load() == round);
      waited = std::chrono::steady_clock::now() - start;
    });
    while (!waiting.load()) std::this_thread::yield();
    std::this_thread::sleep_for(2ms);
    m.waker_word()->store(round + 1);
    SharedWordWake(m.waker_word());
    waiter.join();
    CHECK((rc == 0 || rc == EAGAIN));  // EAGAIN: the store came before the sleep
    CHECK(m.waiter_word()->load() == round + 1);
    CHECK(waited < 2s);
  }
}

TEST_CASE("a wait on several words ends when any one changes", "[shared_word]") {
  TwoMappings m;
  std::atomic<uint32_t>* waiter_words[3] = {m.waiter_word(), m.waiter_word() + 16,
                                            m.waiter_word() + 32};
  std::atomic<uint32_t>* last_by_waker = m.waker_word() + 32;
  const uint32_t expected[3] = {0, 0, 0};
  // Nothing changes: the timeout (or, where the system cannot wait on several
  // words, the error the rings then fall back from).
  const int idle = SharedWordWaitAny(waiter_words, expected, 3, 20'000'000);
  if (idle != ETIMEDOUT) {
    CHECK((idle == ENOSYS || idle == EPERM));
    TS_SKIP("this system cannot wait on several words (errno " + std::to_string(idle) + ")");
  }
  int rc = -1;
  std::chrono::steady_clock::duration waited{};
  std::thread waiter([&] {
    const auto start = std::chrono::steady_clock::now();
    do {
      rc = SharedWordWaitAny(waiter_words, expected, 3, 10'000'000'000);
    } while (rc == 0 && waiter_words[2]->load() == 0);
    waited = std::chrono::steady_clock::now() - start;
  });
  std::this_thread::sleep_for(5ms);
  last_by_waker->store(1);
  SharedWordWake(last_by_waker);
  waiter.join();
  CHECK((rc == 0 || rc == EAGAIN));
  CHECK(waited < 2s);
  CHECK(SharedWordWaitAny(waiter_words, expected, 3, 1'000'000'000) == EAGAIN);
  CHECK(SharedWordWaitAny(waiter_words, expected, 0, 0) == EINVAL);
}
