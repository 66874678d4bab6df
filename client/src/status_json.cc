#include "status_json.h"

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>

namespace trainstream::internal {
namespace {
const char* KindName(int kind) {
  switch (kind) {
    case v1::SEGMENT_KIND_BASE:
      return "base";
    case v1::SEGMENT_KIND_SESSION:
      return "session";
    case v1::SEGMENT_KIND_STATE:
      return "state";
    default:
      return "unspecified";
  }
}
}  // namespace

std::string StatusToJson(const v1::StatusResponse& s, int indent) {
  using nlohmann::json;
  json doc;
  doc["schema"] = 1;
  doc["version"] = s.version();
  doc["pid"] = s.pid();
  doc["uptime_s"] = s.uptime_s();
  doc["socket_path"] = s.socket_path();
  doc["shm_dir"] = s.shm_dir();
  doc["draining"] = s.draining();
  doc["worker_threads"] = s.worker_threads();
  doc["budget"] = {
      {"limit", s.budget_limit()},
      {"used", s.budget_used()},
      {"free", s.budget_limit() > s.budget_used() ? s.budget_limit() - s.budget_used() : 0}};
  doc["pinned_bytes"] = s.pinned_bytes();
  json sessions = json::array();
  for (const auto& x : s.sessions()) {
    sessions.push_back({{"session_id", x.session_id()},
                        {"pid", x.pid()},
                        {"uid", x.uid()},
                        {"job", x.job()},
                        {"rank", x.rank()},
                        {"local_rank", x.local_rank()},
                        {"bytes_held", x.bytes_held()},
                        {"params", x.params()},
                        {"age_s", x.age_s()},
                        {"group", x.group()}});
  }
  doc["sessions"] = sessions;
  json segments = json::array();
  std::map<std::string, std::pair<uint64_t, uint64_t>> by_kind = {
      {"base", {0, 0}}, {"session", {0, 0}}, {"state", {0, 0}}};
  for (const auto& x : s.segments()) {
    const std::string kind = KindName(x.kind());
    segments.push_back({{"name", x.name()},
                        {"kind", kind},
                        {"bytes", x.bytes()},
                        {"session_id", x.session_id()},
                        {"label", x.label()}});
    by_kind[kind].first += 1;
    by_kind[kind].second += x.bytes();
  }
  doc["segments"] = segments;
  json kinds = json::object();
  for (const auto& [k, v] : by_kind) kinds[k] = {{"count", v.first}, {"bytes", v.second}};
  doc["segments_by_kind"] = kinds;
  json bases = json::array();
  for (const auto& x : s.bases()) {
    bases.push_back({{"key", x.key()},
                     {"bytes", x.bytes()},
                     {"refcount", x.refcount()},
                     {"format", x.format()},
                     {"path", x.path()},
                     {"owner_uid", x.owner_uid()}});
  }
  doc["bases"] = bases;
  json groups = json::array();
  for (const auto& g : s.groups()) {
    groups.push_back({{"key", g.key()},
                      {"uid", g.uid()},
                      {"local_world_size", g.local_world_size()},
                      {"members", g.members()},
                      {"node_rank", g.node_rank()},
                      {"nnodes", g.nnodes()},
                      {"world_size", g.world_size()},
                      {"state", g.state()},
                      {"state_bytes", g.state_bytes()},
                      {"staging_bytes", g.staging_bytes()},
                      {"params", g.params()}});
  }
  doc["groups"] = groups;
  return doc.dump(indent);
}

}  // namespace trainstream::internal
