// The human-readable `trainstreamctl status` view of the status JSON document.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace trainstream::ctl {

std::string RenderStatusTable(const nlohmann::json& status);

}  // namespace trainstream::ctl
