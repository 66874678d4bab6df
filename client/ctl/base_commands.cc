#include "base_commands.h"

#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "status_table.h"
#include "trainstream/human_bytes.h"
#include "trainstream/platform/this_process.h"

namespace trainstream::ctl {
namespace {

nlohmann::json ToJson(const BaseInfo& b) {
  return {{"key", b.key},
          {"path", b.path},
          {"format", b.format},
          {"block_size", b.block_size},
          {"owner_uid", b.owner_uid},
          {"segment", b.segment_name},
          {"segment_bytes", b.segment_bytes},
          {"source_bytes", b.source_bytes},
          {"tensors", b.tensors},
          {"quantized_tensors", b.quantized_tensors},
          {"refcount", b.refcount},
          {"sessions", b.sessions},
          {"load_seconds", b.load_seconds},
          {"allocate_seconds", b.allocate_seconds},
          {"load_threads", b.load_threads},
          {"scratch_peak_bytes", b.scratch_peak_bytes},
          {"cached", b.cached},
          {"vram_copies", b.vram_copies},
          {"vram_bytes", b.vram_bytes}};
}

}  // namespace

Status RunBaseCommand(Client& client, const std::string& what, const BaseLoadOptions& load,
                      const std::string& drop_key, bool json) {
  if (what == "load") {
    const bool tty = platform::StderrIsTerminal();
    const auto started = std::chrono::steady_clock::now();
    bool shown = false;
    BaseInfo info;
    Status s = client.LoadBase(
        load,
        [tty, started, &shown](const BaseProgress& p) {
          if (!tty || p.bytes_total == 0) return;
          const double s =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
          const double rate = s > 0 ? p.bytes_read / s : 0;
          // Padded so a shorter line overwrites a longer one.
          std::fprintf(stderr,
                       "\rloading: %u/%u tensors, %s of %s (%.1f%%), %.2f GB/s, %u threads   ",
                       p.tensors_done, p.tensors_total, HumanBytes(p.bytes_read).c_str(),
                       HumanBytes(p.bytes_total).c_str(), 100.0 * p.bytes_read / p.bytes_total,
                       rate / 1e9, p.threads);
          shown = true;
        },
        &info);
    if (shown) std::fprintf(stderr, "\n");
    if (!s.ok()) return s;
    if (json) {
      std::printf("%s\n", ToJson(info).dump(2).c_str());
    } else {
      std::printf("%s %s\n  key %s\n  %u tensors (%u quantized, %s), %s read -> %s segment %s\n",
                  info.cached ? "cached" : "loaded", info.path.c_str(), info.key.c_str(),
                  info.tensors, info.quantized_tensors, info.format.c_str(),
                  HumanBytes(info.source_bytes).c_str(), HumanBytes(info.segment_bytes).c_str(),
                  info.segment_name.c_str());
      if (!info.cached) {
        std::printf(
            "  %.2f s (%.2f GB/s; %.2f s allocating the segment) on %u threads, scratch "
            "peak %s\n",
            info.load_seconds,
            info.load_seconds > 0 ? info.source_bytes / info.load_seconds / 1e9 : 0.0,
            info.allocate_seconds, info.load_threads, HumanBytes(info.scratch_peak_bytes).c_str());
      }
    }
    return Status::Ok();
  }
  if (what == "list") {
    std::vector<BaseInfo> bases;
    Status s = client.ListBases(&bases);
    if (!s.ok()) return s;
    if (json) {
      nlohmann::json arr = nlohmann::json::array();
      for (const auto& b : bases) arr.push_back(ToJson(b));
      std::printf("%s\n", arr.dump(2).c_str());
      return Status::Ok();
    }
    std::printf("%-48s %-6s %-5s %-11s %s\n", "KEY", "FORMAT", "REFS", "BYTES", "PATH");
    for (const auto& b : bases) {
      std::printf("%-48s %-6s %-5u %-11s %s\n", b.key.c_str(), b.format.c_str(), b.refcount,
                  HumanBytes(b.segment_bytes).c_str(), b.path.c_str());
    }
    return Status::Ok();
  }
  uint64_t freed = 0;
  Status s = client.DropBase(drop_key, &freed);
  if (!s.ok()) return s;
  std::printf("dropped base %s (%s freed)\n", drop_key.c_str(), HumanBytes(freed).c_str());
  return Status::Ok();
}

}  // namespace trainstream::ctl
