#include "planes/plane_common.h"

#include <cstring>
#include <vector>

namespace trainstream::daemon {

using wire::Opcode;
using wire::StateField;

void SetCompletionMessage(wire::CompletionRecord* rec, const std::string& message) {
  std::strncpy(rec->message, message.c_str(), sizeof(rec->message) - 1);
  rec->message[sizeof(rec->message) - 1] = '\0';
}

Status MoveOptimizerState(optimizer::AdamWEngine& engine, const wire::CommandRecord& cmd,
                          const RegionResolver& resolver, uint64_t* step_out, bool* imported,
                          uint64_t* imported_step) {
  const bool load = cmd.opcode == Opcode::kLoadState;
  const size_t n = engine.ParamNumel(cmd.param_id);
  if (n == 0)
    return Status(StatusCode::kNotFound, "unknown param_id " + std::to_string(cmd.param_id));
  if (cmd.field == StateField::kStep) {
    if (!load) return engine.GetStep(cmd.param_id, step_out);
    Status st = engine.SetStep(cmd.param_id, cmd.step);
    if (st.ok()) {
      *imported = true;
      *imported_step = cmd.step;
    }
    return st;
  }
  using Array = optimizer::AdamWEngine::StateArray;
  Array which;
  switch (cmd.field) {
    case StateField::kMaster:
      which = Array::kMaster;
      break;
    case StateField::kExpAvg:
      which = Array::kExpAvg;
      break;
    case StateField::kExpAvgSq:
      which = Array::kExpAvgSq;
      break;
    default:
      return Status(StatusCode::kInvalidArgument,
                    "unknown state field " + std::to_string(static_cast<uint32_t>(cmd.field)) +
                        "; accepted: 0 (master), 1 (exp_avg), 2 (exp_avg_sq), 3 (step), 4 (param "
                        "from slot)");
  }
  if (cmd.bytes != n * sizeof(float)) {
    return Status(StatusCode::kInvalidArgument,
                  "state payload is " + std::to_string(cmd.bytes) + " bytes; param " +
                      std::to_string(cmd.param_id) + " needs " + std::to_string(n * sizeof(float)));
  }
  void* payload = resolver(cmd.region_id, cmd.region_offset, cmd.bytes);
  if (payload == nullptr) {
    return Status(StatusCode::kInvalidArgument, "region " + std::to_string(cmd.region_id) + " [" +
                                                    std::to_string(cmd.region_offset) + ", +" +
                                                    std::to_string(cmd.bytes) +
                                                    ") is not a region of this session");
  }
  // One field moves straight between the payload and the engine (no copies of
  // the other two). Offsets are the client's; keep float access aligned.
  if (reinterpret_cast<uintptr_t>(payload) % alignof(float) != 0)
    return Status(
        StatusCode::kInvalidArgument,
        "state payload offset " + std::to_string(cmd.region_offset) + " is not a multiple of 4");
  return load ? engine.ImportArray(cmd.param_id, which, static_cast<const float*>(payload))
              : engine.ExportArray(cmd.param_id, which, static_cast<float*>(payload));
}

}  // namespace trainstream::daemon
