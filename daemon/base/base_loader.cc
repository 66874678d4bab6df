#include "base/base_loader.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>

#include "trainstream/wire/base_manifest.h"
#include "trainstream/wire/segment_header.h"

namespace trainstream::daemon::base {
namespace {

constexpr uint64_t kPage = 4096;

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

Status Invalid(const std::string& msg) { return Status(StatusCode::kInvalidArgument, msg); }

Status Cancelled() { return Status(StatusCode::kCancelled, kLoadCancelled); }

uint64_t Mix(uint64_t h, uint64_t v) {
  // FNV-1a over the 8 bytes of v.
  for (int i = 0; i < 8; ++i) {
    h ^= (v >> (8 * i)) & 0xff;
    h *= 0x100000001b3ull;
  }
  return h;
}

bool IsFloat(SafetensorsDType d) {
  return d == SafetensorsDType::kF32 || d == SafetensorsDType::kF16 || d == SafetensorsDType::kBF16;
}

}  // namespace

Status ParseBaseFormat(const std::string& format, int64_t block_size, BasePlan* plan) {
  if (block_size < 0) {
    return Invalid("block_size: " + std::to_string(block_size) +
                   " is negative (0 takes the default, 64)");
  }
  if (format.empty() || format == "none") {
    plan->quantize = false;
    plan->format_name = "none";
    plan->block_size = 0;
    return Status::Ok();
  }
  if (!kernels::ParseQuantFormat(format, &plan->format)) {
    return Invalid("format: '" + format.substr(0, 64) +
                   "' is not a base format (accepted: none, int8, nf4, fp8, nvfp4)");
  }
  const int64_t requested = block_size == 0 ? kernels::kDefaultQuantBlock : block_size;
  const std::string err = kernels::QuantArgsError(plan->format, requested);
  if (!err.empty()) return Invalid("block_size: " + err);
  plan->quantize = true;
  plan->format_name = kernels::QuantFormatName(plan->format);
  plan->block_size = kernels::EffectiveBlockSize(plan->format, requested);
  return Status::Ok();
}

bool IsBlockLinearWeight(const SafetensorsTensor& t) {
  if (t.shape.size() != 2 || !IsFloat(t.dtype) || t.numel() == 0) return false;
  const std::string suffix = ".weight";
  if (t.name.size() <= suffix.size() ||
      t.name.compare(t.name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return false;
  }
  size_t start = 0;
  while (start <= t.name.size()) {
    size_t dot = t.name.find('.', start);
    if (dot == std::string::npos) dot = t.name.size();
    const std::string part = t.name.substr(start, dot - start);
    if (!part.empty() &&
        std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; }))
      return true;
    start = dot + 1;
  }
  return false;
}

Status PlanBase(const ModelSources& sources, BasePlan* plan, const CancelCheck& cancelled) {
  plan->tensors.clear();
  plan->source_bytes = 0;
  plan->quantized_tensors = 0;
  // Remembers that `cancelled` fired, so a parse it stopped reads as CANCELLED.
  bool fired = false;
  const CancelCheck check = [&] { return fired = fired || (cancelled && cancelled()); };
  uint64_t h = Mix(0xcbf29ce484222325ull, sources.files.size());
  std::map<std::string, std::string> seen;  // tensor -> file
  for (size_t i = 0; i < sources.files.size(); ++i) {
    const SourceFile& f = sources.files[i];
    if (check()) return Cancelled();
    SafetensorsHeader header;
    Status st = ReadSafetensorsHeader(f.file, f.path, &header, check);
    if (fired) return Cancelled();
    if (!st.ok()) return st;
    if (plan->tensors.size() + header.tensors.size() > kMaxTensors) {
      return Invalid(sources.path + ": the shards list more than " + std::to_string(kMaxTensors) +
                     " tensors together (" +
                     std::to_string(plan->tensors.size() + header.tensors.size()) +
                     " up to and including " + f.path + "; accepted: at most " +
                     std::to_string(kMaxTensors) + " per checkpoint)");
    }
    const platform::ReadOnlyFileFacts& facts = f.file.facts();
    h = Mix(h, facts.dev);
    h = Mix(h, facts.ino);
    h = Mix(h, facts.size);
    h = Mix(h, facts.mtime_ns);
    h = Mix(h, header.header_hash);
    const std::string shard = f.path.substr(f.path.rfind(platform::PathSeparator()) + 1);
    for (auto& t : header.tensors) {
      auto [it, fresh] = seen.emplace(t.name, f.path);
      if (!fresh) {
        return Invalid("tensor \"" + t.name + "\" appears in both " + it->second + " and " +
                       f.path);
      }
      if (sources.has_index) {
        auto w = sources.index.weight_map.find(t.name);
        if (w == sources.index.weight_map.end() || w->second != shard) {
          return Invalid(f.path + ": tensor \"" + t.name + "\" is " +
                         (w == sources.index.weight_map.end()
                              ? std::string("missing from the index's weight_map")
                              : "mapped to " + w->second + " by the index") +
                         " (model.safetensors.index.json disagrees with the shards)");
        }
      }
      PlannedTensor p;
      p.file = i;
      p.src = std::move(t);
      p.src.begin += header.data_start;  // from here on: file offsets
      p.src.end += header.data_start;
      plan->source_bytes += p.src.bytes();
      plan->tensors.push_back(std::move(p));
    }
  }
  if (sources.has_index) {
    for (const auto& [name, shard] : sources.index.weight_map) {
      if (seen.find(name) == seen.end()) {
        return Invalid(sources.path + "/model.safetensors.index.json: tensor \"" + name +
                       "\" is mapped to " + shard + " but that shard does not hold it");
      }
    }
  }
  if (plan->tensors.empty()) return Invalid(sources.path + ": the checkpoint holds no tensors");
  plan->identity_hash = h;
  if (check()) return Cancelled();

  // Layout: header page, manifest, then the tensors (64-byte aligned).
  uint64_t cursor = 0;
  for (auto& t : plan->tensors) {
    t.quantized = plan->quantize && IsBlockLinearWeight(t.src);
    if (!t.quantized) {
      t.offset = cursor;
      t.bytes = t.src.bytes();
      cursor = AlignUp(cursor + t.bytes, wire::kBaseTensorAlign);
      continue;
    }
    ++plan->quantized_tensors;
    t.layout = kernels::MakeQuantLayout(plan->format, static_cast<int64_t>(t.src.numel()),
                                        plan->block_size);
    t.offset = cursor;
    t.bytes = static_cast<uint64_t>(t.layout.data_bytes);
    cursor = AlignUp(cursor + t.bytes, wire::kBaseTensorAlign);
    t.scales_offset = cursor;
    cursor =
        AlignUp(cursor + static_cast<uint64_t>(t.layout.scale_bytes()), wire::kBaseTensorAlign);
    t.tensor_scale_offset = cursor;
    cursor = AlignUp(cursor + sizeof(float), wire::kBaseTensorAlign);
  }
  // The manifest's size depends on the final offsets, which depend on where the
  // data starts: size the JSON with placeholder offsets as large as any real one.
  plan->manifest_offset = wire::kSegmentHeaderBytes;
  const uint64_t max_offset_guess = AlignUp(cursor, kPage) + (1ull << 40);
  BasePlan sizing = *plan;
  for (auto& t : sizing.tensors) {
    t.offset = max_offset_guess;
    t.scales_offset = max_offset_guess;
    t.tensor_scale_offset = max_offset_guess;
  }
  const uint64_t json_bytes = BaseManifestJson(sizing, std::string(64, 'k')).size();
  plan->data_offset =
      AlignUp(plan->manifest_offset + sizeof(wire::BaseManifestHeader) + json_bytes, kPage);
  for (auto& t : plan->tensors) {
    t.offset += plan->data_offset;
    if (t.quantized) {
      t.scales_offset += plan->data_offset;
      t.tensor_scale_offset += plan->data_offset;
    }
  }
  plan->total_bytes = plan->data_offset + AlignUp(cursor, kPage);
  return Status::Ok();
}

std::string BaseManifestJson(const BasePlan& plan, const std::string& key) {
  using nlohmann::json;
  json tensors = json::array();
  for (const auto& t : plan.tensors) {
    json e = {{"name", t.src.name},
              {"dtype", SafetensorsDTypeName(t.src.dtype)},
              {"shape", t.src.shape},
              {"offset", t.offset},
              {"bytes", t.bytes}};
    if (t.quantized) {
      e["quant"] = {{"format", plan.format_name},
                    {"block_size", t.layout.block_size},
                    {"padding", t.layout.padding()},
                    {"data_offset", t.offset},
                    {"data_bytes", t.layout.data_bytes},
                    {"scales_offset", t.scales_offset},
                    {"scales_bytes", t.layout.scale_bytes()},
                    {"scale_dtype", t.layout.scale_bytes_each == 4 ? "F32" : "U8"},
                    {"tensor_scale_offset", t.tensor_scale_offset}};
    }
    tensors.push_back(std::move(e));
  }
  json doc = {{"schema", 1},
              {"key", key},
              {"format", plan.format_name},
              {"block_size", plan.block_size},
              {"tensors", std::move(tensors)}};
  return doc.dump();
}

Status WriteBaseManifest(const BasePlan& plan, const std::string& key, char* segment) {
  const std::string manifest = BaseManifestJson(plan, key);
  if (plan.manifest_offset + sizeof(wire::BaseManifestHeader) + manifest.size() >
      plan.data_offset) {
    return Status(StatusCode::kInternal, "base manifest outgrew its planned space");
  }
  auto* mh = reinterpret_cast<wire::BaseManifestHeader*>(segment + plan.manifest_offset);
  std::memset(static_cast<void*>(mh), 0, sizeof(*mh));
  mh->magic = wire::kBaseManifestMagic;
  mh->version = wire::kBaseManifestVersion;
  mh->json_bytes = manifest.size();
  mh->data_bytes = plan.total_bytes - plan.data_offset;
  std::memcpy(segment + plan.manifest_offset + sizeof(*mh), manifest.data(), manifest.size());
  auto* sh = reinterpret_cast<wire::SegmentHeader*>(segment);
  sh->manifest_offset = plan.manifest_offset;
  sh->manifest_bytes = sizeof(*mh) + manifest.size();
  return Status::Ok();
}

}  // namespace trainstream::daemon::base
