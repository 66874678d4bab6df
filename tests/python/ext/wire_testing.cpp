// trainstream_testing.wire: the shared-memory wire constants as the C++ headers
// define them (proto/include/trainstream/wire/), for the tests only. The Python
// package keeps its own copy in trainstream/_native/wire.py, so neither
// `import trainstream` nor the shipped trainstream._C needs these;
// tests/python/test_wire_constants.py pins every value of that copy to them.
#include <torch/extension.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include "trainstream/wire/base_manifest.h"
#include "trainstream/wire/dtype.h"
#include "trainstream/wire/grad_pool.h"
#include "trainstream/wire/segment_header.h"
#include "trainstream/wire/session_control.h"

namespace trainstream::python {

void RegisterWireBindings(pybind11::module_& m) {
  using wire::CompletionStatus;
  using wire::DType;
  using wire::Opcode;
  using wire::StateField;
  auto w = m.def_submodule("wire", "shared-memory wire constants (proto/include/trainstream/wire)");
  auto u = [](auto v) { return static_cast<uint64_t>(v); };
  const std::pair<const char*, uint64_t> constants[] = {
      {"OP_GRAD_READY", u(Opcode::kGradReady)},
      {"OP_STEP_END", u(Opcode::kStepEnd)},
      {"OP_LOAD_STATE", u(Opcode::kLoadState)},
      {"OP_EXPORT_STATE", u(Opcode::kExportState)},
      {"OP_SYNC", u(Opcode::kSync)},
      {"OP_GRAD_REDUCED", u(Opcode::kGradReduced)},
      {"OP_PARAM_READY", u(Opcode::kParamReady)},
      {"OP_STEP_DONE", u(Opcode::kStepDone)},
      {"OP_STATE_DONE", u(Opcode::kStateDone)},
      {"OP_SYNC_DONE", u(Opcode::kSyncDone)},
      {"OP_ERROR", u(Opcode::kError)},
      {"OP_REDUCE_READY", u(Opcode::kReduceReady)},
      {"OP_GROUP_BROKEN", u(Opcode::kGroupBroken)},
      {"STATUS_OK", u(CompletionStatus::kOk)},
      {"STATUS_SKIPPED_NONFINITE", u(CompletionStatus::kSkippedNonFinite)},
      {"STATUS_INVALID", u(CompletionStatus::kInvalid)},
      {"STATUS_INTERNAL", u(CompletionStatus::kInternal)},
      {"FIELD_MASTER", u(StateField::kMaster)},
      {"FIELD_EXP_AVG", u(StateField::kExpAvg)},
      {"FIELD_EXP_AVG_SQ", u(StateField::kExpAvgSq)},
      {"FIELD_STEP", u(StateField::kStep)},
      {"FIELD_PARAM_FROM_SLOT", u(StateField::kParamFromSlot)},
      {"FIELD_WEIGHTS", u(StateField::kWeights)},
      {"DTYPE_FLOAT32", u(DType::kFloat32)},
      {"DTYPE_BFLOAT16", u(DType::kBFloat16)},
      {"DTYPE_FLOAT16", u(DType::kFloat16)},
      {"SEGMENT_MAGIC", u(wire::kSegmentMagic)},
      {"SEGMENT_HEADER_BYTES", u(wire::kSegmentHeaderBytes)},
      {"SEGMENT_MANIFEST_OFFSET_FIELD", u(offsetof(wire::SegmentHeader, manifest_offset))},
      {"MASTER_STATE_BYTES_FLOAT32",
       u(wire::MasterStateBytes(wire::MasterLayoutFor(DType::kFloat32)))},
      {"MASTER_STATE_BYTES_BFLOAT16",
       u(wire::MasterStateBytes(wire::MasterLayoutFor(DType::kBFloat16)))},
      {"MASTER_STATE_BYTES_FLOAT16",
       u(wire::MasterStateBytes(wire::MasterLayoutFor(DType::kFloat16)))},
      {"BASE_MANIFEST_MAGIC", u(wire::kBaseManifestMagic)},
      {"BASE_MANIFEST_HEADER_BYTES", u(sizeof(wire::BaseManifestHeader))},
      {"GRAD_POOL_MAGIC", u(wire::kGradPoolMagic)},
      {"GRAD_POOL_HEADER_OFFSET", u(wire::kGradPoolHeaderOffset)},
      {"GRAD_POOL_OFFSET", u(wire::kGradPoolOffset)},
      {"GRAD_POOL_ALIGN", u(wire::kPoolAlign)},
      {"GRAD_POOL_CAPACITY_FIELD", u(offsetof(wire::GradPoolHeader, capacity))},
      {"GRAD_POOL_RELEASED_FIELD", u(offsetof(wire::GradPoolHeader, released))},
      {"GRAD_POOL_RELEASE_SEQ_FIELD", u(offsetof(wire::GradPoolHeader, release_seq))},
      {"GRAD_POOL_WAITERS_FIELD", u(offsetof(wire::GradPoolHeader, waiters))},
      {"FLAG_POOLED_GRAD", u(wire::kFlagPooledGrad)},
  };
  for (const auto& [name, value] : constants) w.attr(name) = value;
}

}  // namespace trainstream::python
