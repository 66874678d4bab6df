// The solo optimizer plane (OptimizerService) against an in-process client: its
// rings live in ordinary memory and the test plays the client's side of
// session_control.h, well-behaved and not (Note [Rings a client can write]).
#include "planes/optimizer_service.h"

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "catch_compat.h"
#include "fp32_binding.h"
#include "trainstream/wire/session_control.h"

using namespace trainstream;
using namespace trainstream::daemon;
using wire::CommandRecord;
using wire::CompletionRecord;
using wire::Opcode;
using wire::RingView;

namespace {

constexpr uint64_t kCapacity = 64;
constexpr size_t kNumel = 5;
constexpr uint64_t kSession = 7;

struct Client {
  Client() : service(2) {
    const uint64_t bytes = wire::ControlLayoutFor(kCapacity).bytes;
    memory = static_cast<char*>(::operator new (bytes, std::align_val_t{64}));
    std::memset(memory, 0, bytes);
    const wire::ControlLayout l = wire::InitializeControlRegion(memory, kSession, bytes, kCapacity);
    rings = ControlRings{memory, l.command_ring_offset, l.completion_ring_offset, kCapacity};
    commands = RingView(rings.command_ring());
    completions = RingView(rings.completion_ring());
    for (auto* v : {&master, &m, &v, &grad, &param}) v->assign(kNumel, 0.f);
    for (size_t i = 0; i < kNumel; ++i) {
      param[i] = static_cast<float>(i + 1);
      grad[i] = (i % 2 == 0) ? 1.0f : -1.0f;
    }
    service.SetFaultHandler([this](uint64_t id, const std::string& why) {
      std::lock_guard<std::mutex> lock(mu);
      faults.emplace_back(id, why);
    });
    PlaneOptions options;
    options.name = "session 7";
    service.StartPlane(kSession, std::move(options), {PlaneMember{0, kSession, rings, nullptr}});
  }
  ~Client() {
    service.StopPlane(kSession);  // before the memory goes
    ::operator delete (memory, std::align_val_t{64});
  }
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  void Register() {
    ParamBinding b = testing::Fp32Binding(master, m, v, param, &step_counter);
    b.grad_slot = grad.data();
    PlaneRegistration params;
    params.params.push_back(std::move(b));
    REQUIRE(service.AddParameters(kSession, std::move(params)).ok());
  }
  bool Post(Opcode op, uint64_t step = 0, wire::StateField field = {}) {
    CommandRecord c = testing::AdamWCommand(op, step);
    c.field = field;
    c.grads_posted = 1;
    return commands.TryPush(&c);
  }
  CompletionRecord Next() {
    CompletionRecord r{};
    REQUIRE(completions.Pop(&r, 5'000'000'000));
    return r;
  }
  // Waits up to 10 s for the plane to report a fault; returns its message.
  std::string WaitForFault() {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (!faults.empty()) {
          REQUIRE(faults.size() == 1);
          CHECK(faults[0].first == kSession);
          return faults[0].second;
        }
      }
      REQUIRE(std::chrono::steady_clock::now() < deadline);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  OptimizerService service;
  char* memory = nullptr;
  ControlRings rings;
  RingView commands, completions;
  std::vector<float> master, m, v, grad, param;
  uint64_t step_counter = 0;
  std::mutex mu;
  std::vector<std::pair<uint64_t, std::string>> faults;  // Guarded by mu.
};

}  // namespace

TEST_CASE("Solo plane: a step is applied and announced", "[plane]") {
  Client c;
  c.Register();
  REQUIRE(c.Post(Opcode::kLoadState, 0, wire::StateField::kParamFromSlot));
  CHECK(c.Next().opcode == Opcode::kStateDone);
  REQUIRE(c.Post(Opcode::kGradReady, 1));
  REQUIRE(c.Post(Opcode::kStepEnd, 1));
  CompletionRecord a = c.Next();
  CHECK(a.opcode == Opcode::kParamReady);
  CHECK(c.Next().opcode == Opcode::kStepDone);
  for (size_t i = 0; i < kNumel; ++i) {
    // AdamW's first step moves each weight by lr against the gradient's sign.
    const float want = static_cast<float>(i + 1) - 0.1f * c.grad[i];
    CHECK(std::fabs(c.param[i] - want) < 1e-5f);
  }
  CHECK(c.step_counter == 1);
  std::lock_guard<std::mutex> lock(c.mu);
  CHECK(c.faults.empty());
}

TEST_CASE("Solo plane: a command tail beyond the ring is a fault, reported once", "[plane]") {
  Client c;
  c.rings.command_ring()->tail.store(uint64_t{1} << 40);
  CHECK(c.WaitForFault().find("command ring corrupt") != std::string::npos);
}

TEST_CASE("Solo plane: a completion head ahead of the tail is a fault", "[plane]") {
  Client c;
  c.rings.completion_ring()->head.store(1000);
  REQUIRE(c.Post(Opcode::kSync));  // the plane must answer, and finds the ring corrupt
  CHECK(c.WaitForFault().find("completion ring corrupt") != std::string::npos);
}

TEST_CASE("Solo plane: a client that never drains is ended past the bound", "[plane]") {
  Client c;
  // Unknown opcodes, each answered with an error; nothing drains the completions.
  uint64_t pushed = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (pushed < kCapacity + kMaxQueuedCompletions + kCapacity) {
    if (c.Post(Opcode::kNone)) {
      ++pushed;
    } else {
      {
        std::lock_guard<std::mutex> lock(c.mu);
        if (!c.faults.empty()) break;
      }
      REQUIRE(std::chrono::steady_clock::now() < deadline);
      std::this_thread::yield();
    }
  }
  CHECK(c.WaitForFault().find("completions undrained") != std::string::npos);
  CHECK(pushed >= kMaxQueuedCompletions);
}

TEST_CASE("Service: a stopped plane takes no parameters; stopping twice is safe", "[plane]") {
  Client c;
  c.service.StopPlane(kSession);
  c.service.StopPlane(kSession);
  CHECK(c.service.failure(kSession).empty());
  CHECK(c.service.failure(kGroupPlane | kSession).empty());
  PlaneRegistration none;
  const Status st = c.service.AddParameters(kSession, std::move(none));
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK(st.message().find("no data plane") != std::string::npos);
}
