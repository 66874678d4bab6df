// Command-line helpers shared by the AdamW benchmarks.
#pragma once

#include <sstream>
#include <string>
#include <vector>

namespace trainstream::bench {

// "a,b,c" -> {"a", "b", "c"}.
inline std::vector<std::string> SplitCommas(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) out.push_back(item);
  return out;
}

}  // namespace trainstream::bench
