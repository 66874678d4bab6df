// The binding of one fp32 parameter "w" (id 0) over arrays a test owns: master,
// moments, weight slot and torch step. Each optimizer test adds where its gradient
// comes from (a slot, rank slots and a sum, or a gradient pool).
#pragma once

#include <cstdint>
#include <vector>

#include "planes/optimizer_plane.h"

namespace trainstream::daemon::testing {

inline ParamBinding Fp32Binding(std::vector<float>& master, std::vector<float>& m,
                                std::vector<float>& v, std::vector<float>& param_slot,
                                uint64_t* torch_step) {
  ParamBinding b;
  b.param_id = 0;
  b.name = "w";
  b.numel = master.size();
  b.master = master.data();
  b.exp_avg = m.data();
  b.exp_avg_sq = v.data();
  b.param_slot = param_slot.data();
  b.durable.torch_step = torch_step;
  return b;
}

}  // namespace trainstream::daemon::testing
