// GradientPool (grad_pool.h).
#include "planes/grad_pool.h"

#include <string>

#include "trainstream/wire/ring.h"

namespace trainstream::daemon {
namespace {

Status Refused(uint64_t param_id, const std::string& why) {
  return Status(StatusCode::kInvalidArgument,
                "param " + std::to_string(param_id) + ": gradient pool extent " + why);
}

}  // namespace

GradientPool::GradientPool(char* staging, uint64_t pool_offset, uint64_t capacity, bool fresh)
    : staging_(staging),
      header_(reinterpret_cast<wire::GradPoolHeader*>(staging + wire::kGradPoolHeaderOffset)),
      pool_offset_(pool_offset),
      capacity_(capacity) {
  if (!fresh) return;
  header_->magic = wire::kGradPoolMagic;
  header_->version = wire::kGradPoolVersion;
  header_->capacity = capacity;
  header_->pool_offset = pool_offset;
  header_->released.store(0, std::memory_order_release);
}

Status GradientPool::Accept(uint64_t param_id, uint64_t pos, uint64_t len, uint64_t expected_len,
                            optimizer::GradRef* out) {
  if (len != expected_len)
    return Refused(param_id, "of " + std::to_string(len) + " bytes; its gradient has " +
                                 std::to_string(expected_len));
  if (len == 0 || len > capacity_)
    return Refused(param_id, "of " + std::to_string(len) + " bytes does not fit the pool (" +
                                 std::to_string(capacity_) + ")");
  if (pos % wire::kPoolAlign != 0)
    return Refused(param_id, "at " + std::to_string(pos) + " is not " +
                                 std::to_string(wire::kPoolAlign) + "-byte aligned");
  if (pos > UINT64_MAX - len) return Refused(param_id, "overflows 64-bit positions");
  if (pos % capacity_ + len > capacity_)
    return Refused(param_id, "at " + std::to_string(pos) + " wraps around the end of the pool");
  std::lock_guard<std::mutex> lock(mu_);
  if (pos_of_.count(param_id) != 0)
    return Refused(param_id, "posted while its last gradient is still in flight");
  if (!in_flight_.empty()) {
    if (pos < expect_)
      return Refused(param_id, "at " + std::to_string(pos) +
                                   " starts before the end of the last (" +
                                   std::to_string(expect_) + ")");
    if (pos + len - released_ > capacity_)
      return Refused(param_id, "at " + std::to_string(pos) +
                                   " overwrites bytes in flight (released " +
                                   std::to_string(released_) + ")");
  } else {
    released_ = pos;  // every byte is free: the window starts here
  }
  in_flight_.emplace(pos, Extent{len, false});
  pos_of_.emplace(param_id, pos);
  expect_ = pos + len;
  const uint64_t offset = pool_offset_ + pos % capacity_;
  out->data = staging_ + offset;
  out->record_offset = offset;
  return Status::Ok();
}

void GradientPool::Release(uint64_t param_id) {
  uint64_t released;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pos_of_.find(param_id);
    if (it == pos_of_.end()) return;
    in_flight_.at(it->second).done = true;
    pos_of_.erase(it);
    while (!in_flight_.empty() && in_flight_.begin()->second.done)
      in_flight_.erase(in_flight_.begin());
    const uint64_t next = in_flight_.empty() ? expect_ : in_flight_.begin()->first;
    if (next == released_) return;  // a later extent finished first: nothing new is free
    released = released_ = next;
    // Under mu_, so that stores of `released` never go backwards.
    header_->released.store(released, std::memory_order_release);
    header_->release_seq.fetch_add(1, std::memory_order_seq_cst);
    if (header_->waiters.load(std::memory_order_seq_cst) != 0)
      platform::SharedWordWake(&header_->release_seq);
  }
}

size_t GradientPool::in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_flight_.size();
}

uint64_t GradientPool::released() const {
  std::lock_guard<std::mutex> lock(mu_);
  return released_;
}

}  // namespace trainstream::daemon
