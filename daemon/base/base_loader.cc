#include "base/base_loader.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "trainstream/wire/base_manifest.h"
#include "trainstream/wire/segment_header.h"

namespace trainstream::daemon::base {
namespace {

constexpr uint64_t kPage = 4096;

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

Status Invalid(const std::string& msg) { return Status(StatusCode::kInvalidArgument, msg); }

Status Cancelled() { return Status(StatusCode::kCancelled, kLoadCancelled); }

// Reads are split into pieces this large so that a cancelled load stops within
// one piece (tens of ms) even in a multi-GB tensor.
constexpr uint64_t kReadPiece = 64ull << 20;

uint64_t Mix(uint64_t h, uint64_t v) {
  // FNV-1a over the 8 bytes of v.
  for (int i = 0; i < 8; ++i) {
    h ^= (v >> (8 * i)) & 0xff;
    h *= 0x100000001b3ull;
  }
  return h;
}

// IEEE half -> float, exact (the kernels read fp32 or bf16; fp16 -> fp32 does
// not change a value, so the quantized bytes match quantize_tensor's).
float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    const float v = std::ldexp(static_cast<float>(man), -24);  // zero or subnormal, exact
    return sign ? -v : v;
  }
  const uint32_t bits =
      exp == 0x1f ? sign | 0x7f800000u | (man << 13) : sign | ((exp + 112u) << 23) | (man << 13);
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

bool IsFloat(SafetensorsDType d) {
  return d == SafetensorsDType::kF32 || d == SafetensorsDType::kF16 || d == SafetensorsDType::kBF16;
}

// Reads exactly `bytes` at `offset`; an error names the file and the tensor.
// `cancelled` is polled between pieces.
Status ReadFully(const SourceFile& f, const std::string& tensor, uint64_t offset, uint64_t bytes,
                 char* dst, const CancelCheck& cancelled) {
  uint64_t done = 0;
  while (done < bytes) {
    if (done != 0 && cancelled && cancelled()) return Cancelled();
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(bytes - done, kReadPiece));
    const ssize_t r = pread(f.fd, dst + done, chunk, static_cast<off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      return Status(StatusCode::kDataLoss,
                    f.path + ": reading tensor \"" + tensor + "\": " + std::strerror(errno));
    }
    if (r == 0) {
      return Status(StatusCode::kDataLoss,
                    f.path + ": reading tensor \"" + tensor +
                        "\": the file ended early (it shrank while loading?)");
    }
    done += static_cast<uint64_t>(r);
  }
  return Status::Ok();
}

// Index of the first non-finite element, or -1.
int64_t FirstNonFinite(const PlannedTensor& t, const void* src) {
  const uint64_t n = t.src.numel();
  if (t.src.dtype == SafetensorsDType::kF32) {
    const auto* p = static_cast<const uint32_t*>(src);
    for (uint64_t i = 0; i < n; ++i)
      if ((p[i] & 0x7f800000u) == 0x7f800000u) return static_cast<int64_t>(i);
  } else {
    // BF16 (exponent 0x7f80) and F16 (0x7c00).
    const uint16_t mask = t.src.dtype == SafetensorsDType::kBF16 ? 0x7f80 : 0x7c00;
    const auto* p = static_cast<const uint16_t*>(src);
    for (uint64_t i = 0; i < n; ++i)
      if ((p[i] & mask) == mask) return static_cast<int64_t>(i);
  }
  return -1;
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
    Status st = ReadSafetensorsHeader(f.fd, f.path, &header, check);
    if (fired) return Cancelled();
    if (!st.ok()) return st;
    if (plan->tensors.size() + header.tensors.size() > kMaxTensors) {
      return Invalid(sources.path + ": the shards list more than " + std::to_string(kMaxTensors) +
                     " tensors together (" +
                     std::to_string(plan->tensors.size() + header.tensors.size()) +
                     " up to and including " + f.path + "; accepted: at most " +
                     std::to_string(kMaxTensors) + " per checkpoint)");
    }
    h = Mix(h, f.st.st_dev);
    h = Mix(h, f.st.st_ino);
    h = Mix(h, static_cast<uint64_t>(f.st.st_size));
    h = Mix(h, static_cast<uint64_t>(f.st.st_mtim.tv_sec) * 1000000000ull +
                   static_cast<uint64_t>(f.st.st_mtim.tv_nsec));
    h = Mix(h, header.header_hash);
    const std::string shard = f.path.substr(f.path.rfind('/') + 1);
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

Status FillBase(const ModelSources& sources, const BasePlan& plan, const std::string& key,
                char* segment, const std::function<bool(const LoadProgress&)>& progress,
                uint64_t* scratch_peak) {
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

  LoadProgress p;
  p.bytes_total = plan.source_bytes;
  p.tensors_total = static_cast<uint32_t>(plan.tensors.size());
  const CancelCheck cancelled = [&] { return progress && !progress(p); };
  *scratch_peak = 0;
  std::unique_ptr<char[]> scratch;
  uint64_t scratch_bytes = 0;
  for (const auto& t : plan.tensors) {
    const SourceFile& f = sources.files[t.file];
    if (!t.quantized) {
      Status st =
          ReadFully(f, t.src.name, t.src.begin, t.src.bytes(), segment + t.offset, cancelled);
      if (!st.ok()) return st;
    } else {
      // Source bytes, plus an fp32 copy for F16 (the kernels read fp32 or bf16).
      const uint64_t need =
          t.src.bytes() +
          (t.src.dtype == SafetensorsDType::kF16 ? t.src.numel() * sizeof(float) : 0);
      if (need > scratch_bytes) {
        scratch.reset();  // free first: peak is one buffer, not two
        scratch.reset(new (std::nothrow) char[need]);
        if (!scratch) {
          return Status(StatusCode::kResourceExhausted,
                        "cannot allocate " + std::to_string(need) +
                            " bytes of scratch to quantize tensor \"" + t.src.name + "\"");
        }
        scratch_bytes = need;
        *scratch_peak = std::max(*scratch_peak, need);
      }
      Status st = ReadFully(f, t.src.name, t.src.begin, t.src.bytes(), scratch.get(), cancelled);
      if (!st.ok()) return st;
      const int64_t bad = FirstNonFinite(t, scratch.get());
      if (bad >= 0) {
        return Invalid(f.path + ": tensor \"" + t.src.name +
                       "\" has a non-finite value (NaN or "
                       "inf) at element " +
                       std::to_string(bad) +
                       "; only finite weights can be quantized (load it with format none)");
      }
      const void* src = scratch.get();
      kernels::QuantElemType type = kernels::QuantElemType::kBFloat16;
      if (t.src.dtype == SafetensorsDType::kF32) {
        type = kernels::QuantElemType::kFloat32;
      } else if (t.src.dtype == SafetensorsDType::kF16) {
        const auto* h = reinterpret_cast<const uint16_t*>(scratch.get());
        auto* out = reinterpret_cast<float*>(scratch.get() + t.src.bytes());
        for (uint64_t i = 0; i < t.src.numel(); ++i) out[i] = HalfToFloat(h[i]);
        src = out;
        type = kernels::QuantElemType::kFloat32;
      }
      auto* tensor_scale = reinterpret_cast<float*>(segment + t.tensor_scale_offset);
      *tensor_scale = 0.0f;
      kernels::QuantBuffers out{reinterpret_cast<uint8_t*>(segment + t.offset),
                                segment + t.scales_offset, tensor_scale};
      kernels::QuantizeCpu(plan.format, t.layout, type, src, out);
    }
    // The checkpoint's pages are not needed again: keep the page cache for others.
    if (t.src.bytes() != 0) {  // length 0 would mean "to the end of the file"
      posix_fadvise(f.fd, static_cast<off_t>(t.src.begin), static_cast<off_t>(t.src.bytes()),
                    POSIX_FADV_DONTNEED);
    }
    p.bytes_read += t.src.bytes();
    p.tensors_done += 1;
    if (progress && !progress(p)) return Cancelled();
  }
  return Status::Ok();
}

}  // namespace trainstream::daemon::base
