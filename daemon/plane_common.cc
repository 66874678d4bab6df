#include "plane_common.h"

#include <cstring>
#include <vector>

namespace trainstream::daemon {

using wire::Opcode;
using wire::StateField;

kernels::DType ToKernelDType(WireDType d) {
  switch (d) {
    case WireDType::kBFloat16:
      return kernels::DType::kBFloat16;
    case WireDType::kFloat16:
      return kernels::DType::kFloat16;
    case WireDType::kFloat32:
      break;
  }
  return kernels::DType::kFloat32;
}

void SetCompletionMessage(wire::CompletionRecord* rec, const std::string& message) {
  std::strncpy(rec->message, message.c_str(), sizeof(rec->message) - 1);
  rec->message[sizeof(rec->message) - 1] = '\0';
}

std::string MoveOptimizerState(optimizer::AdamWEngine& engine, const wire::CommandRecord& cmd,
                               const RegionResolver& resolver, uint64_t* step_out, bool* imported,
                               uint64_t* imported_step) {
  const bool load = cmd.opcode == Opcode::kLoadState;
  const size_t n = engine.ParamNumel(cmd.param_id);
  if (n == 0) return "unknown param_id " + std::to_string(cmd.param_id);
  std::vector<float> master(n), m(n), v(n);
  uint64_t step = 0;
  std::string err = engine.ExportState(cmd.param_id, master.data(), m.data(), v.data(), &step);
  if (!err.empty()) return err;
  if (cmd.field == StateField::kStep) {
    if (!load) {
      *step_out = step;
      return "";
    }
    step = cmd.step;
  } else {
    std::vector<float>* target = cmd.field == StateField::kMaster     ? &master
                                 : cmd.field == StateField::kExpAvg   ? &m
                                 : cmd.field == StateField::kExpAvgSq ? &v
                                                                      : nullptr;
    if (target == nullptr)
      return "unknown state field " + std::to_string(static_cast<uint32_t>(cmd.field));
    if (cmd.bytes != n * sizeof(float)) {
      return "state payload is " + std::to_string(cmd.bytes) + " bytes; param " +
             std::to_string(cmd.param_id) + " needs " + std::to_string(n * sizeof(float));
    }
    void* payload = resolver(cmd.region_id, cmd.region_offset, cmd.bytes);
    if (payload == nullptr) {
      return "region " + std::to_string(cmd.region_id) + " [" + std::to_string(cmd.region_offset) +
             ", +" + std::to_string(cmd.bytes) + ") is not a region of this session";
    }
    if (!load) {
      std::memcpy(payload, target->data(), cmd.bytes);
      return "";
    }
    std::memcpy(target->data(), payload, cmd.bytes);
  }
  err = engine.ImportState(cmd.param_id, master.data(), m.data(), v.data(), step);
  if (err.empty()) {
    *imported = true;
    *imported_step = step;
  }
  return err;
}

}  // namespace trainstream::daemon
