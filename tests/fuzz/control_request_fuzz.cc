// libFuzzer target for the daemon's validation of control-plane requests: the
// pure functions a request goes through before the daemon acts on it. No server
// runs; protobuf's own parser only turns the bytes into a message.
//
// Input: one selector byte, then a serialized trainstream.v1 message.
//   selector % 3 == 0  RegisterParametersRequest: ValidateRegistration, and for
//                      a valid one ComputeRegistrationLayout (selector / 3 % 64
//                      + 1 gradient slots, and a sum slot when more than one,
//                      as a data-parallel group lays it out) and
//                      WriteStateManifest
//                   1  AttachRequest: GroupRegistry::Validate of its group
//                   2  LoadBaseRequest: ParseBaseFormat, then the quantized
//                      layout of a tensor of session_id % 2^40 + 1 elements,
//                      and IsBlockLinearWeight of a tensor named by its path
// (AllocateRegion's and Attach's other checks are inline in the registry, not
// pure functions.) A valid registration must lay every slot inside its
// segment, 64-byte aligned and without overlap; a broken invariant abort()s.
// Seeds: make_control_request_seeds.py. Run: scripts/fuzz.sh control_request.
#include <google/protobuf/stubs/logging.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "base/base_loader.h"
#include "sessions/group_registry.h"
#include "sessions/param_layout.h"
#include "trainstream/v1/control.pb.h"
#include "trainstream/wire/segment_header.h"

namespace {

using namespace trainstream;
using namespace trainstream::daemon;

void Check(bool ok) {
  if (!ok) std::abort();
}

// [begin, begin + bytes) must start at or after `floor`, 64-byte aligned, and
// end by `limit`, all without wrapping. Returns the end.
unsigned __int128 Slot(uint64_t begin, unsigned __int128 bytes, unsigned __int128 floor,
                       uint64_t limit) {
  Check(begin % 64 == 0);
  Check(begin >= floor);
  const unsigned __int128 end = static_cast<unsigned __int128>(begin) + bytes;
  Check(end <= limit);
  return end;
}

void RegisterParameters(uint8_t selector, const std::string& bytes) {
  v1::RegisterParametersRequest req;
  if (!req.ParseFromString(bytes)) return;
  const trainstream::Status st = ValidateRegistration(req, {});
  if (!st.ok()) {
    Check(st.code() == trainstream::StatusCode::kInvalidArgument && !st.message().empty());
    return;
  }
  // Valid once; not again in a session that already holds its first id.
  Check(req.params_size() > 0 && req.groups_size() > 0);
  Check(!ValidateRegistration(req, {req.params(0).param_id()}).ok());

  const uint32_t grad_slots = selector / 3 % kMaxLocalWorldSize + 1;
  const bool sum_slot = grad_slots > 1;
  const RegistrationLayout layout = ComputeRegistrationLayout(req, grad_slots, sum_slot);
  Check(layout.params.size() == static_cast<size_t>(req.params_size()));
  Check(layout.staging_bytes % 4096 == 0 && layout.state_bytes % 4096 == 0);
  const size_t moment = req.moment_dtype() == v1::DTYPE_BFLOAT16 ? 2 : 4;
  unsigned __int128 staging = wire::kSegmentHeaderBytes;
  unsigned __int128 state = layout.manifest_offset + layout.manifest_bytes;
  for (int i = 0; i < req.params_size(); ++i) {
    const v1::ParameterSpec& p = req.params(i);
    const ParamPlacement& pl = layout.params[static_cast<size_t>(i)];
    unsigned __int128 numel = 1;
    for (int64_t d : p.shape()) numel *= static_cast<uint64_t>(d);
    Check(numel == pl.numel);
    const size_t grad =
        DTypeBytes(p.grad_dtype() != v1::DTYPE_UNSPECIFIED ? p.grad_dtype() : p.dtype());
    Check(pl.grad_stride >= numel * grad);
    staging = Slot(pl.grad_offset,
                   (grad_slots - 1) * static_cast<unsigned __int128>(pl.grad_stride) + numel * grad,
                   staging, layout.staging_bytes);
    if (sum_slot) staging = Slot(pl.sum_offset, numel * 4, staging, layout.staging_bytes);
    staging = Slot(pl.param_offset, numel * DTypeBytes(p.dtype()), staging, layout.staging_bytes);
    // Note [One host copy of a trained weight]: none for fp32 weights (the weight
    // slot is the master), the low halves for bf16, a whole fp32 master for fp16.
    Check(pl.master_layout == wire::MasterLayoutFor(static_cast<wire::DType>(p.dtype())));
    if (const uint64_t master = wire::MasterStateBytes(pl.master_layout); master != 0) {
      state = Slot(pl.master_offset, numel * master, state, layout.state_bytes);
    } else {
      Check(pl.master_offset == 0);
    }
    state = Slot(pl.exp_avg_offset, numel * moment, state, layout.state_bytes);
    state = Slot(pl.exp_avg_sq_offset, numel * moment, state, layout.state_bytes);
  }
  // The manifest is written into the state segment's first pages: do that for
  // real when it is small, into memory of exactly that size.
  const uint64_t manifest_end = layout.manifest_offset + layout.manifest_bytes;
  if (manifest_end > (1u << 20)) return;
  std::vector<uint64_t> memory((manifest_end + 7) / 8);
  auto* base = reinterpret_cast<char*>(memory.data());
  const wire::StateManifestEntry* entries = WriteStateManifest(base, layout, req);
  for (int i = 0; i < req.params_size(); ++i) {
    Check(entries[i].param_id == req.params(i).param_id());
    Check(entries[i].name[sizeof(entries[i].name) - 1] == '\0');
  }
}

void Attach(const std::string& bytes) {
  v1::AttachRequest req;
  if (!req.ParseFromString(bytes) || !req.has_group()) return;
  const v1::GroupMembership& m = req.group();
  if (!GroupRegistry::Validate(m).ok()) return;
  Check(!m.key().empty() && m.key().size() <= kMaxGroupKeyBytes);
  Check(m.local_world_size() >= 1 && m.local_world_size() <= kMaxLocalWorldSize);
  Check(m.local_rank() >= 0 && m.local_rank() < m.local_world_size());
  Check(m.node_rank() >= 0 && m.node_rank() < m.nnodes());
}

void LoadBase(const std::string& bytes) {
  v1::LoadBaseRequest req;
  if (!req.ParseFromString(bytes)) return;
  base::BasePlan plan;
  const trainstream::Status st = base::ParseBaseFormat(req.format(), req.block_size(), &plan);
  if (!st.ok()) {
    Check(st.code() == trainstream::StatusCode::kInvalidArgument);
    return;
  }
  base::SafetensorsTensor t;
  t.name = req.path();
  t.dtype = base::SafetensorsDType::kBF16;
  t.shape = {2, 3};
  base::IsBlockLinearWeight(t);
  if (!plan.quantize) {
    Check(plan.format_name == "none" && plan.block_size == 0);
    return;
  }
  Check(plan.block_size >= 2 && plan.block_size % 2 == 0);
  const int64_t numel = static_cast<int64_t>(req.session_id() % (1ull << 40)) + 1;
  const kernels::QuantLayout l = kernels::MakeQuantLayout(plan.format, numel, plan.block_size);
  Check(l.block_size == plan.block_size);
  Check(l.padded_numel >= numel && l.padded_numel - numel < l.block_size);
  Check(l.num_blocks * l.block_size == l.padded_numel);
  Check(l.data_bytes >= numel / 2 && l.scale_bytes() > 0);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // protobuf logs every string field that is not UTF-8 before refusing the
  // message; here that is the common case, not news.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 3) {
    case 0:
      RegisterParameters(data[0], bytes);
      break;
    case 1:
      Attach(bytes);
      break;
    default:
      LoadBase(bytes);
      break;
  }
  return 0;
}
