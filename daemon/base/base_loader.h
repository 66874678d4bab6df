// BaseLoader: turns opened safetensors files into the layout of a base segment.
//
// PlanBase() reads and validates every header (safetensors.h), checks the shard
// index against the shards, decides which tensors are quantized, and lays out
// the segment (wire/base_manifest.h) so its size, and every tensor's final
// offset, is known before any memory is taken. FillBase() (base_fill.h) then
// reads the tensors into it on several threads.
//
// PlanBase can be cancelled: it polls its `cancelled` while it parses headers
// (every few thousand JSON events) and between files. A cancelled call returns
// CANCELLED with kLoadCancelled; the caller frees what it reserved for the
// segment (BaseCache::Load does).
//
// Which tensors are quantized (when a format is asked): the block-stack linear
// weights, i.e. 2-D F32/F16/BF16 tensors whose name ends in ".weight" and has a
// numeric component ("model.layers.7.mlp.up_proj.weight"). Embeddings, norms and
// the output layer keep their dtype.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/model_sources.h"
#include "base/safetensors.h"
#include "trainstream/kernels/quant.h"
#include "trainstream/status.h"

namespace trainstream::daemon::base {

struct PlannedTensor {
  size_t file = 0;  // index into ModelSources::files
  SafetensorsTensor src;
  bool quantized = false;
  kernels::QuantLayout layout;  // when quantized
  uint64_t offset = 0;          // raw bytes, or the quantized codes
  uint64_t bytes = 0;
  uint64_t scales_offset = 0;
  uint64_t tensor_scale_offset = 0;  // nvfp4 only
};

struct BasePlan {
  bool quantize = false;
  kernels::QuantFormat format = kernels::QuantFormat::kNf4;
  int64_t block_size = 0;
  std::string format_name;     // "none" or the kernel's name
  uint64_t identity_hash = 0;  // files' (dev, ino, size, mtime) and header hashes
  uint64_t source_bytes = 0;   // tensor bytes read from the checkpoint
  uint64_t manifest_offset = 0;
  uint64_t data_offset = 0;
  uint64_t total_bytes = 0;  // the segment's size, header included
  uint32_t quantized_tensors = 0;
  std::vector<PlannedTensor> tensors;  // file by file, in data order
};

struct LoadProgress {
  uint64_t bytes_read = 0;  // checkpoint bytes of the tensors' finished pieces
  uint64_t bytes_total = 0;
  uint32_t tensors_done = 0;
  uint32_t tensors_total = 0;
  uint32_t threads = 0;  // loader threads at work (0 before they start)
};

// The message of the CANCELLED status PlanBase and FillBase return when stopped.
inline constexpr const char* kLoadCancelled = "base load cancelled";

// Parses `format` ("", "none", "int8", "nf4", "fp8", "nvfp4") and `block_size`
// (0 takes 64); INVALID_ARGUMENT naming the field and the accepted values.
Status ParseBaseFormat(const std::string& format, int64_t block_size, BasePlan* plan);

// True when the loader would quantize this tensor (see the header comment).
bool IsBlockLinearWeight(const SafetensorsTensor& t);

// Fills `plan` (whose format ParseBaseFormat set) from the opened files.
// INVALID_ARGUMENT for a bad header or index, or more than kMaxTensors tensors
// in all the files together; CANCELLED once `cancelled` (may be empty) is true.
Status PlanBase(const ModelSources& sources, BasePlan* plan,
                const CancelCheck& cancelled = nullptr);

// The manifest JSON for `plan` (wire/base_manifest.h), `key` included.
std::string BaseManifestJson(const BasePlan& plan, const std::string& key);

// Writes the manifest of `plan` into `segment` (plan.total_bytes long, SegmentHeader
// already written) and points the SegmentHeader at it. INTERNAL if the manifest
// outgrew its planned space (a bug).
Status WriteBaseManifest(const BasePlan& plan, const std::string& key, char* segment);

}  // namespace trainstream::daemon::base
