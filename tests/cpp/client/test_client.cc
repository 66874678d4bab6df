// trainstream-test-client: a scriptable client for the integration tests
// (tests/python/test_daemon_*.py). It reads one command per line on stdin (or
// takes one command from argv) and prints one JSON object per command:
// {"ok": true, ...} or {"ok": false, "code": "INVALID_ARGUMENT", "message": ...}.
//
// Commands:
//   ping | status | shutdown [drain|discard]
//   attach [job] [rank]              opens a session (held until detach/quit)
//   alloc <bytes> [label]            AllocateRegion through the client library
//   free <region_id>
//   register <json>                  {"groups":[{lr,beta1,beta2,eps,weight_decay}],
//                                     "params":[{id,name,shape,dtype,grad_dtype,group}],
//                                     "moment_dtype":1}
//   raw_alloc <bytes> <kind> [session_id] [token]   crafted AllocateRegion (raw gRPC)
//   raw_free <region_id> [session_id] [token]
//   fill <region_id> <byte>          memset a region this client allocated
//   alive | wait_dead <timeout_ms> | detach | quit
//
// Hostile commands (tests/python/test_hostile.py): what an attached client can
// do to memory it shares with the daemon.
//   poke <offset> <u64>              write a u64 into the control region (offset from
//                                    its SessionControlHeader)
//   peek <offset>                    read one
//   post <json>                      push one CommandRecord on the command ring as a
//                                    well-behaved producer (fields as in session_control.h)
//   flood <n>                        push n zeroed records (opcode 0), waiting for room,
//                                    never draining completions
//   fill_staging <reg> <offset> <bytes> <byte>   memset bytes of registration reg's
//                                    staging (offset from the segment start), e.g.
//                                    its weight slots, which hold masters
//   truncate <segment> <bytes>       ftruncate a file in the shm dir (O_RDWR open)
//   try_open <segment> <r|rw>        open a segment file; reports errno
//   try_chmod <segment> <octal>      chmod a segment file; reports errno
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "segment_file_commands.h"
#include "trainstream/client.h"
#include "trainstream/platform/control_channel.h"
#include "trainstream/platform/sys_call.h"
#include "trainstream/platform/this_process.h"
#include "trainstream/v1/control.grpc.pb.h"
#include "trainstream/wire/ring.h"
#include "trainstream/wire/session_control.h"

using nlohmann::json;

namespace {

json Error(const trainstream::Status& s) {
  return {{"ok", false}, {"code", trainstream::StatusCodeName(s.code())}, {"message", s.message()}};
}
json GrpcError(const grpc::Status& s) {
  static const std::map<grpc::StatusCode, const char*> kNames = {
      {grpc::StatusCode::INVALID_ARGUMENT, "INVALID_ARGUMENT"},
      {grpc::StatusCode::NOT_FOUND, "NOT_FOUND"},
      {grpc::StatusCode::PERMISSION_DENIED, "PERMISSION_DENIED"},
      {grpc::StatusCode::RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED"},
      {grpc::StatusCode::UNAVAILABLE, "UNAVAILABLE"},
      {grpc::StatusCode::FAILED_PRECONDITION, "FAILED_PRECONDITION"}};
  auto it = kNames.find(s.error_code());
  return {{"ok", false},
          {"code", it == kNames.end() ? "OTHER" : it->second},
          {"message", s.error_message()}};
}

struct State {
  std::string socket;
  std::unique_ptr<trainstream::Client> client;
  std::unique_ptr<trainstream::Session> session;
  uint64_t session_id = 0;
  std::string token;  // read from the raw stream only for raw_* commands
  std::map<uint64_t, std::unique_ptr<trainstream::MappedRegion>> regions;
  std::vector<trainstream::Registration> registrations;
  std::unique_ptr<trainstream::v1::Control::Stub> raw;
  trainstream::platform::ControlTarget raw_target;  // the raw calls' secret, where there is one
};

json Run(State& st, const std::string& line) {
  std::istringstream in(line);
  std::string cmd;
  in >> cmd;
  trainstream::Status s;
  if (cmd == "ping") {
    trainstream::PingResult r;
    s = st.client->Ping(&r);
    if (!s.ok()) return Error(s);
    return {{"ok", true}, {"pid", r.pid}, {"version", r.version}};
  }
  if (cmd == "status") {
    std::string doc;
    s = st.client->StatusJson(&doc);
    if (!s.ok()) return Error(s);
    return {{"ok", true}, {"status", json::parse(doc)}};
  }
  if (cmd == "shutdown") {
    std::string mode;  // "drain", "discard" or nothing (keep the state)
    in >> mode;
    trainstream::ShutdownResult r;
    s = st.client->Shutdown(mode == "drain"     ? trainstream::ShutdownMode::kDrain
                            : mode == "discard" ? trainstream::ShutdownMode::kDiscardState
                                                : trainstream::ShutdownMode::kKeepState,
                            &r);
    if (!s.ok()) return Error(s);
    return {{"ok", true}, {"sessions", r.sessions}, {"state_kept", r.state_kept}};
  }
  if (cmd == "attach") {
    trainstream::AttachOptions o;
    o.job = "test";
    in >> o.job >> o.rank >> o.resume_token;  // resume_token: optional (docs/recovery.md)
    s = st.client->Attach(o, &st.session);
    if (!s.ok()) return Error(s);
    st.session_id = st.session->id();
    const auto& c = st.session->control().info();
    json resumed = nullptr;
    if (const trainstream::ResumedState* r = st.session->resumed(); r != nullptr) {
      resumed = {{"completed_step", r->completed_step}, {"registrations", r->registrations.size()}};
    }
    return {{"ok", true},
            {"session_id", st.session_id},
            {"recovery_token", st.session->recovery_token()},
            {"resumed", resumed},
            {"shm_dir", st.session->shm_dir()},
            {"control",
             {{"segment", c.segment_name},
              {"region_id", c.region_id},
              {"offset", c.offset},
              {"length", c.length}}},
            {"pid", trainstream::platform::CurrentProcessId()}};
  }
  if (!st.session && cmd != "raw_alloc" && cmd != "raw_free" && cmd != "quit") {
    return {{"ok", false}, {"code", "CLIENT"}, {"message", "not attached"}};
  }
  if (cmd == "alloc") {
    uint64_t bytes = 0;
    std::string label = "test";
    in >> bytes >> label;
    std::unique_ptr<trainstream::MappedRegion> r;
    s = st.session->AllocateRegion(bytes, label, &r);
    if (!s.ok()) return Error(s);
    json out = {{"ok", true},
                {"region_id", r->info().region_id},
                {"segment", r->info().segment_name},
                {"offset", r->info().offset},
                {"length", r->info().length},
                {"segment_size", r->info().segment_size}};
    st.regions[r->info().region_id] = std::move(r);
    return out;
  }
  if (cmd == "free") {
    uint64_t id = 0, freed = 0;
    in >> id;
    s = st.session->FreeRegion(id, &freed);
    if (!s.ok()) return Error(s);
    st.regions.erase(id);
    return {{"ok", true}, {"bytes_freed", freed}};
  }
  if (cmd == "fill") {
    uint64_t id = 0;
    int byte = 0;
    in >> id >> byte;
    auto it = st.regions.find(id);
    if (it == st.regions.end())
      return {{"ok", false}, {"code", "CLIENT"}, {"message", "unknown region"}};
    std::memset(it->second->data(), byte, it->second->size());
    return {{"ok", true}};
  }
  if (cmd == "fill_staging") {  // registration index, offset from the segment start, bytes, byte
    size_t index = 0;
    uint64_t offset = 0, bytes = 0;
    int byte = 0;
    in >> index >> offset >> bytes >> byte;
    if (index >= st.registrations.size())
      return {{"ok", false}, {"code", "CLIENT"}, {"message", "unknown registration"}};
    const trainstream::MappedRegion& m = *st.registrations[index].staging;
    const uint64_t start = m.info().offset;
    if (offset < start || offset - start > m.size() || bytes > m.size() - (offset - start))
      return {{"ok", false}, {"code", "CLIENT"}, {"message", "offset"}};
    std::memset(static_cast<char*>(m.data()) + (offset - start), byte, bytes);
    return {{"ok", true}};
  }
  if (cmd == "register") {
    std::string rest;
    std::getline(in, rest);
    json spec = json::parse(rest);
    trainstream::RegisterOptions o;
    for (const auto& g : spec.value("groups", json::array())) {
      trainstream::AdamWHyperParams h;
      h.lr = g.value("lr", h.lr);
      h.beta1 = g.value("beta1", h.beta1);
      h.beta2 = g.value("beta2", h.beta2);
      h.eps = g.value("eps", h.eps);
      h.weight_decay = g.value("weight_decay", h.weight_decay);
      o.groups.push_back(h);
    }
    o.moment_dtype = static_cast<trainstream::DType>(spec.value("moment_dtype", 1));
    o.grad_pool_bytes = spec.value("grad_pool_bytes", 0ull);
    std::vector<trainstream::ParameterSpec> params;
    for (const auto& p : spec.value("params", json::array())) {
      trainstream::ParameterSpec ps;
      ps.param_id = p.value("id", 0ull);
      ps.name = p.value("name", std::string("p"));
      ps.shape = p.value("shape", std::vector<int64_t>{});
      ps.dtype = static_cast<trainstream::DType>(p.value("dtype", 1));
      ps.grad_dtype = static_cast<trainstream::DType>(p.value("grad_dtype", p.value("dtype", 1)));
      ps.group = p.value("group", 0u);
      params.push_back(ps);
    }
    trainstream::Registration reg;
    s = st.session->RegisterParameters(o, params, &reg);
    if (!s.ok()) return Error(s);
    json slots = json::array();
    for (const auto& sl : reg.slots) {
      slots.push_back({{"param_id", sl.param_id},
                       {"grad_offset", sl.grad_offset},
                       {"param_offset", sl.param_offset},
                       {"numel", sl.numel}});
    }
    json out = {{"ok", true},
                {"staging", reg.staging->info().segment_name},
                {"staging_size", reg.staging->info().segment_size},
                {"grad_pool_offset", reg.grad_pool_offset},
                {"grad_pool_bytes", reg.grad_pool_bytes},
                {"slots", slots}};
    st.registrations.push_back(std::move(reg));
    return out;
  }
  if (cmd == "raw_alloc" || cmd == "raw_free") {
    uint64_t a = 0, sid = st.session_id;
    int kind = 2;
    std::string token = st.session ? st.session->token() : std::string("0");
    in >> a;
    if (cmd == "raw_alloc") in >> kind;
    in >> sid >> token;
    grpc::ClientContext ctx;
    trainstream::platform::AddEndpointSecret(st.raw_target, &ctx);
    grpc::Status gs;
    if (cmd == "raw_alloc") {
      trainstream::v1::AllocateRegionRequest req;
      req.set_session_id(sid);
      req.set_session_token(token);
      req.set_bytes(a);
      req.set_kind(static_cast<trainstream::v1::SegmentKind>(kind));
      trainstream::v1::AllocateRegionResponse resp;
      gs = st.raw->AllocateRegion(&ctx, req, &resp);
    } else {
      trainstream::v1::FreeRegionRequest req;
      req.set_session_id(sid);
      req.set_session_token(token);
      req.set_region_id(a);
      trainstream::v1::FreeRegionResponse resp;
      gs = st.raw->FreeRegion(&ctx, req, &resp);
    }
    if (!gs.ok()) return GrpcError(gs);
    return {{"ok", true}};
  }
  if (cmd == "alive") {
    std::string why;
    bool alive = st.session->alive(&why);
    return {{"ok", true}, {"alive", alive}, {"why", why}};
  }
  if (cmd == "wait_dead") {
    int timeout_ms = 5000;
    in >> timeout_ms;
    auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    std::string why;
    while (st.session->alive(&why) && std::chrono::steady_clock::now() < end) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    bool alive = st.session->alive(&why);
    return {{"ok", !alive}, {"alive", alive}, {"why", why}};
  }
  if (cmd == "poke" || cmd == "peek") {
    uint64_t offset = 0, value = 0;
    in >> offset >> value;
    auto& c = st.session->control();
    if (offset + 8 > c.size()) return {{"ok", false}, {"code", "CLIENT"}, {"message", "offset"}};
    auto* word = reinterpret_cast<uint64_t*>(static_cast<char*>(c.data()) + offset);
    if (cmd == "poke") *reinterpret_cast<volatile uint64_t*>(word) = value;
    return {{"ok", true}, {"value", *reinterpret_cast<volatile uint64_t*>(word)}};
  }
  if (cmd == "post" || cmd == "flood") {
    using trainstream::wire::CommandRecord;
    auto* h = static_cast<trainstream::wire::SessionControlHeader*>(st.session->control().data());
    trainstream::wire::RingView ring(static_cast<char*>(st.session->control().data()) +
                                     h->command_ring_offset);
    CommandRecord rec{};
    uint64_t n = 1;
    if (cmd == "post") {
      std::string rest;
      std::getline(in, rest);
      json j = json::parse(rest);
      rec.opcode = static_cast<trainstream::wire::Opcode>(j.value("opcode", 0u));
      rec.flags = j.value("flags", 0u);
      rec.seq = j.value("seq", 0ull);
      rec.param_id = j.value("param_id", 0ull);
      rec.step = j.value("step", 0ull);
      rec.lr = j.value("lr", 0.0);
      rec.beta1 = j.value("beta1", 0.9);
      rec.beta2 = j.value("beta2", 0.999);
      rec.eps = j.value("eps", 1e-8);
      rec.field = static_cast<trainstream::wire::StateField>(j.value("field", 0u));
      rec.region_id = j.value("region_id", 0ull);
      rec.region_offset = j.value("region_offset", 0ull);
      rec.bytes = j.value("bytes", 0ull);
    } else {
      in >> n;
    }
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    uint64_t pushed = 0;
    while (pushed < n && std::chrono::steady_clock::now() < end && st.session->alive(nullptr)) {
      if (ring.TryPush(&rec)) {
        ++pushed;
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
    return {{"ok", pushed == n}, {"pushed", pushed}};
  }
  if (cmd == "truncate" || cmd == "try_open" || cmd == "try_chmod") {
    std::string name, arg;
    in >> name >> arg;
    const std::string path = st.session->shm_dir() + "/" + name;
    const int err = RunSegmentFileCommand(cmd, path, arg);
    if (err != 0) {
      return {{"ok", false},
              {"code", "ERRNO"},
              {"errno", err},
              {"message", trainstream::platform::ErrnoMessage(err)}};
    }
    return {{"ok", true}};
  }
  if (cmd == "detach") {
    st.regions.clear();
    st.registrations.clear();
    st.session.reset();
    return {{"ok", true}};
  }
  return {{"ok", false}, {"code", "CLIENT"}, {"message", "unknown command '" + cmd + "'"}};
}

}  // namespace

int main(int argc, char** argv) {
  State st;
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() >= 2 && args[0] == "--socket") {
    st.socket = args[1];
    args.erase(args.begin(), args.begin() + 2);
  } else {
    st.socket = trainstream::DefaultSocketPath();
  }
  trainstream::Status s = trainstream::Client::Connect(st.socket, 5000, &st.client);
  if (!s.ok()) {
    std::cout << Error(s).dump() << std::endl;
    return 3;
  }
  std::string why;
  if (trainstream::platform::ResolveControlTarget(st.socket, &st.raw_target, &why) != 0) {
    std::cout << json{{"ok", false}, {"code", "CLIENT"}, {"message", why}}.dump() << std::endl;
    return 3;
  }
  st.raw = trainstream::v1::Control::NewStub(
      grpc::CreateChannel(st.raw_target.grpc_target, grpc::InsecureChannelCredentials()));
  if (!args.empty()) {
    std::string line;
    for (const auto& a : args) line += (line.empty() ? "" : " ") + a;
    json out = Run(st, line);
    std::cout << out.dump() << std::endl;
    return out.value("ok", false) ? 0 : 1;
  }
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line == "quit") break;
    if (line.empty()) continue;
    json out;
    try {
      out = Run(st, line);
    } catch (const std::exception& e) {
      out = {{"ok", false}, {"code", "CLIENT"}, {"message", e.what()}};
    }
    std::cout << out.dump() << std::endl;
  }
  return 0;
}
