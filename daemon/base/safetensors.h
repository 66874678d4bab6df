// A strict reader of the safetensors format (an 8-byte little-endian header
// length N, N bytes of UTF-8 JSON, then the raw tensor bytes), and of the shard
// index (`model.safetensors.index.json`) that splits a model over several files.
//
// Everything a file says is checked before any tensor byte is trusted: the header
// length against the file size, the JSON (no duplicate keys, no unknown fields,
// at most kMaxJsonDepth levels), each tensor's dtype (one of kSafetensorsDTypes),
// shape (non-negative integers whose byte size does not overflow) and
// data_offsets (begin <= end, end - begin == the shape's byte size), and the data
// area as a whole (tensors do not overlap, leave no holes, and end exactly where
// the file ends). Errors name the file, the tensor and what is wrong, and say
// what is accepted.
//
// Parsing is linear in the header's size (a SAX parse; see StrictSax in the
// .cc for why not nlohmann's callback parser), a header may list at most
// kMaxTensors tensors, and a long parse can be cancelled (CancelCheck).
//
// No I/O beyond pread on a caller's fd, no gRPC: the fuzz target
// (tests/fuzz/safetensors_fuzz.cc) links only this file, trainstream_common and
// nlohmann-json.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "trainstream/platform/read_only_file.h"
#include "trainstream/status.h"

namespace trainstream::daemon::base {

enum class SafetensorsDType : uint8_t {
  kF64,
  kF32,
  kF16,
  kBF16,
  kI64,
  kI32,
  kI16,
  kI8,
  kU8,
  kBool,
  kF8E4M3,
  kF8E5M2,
};

// "F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL, F8_E4M3, F8_E5M2".
extern const char* const kSafetensorsDTypes;
// The header's spelling ("BF16") and the element size in bytes.
const char* SafetensorsDTypeName(SafetensorsDType d);
uint64_t SafetensorsDTypeSize(SafetensorsDType d);
bool ParseSafetensorsDType(std::string_view name, SafetensorsDType* out);

// Headers larger than this are refused (the largest real ones are a few MiB).
inline constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
inline constexpr int kMaxJsonDepth = 4;

// The most tensors one file may list, and (base_loader.h) all the shards of a
// checkpoint together. Real checkpoints stay far below: the most tensor-heavy
// public ones (DeepSeek-V3 and Kimi-K2, FP8 weights each with its scale
// tensor) hold about 92k and 140k in all, and single shards a few thousand.
// The cap bounds what one LoadBase request costs the daemon: a header at the
// cap parses in well under a second, into a few hundred MB of transient DOM
// (docs/base-cache.md, "Limits").
inline constexpr uint64_t kMaxTensors = 1ull << 18;  // 262144

// Polled every few thousand JSON events while a header is parsed; once it
// returns true the parse stops with an error ending in "parse cancelled". An
// empty function never cancels. Must not block.
using CancelCheck = std::function<bool()>;

struct SafetensorsTensor {
  std::string name;
  SafetensorsDType dtype = SafetensorsDType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // data_offsets, relative to the data area
  uint64_t end = 0;
  uint64_t numel() const;
  uint64_t bytes() const { return end - begin; }
};

struct SafetensorsHeader {
  uint64_t header_bytes = 0;  // N
  uint64_t data_start = 0;    // 8 + N: file offset of the data area
  uint64_t file_size = 0;
  uint64_t header_hash = 0;  // FNV-1a 64 of the N header bytes (part of a base's key)
  std::map<std::string, std::string> metadata;  // "__metadata__"
  std::vector<SafetensorsTensor> tensors;       // in data order (sorted by begin)
};

// Parses a header whose JSON is `json` (N bytes) for a file of `file_size` bytes.
// Returns OK, else INVALID_ARGUMENT with a message that starts with
// `file_label` (CANCELLED when `cancelled` said so). The same holds for the
// other calls below, a file that cannot be read included.
Status ParseSafetensorsJson(const std::string& file_label, std::string_view json,
                            uint64_t file_size, SafetensorsHeader* out,
                            const CancelCheck& cancelled = nullptr);

// Treats `data[0, size)` as a whole safetensors file (the fuzz target's entry).
Status ParseSafetensorsBuffer(const std::string& file_label, const uint8_t* data, uint64_t size,
                              SafetensorsHeader* out);

// Reads and parses the header of the open file `file` (reads at offsets).
// `file_label` is the path shown in errors.
Status ReadSafetensorsHeader(const platform::ReadOnlyFile& file, const std::string& file_label,
                             SafetensorsHeader* out, const CancelCheck& cancelled = nullptr);

// A parsed `model.safetensors.index.json`: tensor name -> shard file name (a
// plain file name in the same folder: no '/', not "." or ".."), at most
// kMaxTensors entries.
struct ShardIndex {
  std::map<std::string, std::string> weight_map;
  std::vector<std::string> shards;  // distinct file names, sorted
};

Status ParseShardIndex(const std::string& file_label, std::string_view json, ShardIndex* out);

}  // namespace trainstream::daemon::base
