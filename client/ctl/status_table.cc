#include "status_table.h"

#include <cstdint>
#include <cstdio>
#include <sstream>

#include "trainstream/human_bytes.h"

namespace trainstream::ctl {

namespace {
std::string Pad(const std::string& s, size_t width) {
  return s.size() >= width ? s + " " : s + std::string(width - s.size(), ' ');
}
std::string Percent(uint64_t part, uint64_t whole) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%.1f%%",
                whole == 0 ? 0.0 : 100.0 * static_cast<double>(part) / static_cast<double>(whole));
  return buf;
}
}  // namespace

std::string RenderStatusTable(const nlohmann::json& s) {
  std::ostringstream o;
  const uint64_t used = s["budget"]["used"], limit = s["budget"]["limit"];
  char uptime[32];
  std::snprintf(uptime, sizeof(uptime), "%.0f s", s["uptime_s"].get<double>());
  o << "trainstreamd " << s["version"].get<std::string>() << "  pid " << s["pid"] << "  up "
    << uptime << (s["draining"].get<bool>() ? "  DRAINING" : "") << "\n";
  o << "socket  " << s["socket_path"].get<std::string>() << "\n";
  o << "shm     " << s["shm_dir"].get<std::string>() << "\n";
  o << "budget  " << HumanBytes(used) << " used of " << HumanBytes(limit) << " ("
    << Percent(used, limit) << ")\n";
  o << "pinned  " << HumanBytes(s["pinned_bytes"]) << "\n";
  o << "workers " << s["worker_threads"] << "\n\n";

  const auto& sessions = s["sessions"];
  o << "SESSIONS (" << sessions.size() << ")\n";
  if (!sessions.empty()) {
    o << Pad("ID", 6) << Pad("PID", 9) << Pad("UID", 7) << Pad("JOB", 24) << Pad("RANK", 6)
      << Pad("PARAMS", 8) << Pad("HELD", 12) << "AGE\n";
    for (const auto& x : sessions) {
      char age[32];
      std::snprintf(age, sizeof(age), "%.0f s", x["age_s"].get<double>());
      o << Pad(std::to_string(x["session_id"].get<uint64_t>()), 6)
        << Pad(std::to_string(x["pid"].get<int64_t>()), 9)
        << Pad(std::to_string(x["uid"].get<uint32_t>()), 7) << Pad(x["job"].get<std::string>(), 24)
        << Pad(std::to_string(x["rank"].get<int32_t>()), 6)
        << Pad(std::to_string(x["params"].get<uint64_t>()), 8)
        << Pad(HumanBytes(x["bytes_held"]), 12) << age << "\n";
    }
  }
  o << "\nSEGMENTS\n" << Pad("KIND", 9) << Pad("COUNT", 7) << "BYTES\n";
  for (const char* kind : {"base", "session", "state"}) {
    const auto& k = s["segments_by_kind"][kind];
    o << Pad(kind, 9) << Pad(std::to_string(k["count"].get<uint64_t>()), 7)
      << HumanBytes(k["bytes"]) << "\n";
  }
  const auto& bases = s["bases"];
  o << "\nCACHED BASES (" << bases.size() << ")\n";
  if (!bases.empty()) {
    o << Pad("KEY", 40) << Pad("FORMAT", 8) << Pad("REFS", 6) << "BYTES\n";
    for (const auto& b : bases) {
      o << Pad(b["key"].get<std::string>(), 40) << Pad(b["format"].get<std::string>(), 8)
        << Pad(std::to_string(b["refcount"].get<uint32_t>()), 6) << HumanBytes(b["bytes"]) << "\n";
    }
  }
  if (s.contains("groups") && !s["groups"].empty()) {
    const auto& groups = s["groups"];
    o << "\nDATA-PARALLEL GROUPS (" << groups.size() << ")\n";
    o << Pad("KEY", 40) << Pad("STATE", 9) << Pad("RANKS", 7) << Pad("NODE", 7)
      << Pad("OPTIMIZER", 12) << "STAGING\n";
    for (const auto& g : groups) {
      o << Pad(g["key"].get<std::string>(), 40) << Pad(g["state"].get<std::string>(), 9)
        << Pad(std::to_string(g["members"].get<uint32_t>()) + "/" +
                   std::to_string(g["local_world_size"].get<int32_t>()),
               7)
        << Pad(std::to_string(g["node_rank"].get<int32_t>()) + "/" +
                   std::to_string(g["nnodes"].get<int32_t>()),
               7)
        << Pad(HumanBytes(g["state_bytes"]), 12) << HumanBytes(g["staging_bytes"]) << "\n";
    }
  }
  return o.str();
}

}  // namespace trainstream::ctl
