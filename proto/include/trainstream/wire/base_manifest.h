// The manifest of a base segment (kind SEGMENT_KIND_BASE): what a client reads
// to build tensors that are views of a frozen base (docs/base-cache.md).
//
// SegmentHeader.manifest_offset points at a BaseManifestHeader; `json_bytes` of
// UTF-8 JSON follow it directly. The JSON is read once per attach (never per
// step), so it favours being easy to evolve over being compact:
//
//   {"schema": 1, "key": "...", "format": "nf4" | "none", "block_size": 64,
//    "tensors": [
//      {"name": "model.layers.0.mlp.up_proj.weight", "dtype": "BF16",
//       "shape": [13824, 5120],
//       // unquantized: the raw little-endian bytes of the checkpoint
//       "offset": 8192, "bytes": 141557760,
//       // quantized (block-stack linear weights, when a format was asked):
//       "quant": {"format": "nf4", "block_size": 64, "padding": 0,
//                 "data_offset": ..., "data_bytes": ...,
//                 "scales_offset": ..., "scales_bytes": ..., "scale_dtype": "F32" | "U8",
//                 "tensor_scale_offset": ... /* nvfp4 only: one fp32 */}}, ...]}
//
// Every offset counts from the start of the segment and is 64-byte aligned; the
// codes and scales are exactly what trainstream.quantization.quantize_tensor
// produces for the same tensor. For a quantized tensor "offset"/"bytes" equal
// "data_offset"/"data_bytes".
//
// Note [Why base segments are read-only]: one base is shared by every session of
// its owner (and stays cached after they end), so a stray write by one process
// would silently corrupt every other process's weights. The daemon therefore
// makes the file read-only once it is filled (root's, readable by the owner
// through an ACL, when the daemon runs as root: Note [Who may open a segment] in
// daemon/memory/shm_segment.h), and clients map it PROT_READ (and register it with
// cudaHostRegisterReadOnly).
#pragma once

#include <cstdint>

namespace trainstream::wire {

inline constexpr uint32_t kBaseManifestMagic = 0x54534246;  // "TSBF"
inline constexpr uint32_t kBaseManifestVersion = 1;
inline constexpr uint64_t kBaseTensorAlign = 64;

struct BaseManifestHeader {
  uint32_t magic;    // kBaseManifestMagic
  uint32_t version;  // kBaseManifestVersion
  uint64_t json_bytes;
  uint64_t data_bytes;  // bytes of tensor data after the manifest (page aligned start)
  uint64_t reserved[5];
};
static_assert(sizeof(BaseManifestHeader) == 64, "wire format");

}  // namespace trainstream::wire
