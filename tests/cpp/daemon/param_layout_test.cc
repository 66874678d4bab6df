#include "sessions/param_layout.h"

#include <string>
#include <vector>

#include "catch_compat.h"
#include "trainstream/wire/grad_pool.h"
#include "trainstream/wire/segment_header.h"
#include "trainstream/wire/state_record.h"

using namespace trainstream::daemon;
namespace v1 = trainstream::v1;
namespace wire = trainstream::wire;

namespace {
v1::RegisterParametersRequest Request() {
  v1::RegisterParametersRequest r;
  auto* g = r.add_groups();
  g->set_lr(1e-3);
  g->set_beta1(0.9);
  g->set_beta2(0.999);
  g->set_eps(1e-8);
  auto* p = r.add_params();
  p->set_param_id(1);
  p->add_shape(3);
  p->add_shape(5);
  p->set_dtype(v1::DTYPE_BFLOAT16);
  p->set_grad_dtype(v1::DTYPE_FLOAT32);
  auto* q = r.add_params();
  q->set_param_id(2);
  q->add_shape(7);
  q->set_dtype(v1::DTYPE_FLOAT32);
  return r;
}
std::string Field(const trainstream::Status& s) {
  return s.message().substr(0, s.message().find(':'));
}
}  // namespace

TEST_CASE("Valid registrations pass; each bad field is named", "[params]") {
  CHECK(ValidateRegistration(Request(), {}).ok());
  auto r = Request();
  r.mutable_params(1)->set_shape(0, 0);
  CHECK(Field(ValidateRegistration(r, {})) == "params[1].shape[0]");
  r = Request();
  r.mutable_params(1)->set_param_id(1);
  CHECK(Field(ValidateRegistration(r, {})) == "params[1].param_id");
  CHECK(Field(ValidateRegistration(Request(), {2})) == "params[1].param_id");
  r = Request();
  r.mutable_params(0)->set_dtype(static_cast<v1::DType>(7));
  CHECK(Field(ValidateRegistration(r, {})) == "params[0].dtype");
  r = Request();
  r.mutable_params(0)->set_group(1);
  CHECK(Field(ValidateRegistration(r, {})) == "params[0].group");
  r = Request();
  r.mutable_groups(0)->set_beta2(1.0);
  CHECK(Field(ValidateRegistration(r, {})) == "groups[0].beta2");
  r = Request();
  r.mutable_groups(0)->set_lr(std::numeric_limits<double>::quiet_NaN());
  CHECK(Field(ValidateRegistration(r, {})) == "groups[0].lr");
  r = Request();
  r.set_max_grad_norm(-1);
  CHECK(Field(ValidateRegistration(r, {})) == "max_grad_norm");
  r = Request();
  for (int i = 0; i < 3; ++i) r.mutable_params(0)->add_shape(1 << 20);
  CHECK(Field(ValidateRegistration(r, {})) == "params[0].shape");
  for (auto code : {ValidateRegistration(r, {}).code()})
    CHECK(code == trainstream::StatusCode::kInvalidArgument);
}

TEST_CASE("Layout: aligned, disjoint slots; manifest then state tensors", "[params]") {
  auto r = Request();
  r.set_moment_dtype(v1::DTYPE_BFLOAT16);
  RegistrationLayout l = ComputeRegistrationLayout(r);
  REQUIRE(l.params.size() == 2);
  const auto& a = l.params[0];
  const auto& b = l.params[1];
  CHECK(a.numel == 15);
  CHECK(b.numel == 7);
  CHECK(a.grad_offset == 4096);
  CHECK(a.param_offset == 4096 + 64);  // 15 fp32 grads = 60 bytes, aligned up
  CHECK(b.grad_offset == 4096 + 128);  // 15 bf16 params = 30 bytes
  CHECK(b.param_offset == 4096 + 192);
  CHECK(l.staging_bytes == 8192);
  CHECK(l.manifest_offset == 4096);
  CHECK(l.manifest_bytes == 40 + 2 * 176);
  CHECK(l.recovery_offset == 0);  // no recovery records asked for
  // Note [One host copy of a trained weight]: a bf16 weight's master is its slot
  // plus 15 low halves (30 bytes) here; an fp32 weight's slot is its master.
  CHECK(a.master_layout == wire::MasterLayout::kSplitBf16);
  CHECK(a.master_offset == 8192);
  CHECK(a.exp_avg_offset == 8192 + 64);
  CHECK(a.exp_avg_sq_offset == 8192 + 128);
  CHECK(b.master_layout == wire::MasterLayout::kWeightSlot);
  CHECK(b.master_offset == 0);
  CHECK(b.exp_avg_offset == 8192 + 192);
  CHECK(b.exp_avg_sq_offset == 8192 + 256);
  CHECK(l.state_bytes % 4096 == 0);
  CHECK(b.exp_avg_sq_offset + 2 * 7 <= l.state_bytes);
}

TEST_CASE("State segment: a trained weight is held once", "[params]") {
  // 8 parameters of 2^20 elements, fp32 moments (8 B an element). The fp32 master
  // took 4 more bytes an element for every dtype before; now an fp32 weight's slot
  // is the master and a bf16 one is its high half (Note [One host copy of a trained
  // weight], trainstream/wire/segment_header.h).
  constexpr uint64_t kNumel = 1 << 20, kParams = 8;
  auto bytes_per_param = [&](v1::DType dtype) {
    v1::RegisterParametersRequest r = Request();
    r.clear_params();
    for (uint64_t i = 0; i < kParams; ++i) {
      auto* p = r.add_params();
      p->set_param_id(i + 1);
      p->add_shape(kNumel);
      p->set_dtype(dtype);
    }
    const RegistrationLayout l = ComputeRegistrationLayout(r);
    // The state arrays start on the page after the manifest (8192) and fill the rest.
    return static_cast<double>(l.state_bytes - 8192) / static_cast<double>(kParams * kNumel);
  };
  CHECK(bytes_per_param(v1::DTYPE_FLOAT32) == 8.0);    // was 12
  CHECK(bytes_per_param(v1::DTYPE_BFLOAT16) == 10.0);  // was 12
  CHECK(bytes_per_param(v1::DTYPE_FLOAT16) == 12.0);   // as before: a whole fp32 master
}

TEST_CASE("Group layout: a grad slot per rank, a sum slot, one param slot; same state",
          "[params][group]") {
  auto r = Request();
  const RegistrationLayout single = ComputeRegistrationLayout(r);
  const RegistrationLayout group = ComputeRegistrationLayout(r, 3, /*sum_slot=*/true);
  REQUIRE(group.params.size() == 2);
  const auto& a = group.params[0];
  const auto& b = group.params[1];
  CHECK(a.grad_offset == 4096);
  CHECK(a.grad_stride == 64);                  // 15 fp32 grads, aligned up
  CHECK(a.sum_offset == 4096 + 3 * 64);        // after local ranks 0..2
  CHECK(a.param_offset == a.sum_offset + 64);  // 15 fp32 sums
  CHECK(b.grad_offset == a.param_offset + 64);
  CHECK(b.sum_offset == b.grad_offset + 3 * 64);
  CHECK(b.param_offset == b.sum_offset + 64);
  CHECK(b.param_offset + 7 * 4 <= group.staging_bytes);
  // One optimizer state whatever the number of ranks.
  CHECK(group.state_bytes == single.state_bytes);
  CHECK(a.master_offset == single.params[0].master_offset);
  CHECK(single.params[0].sum_offset == 0);
}

TEST_CASE("Recovery layout: records, progress and journals between the manifest and the state",
          "[params][recovery]") {
  auto r = Request();
  r.mutable_params(0)->clear_shape();
  r.mutable_params(0)->add_shape(1000);  // 1000 elements: 4 chunks of 256
  RecoveryLayoutOptions rec;
  rec.enabled = true;
  rec.chunk_elems = 256;
  rec.journal_slots = 3;
  const RegistrationLayout l = ComputeRegistrationLayout(r, 1, false, rec);
  const RegistrationLayout plain = ComputeRegistrationLayout(r);
  CHECK(l.recovery_offset >= l.manifest_offset + l.manifest_bytes);
  CHECK(l.recovery_offset % 64 == 0);
  CHECK(l.records_offset >= l.recovery_offset + sizeof(wire::RecoveryHeader));
  CHECK(l.progress_offset >= l.records_offset + 2 * sizeof(wire::ParamRecord));
  CHECK(l.params[0].chunk_first == 0);
  CHECK(l.params[0].chunks == 4);
  CHECK(l.params[1].chunk_first == 4);
  CHECK(l.params[1].chunks == 1);
  CHECK(l.total_chunks == 5);
  CHECK(l.journal_offset >= l.progress_offset + 5 * sizeof(wire::ChunkProgress));
  CHECK(l.journal_slots == 3);
  CHECK(l.journal_slot_bytes == wire::JournalSlotLayoutFor(wire::kSubChunkElems, 4).bytes);
  CHECK(l.params[0].master_offset >= l.journal_offset + 3 * l.journal_slot_bytes);
  CHECK(l.params[0].master_offset % 4096 == 0);
  CHECK(l.state_bytes > plain.state_bytes);
  CHECK(l.staging_bytes == plain.staging_bytes);  // the records are the state's

  std::vector<char> state(l.state_bytes, 0);
  RecoveryOwner owner;
  owner.proof[0] = 0xab;
  owner.uid = 1234;
  owner.pid = 77;
  owner.start = 99;
  owner.registration = 2;
  owner.staging_name = "trainstream-x";
  owner.staging_bytes = l.staging_bytes;
  WriteStateManifest(state.data(), l, r, &owner);
  auto* m = reinterpret_cast<wire::StateManifest*>(state.data() + l.manifest_offset);
  CHECK(m->recovery_offset == l.recovery_offset);
  auto* h = reinterpret_cast<wire::RecoveryHeader*>(state.data() + l.recovery_offset);
  CHECK(h->magic == wire::kRecoveryMagic);
  CHECK(h->owner_proof[0] == 0xab);
  CHECK(h->owner_uid == 1234);
  CHECK(h->registration == 2);
  CHECK(h->chunk_elems == 256);
  CHECK(h->flags.load() == 0);  // not initialised yet: not adoptable
  CHECK(std::string(h->staging_name) == "trainstream-x");
  auto* records = reinterpret_cast<wire::ParamRecord*>(state.data() + h->records_offset);
  CHECK(records[1].chunk_first == 4);
  CHECK(records[1].grad_offset == l.params[1].grad_offset);
  CHECK(records[1].param_offset == l.params[1].param_offset);
  CHECK(records[1].mark.load() == 0);
}

TEST_CASE("A request's parameters may not add up past 2^40 elements", "[params]") {
  // 17 tensors of 2^36 elements each: every one is allowed, together they are not
  // (each offset of the layout must stay far from 2^64).
  v1::RegisterParametersRequest r = Request();
  r.clear_params();
  for (int i = 0; i < 17; ++i) {
    auto* p = r.add_params();
    p->set_param_id(static_cast<uint64_t>(i));
    p->add_shape(int64_t{1} << 36);
    p->set_dtype(v1::DTYPE_FLOAT32);
  }
  const trainstream::Status st = ValidateRegistration(r, {});
  CHECK(Field(st) == "params");
  CHECK(st.message().find("params[16]") != std::string::npos);
  r.mutable_params()->RemoveLast();  // 16 * 2^36 = 2^40: at the cap
  CHECK(ValidateRegistration(r, {}).ok());
}

TEST_CASE("Pooled layout: header, pool, then only param slots; refused with clipping", "[params]") {
  v1::RegisterParametersRequest req = Request();
  req.set_grad_pool_bytes(100);  // below the largest gradient (15 fp32 = 60 -> 64 B): a page
  REQUIRE(ValidateRegistration(req, {}).ok());
  RecoveryLayoutOptions rec{true, 64, 2};
  const RegistrationLayout l = ComputeRegistrationLayout(req, 1, false, rec);
  CHECK(l.grad_pool_offset == wire::kGradPoolOffset);
  CHECK(l.grad_pool_bytes == 4096);
  for (const ParamPlacement& pl : l.params) {
    CHECK(pl.grad_offset == 0);
    CHECK(pl.param_offset >= l.grad_pool_offset + l.grad_pool_bytes);
  }
  CHECK(l.params[1].param_offset >= l.params[0].param_offset + 15 * 2);
  // A group's staging ignores the request's pool (its daemon answers slots).
  const RegistrationLayout g = ComputeRegistrationLayout(req, 2, true, rec);
  CHECK(g.grad_pool_bytes == 0);
  CHECK(g.params[0].grad_offset >= wire::kSegmentHeaderBytes);

  std::vector<char> state(l.state_bytes);
  RecoveryOwner owner;
  owner.staging_name = "trainstream-test";
  owner.staging_bytes = l.staging_bytes;
  WriteStateManifest(state.data(), l, req, &owner);
  const auto* rh = reinterpret_cast<const wire::RecoveryHeader*>(state.data() + l.recovery_offset);
  CHECK(rh->version == wire::kRecoveryVersionPooled);
  CHECK(rh->grad_pool_offset == wire::kGradPoolOffset);
  CHECK(rh->grad_pool_bytes == 4096);
  const auto* r = reinterpret_cast<const wire::ParamRecord*>(state.data() + l.records_offset);
  CHECK(r[0].grad_offset == wire::kGradPoolOffset);
  CHECK(r[1].rank_grad_offset == wire::kGradPoolOffset);

  req.set_max_grad_norm(1.0);
  CHECK(Field(ValidateRegistration(req, {})) == "grad_pool_bytes");
  req.set_max_grad_norm(0);
  req.set_grad_pool_bytes(kMaxGradPoolBytes + 1);
  CHECK(Field(ValidateRegistration(req, {})) == "grad_pool_bytes");
}
