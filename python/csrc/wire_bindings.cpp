// trainstream._C.wire: the shared-memory wire constants as the C++ headers define
// them (proto/include/trainstream/wire/). The Python package keeps its own copy
// in trainstream/_wire.py, so `import trainstream` need not load this extension;
// tests/python/test_wire_constants.py pins every value of that copy to these.
#include <torch/extension.h>

#include <cstddef>

#include "trainstream/wire/base_manifest.h"
#include "trainstream/wire/segment_header.h"
#include "trainstream/wire/session_control.h"

namespace trainstream::python {

void RegisterWireBindings(pybind11::module_& m) {
  using wire::CompletionStatus;
  using wire::Opcode;
  using wire::StateField;
  auto w = m.def_submodule("wire", "shared-memory wire constants (proto/include/trainstream/wire)");
  auto u = [](auto v) { return static_cast<uint64_t>(v); };
  const std::pair<const char*, Opcode> opcodes[] = {
      {"OP_GRAD_READY", Opcode::kGradReady},
      {"OP_STEP_END", Opcode::kStepEnd},
      {"OP_LOAD_STATE", Opcode::kLoadState},
      {"OP_EXPORT_STATE", Opcode::kExportState},
      {"OP_SYNC", Opcode::kSync},
      {"OP_GRAD_REDUCED", Opcode::kGradReduced},
      {"OP_PARAM_READY", Opcode::kParamReady},
      {"OP_STEP_DONE", Opcode::kStepDone},
      {"OP_STATE_DONE", Opcode::kStateDone},
      {"OP_SYNC_DONE", Opcode::kSyncDone},
      {"OP_ERROR", Opcode::kError},
      {"OP_REDUCE_READY", Opcode::kReduceReady},
      {"OP_GROUP_BROKEN", Opcode::kGroupBroken},
  };
  for (const auto& [name, v] : opcodes) w.attr(name) = u(v);
  const std::pair<const char*, CompletionStatus> statuses[] = {
      {"STATUS_OK", CompletionStatus::kOk},
      {"STATUS_SKIPPED_NONFINITE", CompletionStatus::kSkippedNonFinite},
      {"STATUS_INVALID", CompletionStatus::kInvalid},
      {"STATUS_INTERNAL", CompletionStatus::kInternal},
  };
  for (const auto& [name, v] : statuses) w.attr(name) = u(v);
  const std::pair<const char*, StateField> fields[] = {
      {"FIELD_MASTER", StateField::kMaster},
      {"FIELD_EXP_AVG", StateField::kExpAvg},
      {"FIELD_EXP_AVG_SQ", StateField::kExpAvgSq},
      {"FIELD_STEP", StateField::kStep},
      {"FIELD_PARAM_FROM_SLOT", StateField::kParamFromSlot},
  };
  for (const auto& [name, v] : fields) w.attr(name) = u(v);
  w.attr("SEGMENT_MAGIC") = u(wire::kSegmentMagic);
  w.attr("SEGMENT_HEADER_BYTES") = u(wire::kSegmentHeaderBytes);
  w.attr("SEGMENT_MANIFEST_OFFSET_FIELD") = u(offsetof(wire::SegmentHeader, manifest_offset));
  w.attr("BASE_MANIFEST_MAGIC") = u(wire::kBaseManifestMagic);
  w.attr("BASE_MANIFEST_HEADER_BYTES") = u(sizeof(wire::BaseManifestHeader));
}

}  // namespace trainstream::python
