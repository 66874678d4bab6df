// The binding of one fp32 parameter "w" (id 0) over arrays a test owns: master,
// moments, weight slot and torch step. Each optimizer test adds where its gradient
// comes from (a slot, rank slots and a sum, or a gradient pool). AdamWCommand is the
// command record these tests post, with the AdamW hyperparameters they all use.
#pragma once

#include <cstdint>
#include <vector>

#include "planes/optimizer_plane.h"
#include "trainstream/wire/session_control.h"

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

inline wire::CommandRecord AdamWCommand(wire::Opcode op, uint64_t step, double lr = 0.1) {
  wire::CommandRecord c{};
  c.opcode = op;
  c.step = step;
  c.lr = lr;
  c.beta1 = 0.9;
  c.beta2 = 0.999;
  c.eps = 1e-8;
  return c;
}

}  // namespace trainstream::daemon::testing
