#include "recovery/adoption.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>

#include "memory/budget.h"
#include "security/token.h"
#include "trainstream/human_bytes.h"
#include "trainstream/platform/files.h"
#include "trainstream/platform/user.h"
#include "trainstream/wire/segment_header.h"

namespace trainstream::daemon {
namespace {

// The header of a regular file, read without mapping it (or following a link).
bool PeekHeader(const std::string& path, wire::SegmentHeader* h) {
  std::string head;
  if (platform::ReadFilePrefix(path, sizeof(*h), &head) != 0 || head.size() != sizeof(*h)) {
    return false;
  }
  std::memcpy(h, head.data(), sizeof(*h));
  return h->magic == wire::kSegmentMagic;
}

bool SameProof(const OwnerProof& a, const uint8_t* b) {
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

uint64_t AdoptedState::bytes() const {
  uint64_t total = 0;
  for (const auto& r : registrations) {
    if (r.state) total += r.state->size();
    if (r.staging) total += r.staging->size();
  }
  return total;
}

AdoptionStore::AdoptionStore(AdoptionHooks hooks, bool lock_memory, uint64_t grace_s)
    : hooks_(std::move(hooks)), lock_memory_(lock_memory), grace_s_(grace_s) {}

AdoptionStore::~AdoptionStore() {
  std::vector<std::unique_ptr<AdoptedState>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    all.swap(states_);
  }
  for (auto& s : all) DropSegments(*s);
}

void AdoptionStore::DropSegments(AdoptedState& s) {
  for (auto& r : s.registrations) {
    r.view = StateSegmentView();
    if (r.staging) hooks_.drop(std::move(r.staging));
    if (r.state) hooks_.drop(std::move(r.state));
  }
  s.registrations.clear();
}

AdoptionStore::Scan AdoptionStore::AdoptFrom(const std::string& dir, const std::string& tag) {
  Scan scan;
  const std::string prefix = "trainstream-" + tag + "-";
  std::vector<std::pair<std::string, uint64_t>> candidates;  // state segments: name, size
  std::vector<platform::DirectoryEntry> entries;
  platform::ListDirectory(dir, &entries);  // none to adopt when it cannot be listed
  for (const auto& e : entries) {
    if (e.kind != platform::FileKind::kRegular) continue;
    if (e.name.compare(0, prefix.size(), prefix) != 0) continue;
    wire::SegmentHeader h{};
    if (PeekHeader(dir + "/" + e.name, &h) && h.kind == v1::SEGMENT_KIND_STATE)
      candidates.emplace_back(e.name, e.size);
  }
  // (proof bytes) -> the state being gathered
  std::map<std::string, std::unique_ptr<AdoptedState>> by_owner;
  const auto now = std::chrono::steady_clock::now();
  for (const auto& [name, bytes] : candidates) {
    auto note = [&, n = name](const std::string& why) { scan.notes.push_back(n + ": " + why); };
    if (Status st = hooks_.reserve(bytes, "adopted optimizer state " + name); !st.ok()) {
      note(st.message());
      continue;
    }
    std::unique_ptr<ShmSegment> state;
    if (Status st = ShmSegment::Adopt(dir, name, v1::SEGMENT_KIND_STATE, platform::CurrentUserId(),
                                      bytes, lock_memory_, &state);
        !st.ok()) {
      hooks_.release(bytes);
      note(st.message());
      continue;
    }
    hooks_.held(*state);
    AdoptedRegistration reg;
    if (Status st = CheckStateSegment(state->base(), state->size(), &reg.view); !st.ok()) {
      note(st.message());
      hooks_.drop(std::move(state));
      continue;
    }
    const StateSegmentView& v = reg.view;
    if (!ProcessAlive(v.owner_pid, v.owner_start)) {
      note("its client (pid " + std::to_string(v.owner_pid) + ") is gone too");
      reg.view = StateSegmentView();
      hooks_.drop(std::move(state));
      continue;
    }
    // A root daemon chowned the staging segment to a client of another uid.
    const platform::UserId staging_uid = platform::RunsPrivileged() && v.owner_uid != 0
                                             ? static_cast<platform::UserId>(v.owner_uid)
                                             : platform::CurrentUserId();
    if (hooks_.reserve(v.staging_bytes, "adopted staging " + v.staging_name).ok()) {
      Status st = ShmSegment::Adopt(dir, v.staging_name, v1::SEGMENT_KIND_SESSION, staging_uid,
                                    v.staging_bytes, lock_memory_, &reg.staging);
      if (st.ok()) {
        hooks_.held(*reg.staging);
      } else {
        hooks_.release(v.staging_bytes);
        note(st.message());
      }
    } else {
      note("its staging segment " + v.staging_name + " does not fit the budget");
    }
    const std::string key(reinterpret_cast<const char*>(v.owner_proof), sizeof(v.owner_proof));
    std::unique_ptr<AdoptedState>& s = by_owner[key];
    if (!s) {
      s = std::make_unique<AdoptedState>();
      std::memcpy(s->proof.data(), v.owner_proof, s->proof.size());
      s->uid = static_cast<platform::UserId>(v.owner_uid);
      s->pid = v.owner_pid;
      s->start = v.owner_start;
      s->job = reinterpret_cast<const wire::SegmentHeader*>(state->base())->job;
      s->job.resize(strnlen(s->job.c_str(), sizeof(wire::SegmentHeader::job)));
      s->adopted = now;
      s->deadline = now + std::chrono::seconds(grace_s_);
    }
    reg.state = std::move(state);
    s->registrations.push_back(std::move(reg));
  }

  for (auto& [key, s] : by_owner) {
    std::sort(s->registrations.begin(), s->registrations.end(),
              [](const AdoptedRegistration& a, const AdoptedRegistration& b) {
                return a.view.registration < b.view.registration;
              });
    // The most advanced step record: a clipping decision is written to every
    // segment of the session in turn, so one may hold it and another not yet.
    for (const auto& r : s->registrations) {
      const wire::StepRecord rec = CurrentStepRecord(r.view);
      if (rec.decided_step > s->step.decided_step) {
        s->step.decided_step = rec.decided_step;
        s->step.decided_scale = rec.decided_scale;
        s->step.decided_skipped = rec.decided_skipped;
      }
      if (rec.completed_step > s->step.completed_step) {
        s->step.completed_step = rec.completed_step;
        s->step.completed_grad_norm = rec.completed_grad_norm;
        s->step.completed_status = rec.completed_status;
        s->step.completed_params_updated = rec.completed_params_updated;
      }
    }
    for (size_t i = 0; i < s->registrations.size() && s->lost.empty(); ++i) {
      AdoptedRegistration& r = s->registrations[i];
      if (r.view.registration != i) {
        s->lost = "its registration " + std::to_string(i) + " is missing";
        break;
      }
      if (!r.staging) {
        s->lost = "its staging segment " + r.view.staging_name + " is gone";
        s->lost_step = s->step.completed_step + 1;
      }
      r.report = CompleteUpdates(r.view, r.staging ? r.staging->base() : nullptr,
                                 r.staging ? r.staging->size() : 0, s->step);
      scan.restored_subchunks += r.report.restored_subchunks;
      scan.rolled_forward += r.report.rolled_forward;
      if (!r.report.lost.empty() && s->lost.empty()) {
        s->lost = r.report.lost;
        s->lost_step = r.report.lost_step;
      }
    }
    if (!s->lost.empty()) {
      scan.notes.push_back("the optimizer state of uid " + std::to_string(s->uid) + " job '" +
                           s->job + "' cannot be resumed: " + s->lost);
      DropSegments(*s);
    } else {
      ++scan.states;
      for (const auto& r : s->registrations) {
        scan.segments += 2;
        scan.bytes += r.state->size() + r.staging->size();
        scan.kept.insert(r.state->name());
        scan.kept.insert(r.staging->name());
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    states_.push_back(std::move(s));
  }
  return scan;
}

Status AdoptionStore::Claim(const OwnerProof& proof, platform::UserId uid,
                            std::unique_ptr<AdoptedState>* out) {
  std::unique_ptr<AdoptedState> s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = states_.begin(); it != states_.end(); ++it) {
      if (SameProof(proof, (*it)->proof.data()) && (*it)->uid == uid) {
        s = std::move(*it);
        states_.erase(it);
        break;
      }
    }
  }
  if (!s) {
    return Status(StatusCode::kNotFound,
                  "resume.recovery_token: this daemon holds no optimizer state for it (the "
                  "daemon that held it left none, or recovery is off here, or its "
                  "recovery_grace passed, or the budget could not hold it)");
  }
  if (s->lost.empty()) {
    for (const auto& r : s->registrations) {
      if (r.state->faulted() || r.staging->faulted()) {
        s->lost = "its staging segment was truncated while no client held it";
        s->lost_step = s->step.completed_step + 1;
      }
    }
  }
  if (!s->lost.empty()) {
    const std::string lost = s->lost;
    const uint64_t step = s->lost_step;
    DropSegments(*s);
    return Status(StatusCode::kFailedPrecondition,
                  "the optimizer state cannot be resumed: " + lost +
                      (step != 0 ? " (lost step " + std::to_string(step) + ")" : ""));
  }
  *out = std::move(s);
  return Status::Ok();
}

void AdoptionStore::Drop(std::unique_ptr<AdoptedState> s, const std::string& why) {
  if (!s->registrations.empty()) {
    spdlog::warn("dropping the adopted optimizer state of uid {} job '{}' ({}): {}", s->uid, s->job,
                 HumanBytes(s->bytes()), why);
  }
  DropSegments(*s);
}

void AdoptionStore::Sweep() {
  std::vector<std::pair<std::unique_ptr<AdoptedState>, std::string>> gone;
  const auto now = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = states_.begin(); it != states_.end();) {
      std::string why;
      if (now >= (*it)->deadline) {
        why = "not claimed within recovery_grace = " + std::to_string(grace_s_) + " s";
      } else if (!ProcessAlive((*it)->pid, (*it)->start)) {
        why = "its client process " + std::to_string((*it)->pid) + " is gone";
      }
      if (why.empty()) {
        ++it;
        continue;
      }
      gone.emplace_back(std::move(*it), why);
      it = states_.erase(it);
    }
  }
  for (auto& [s, why] : gone) Drop(std::move(s), why);
}

size_t AdoptionStore::size() {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& s : states_) n += s->registrations.empty() ? 0 : 1;
  return n;
}

void AdoptionStore::FillStatus(v1::StatusResponse* out) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = std::chrono::steady_clock::now();
  for (const auto& s : states_) {
    const double left = std::chrono::duration<double>(s->deadline - now).count();
    const std::string label = "adopted for uid " + std::to_string(s->uid) + " job '" + s->job +
                              "', waiting " + std::to_string(static_cast<int>(left)) +
                              " s more for its client";
    for (const auto& r : s->registrations) {
      for (const ShmSegment* seg : {r.state.get(), r.staging.get()}) {
        auto* st = out->add_segments();
        st->set_name(seg->name());
        st->set_kind(static_cast<v1::SegmentKind>(seg->kind()));
        st->set_bytes(seg->size());
        st->set_session_id(0);
        st->set_label(label);
      }
    }
  }
}

}  // namespace trainstream::daemon
