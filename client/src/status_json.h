// StatusResponse -> the JSON document of `trainstreamctl status --json`
// (docs/status-json.md). Internal.
#pragma once

#include <string>

#include "trainstream/v1/control.pb.h"

namespace trainstream::internal {

std::string StatusToJson(const v1::StatusResponse& status, int indent);

}  // namespace trainstream::internal
