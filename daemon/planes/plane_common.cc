#include "planes/plane_common.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <vector>

#include "trainstream/kernels/adamw.h"
#include "trainstream/optimizer/worker_pool.h"

namespace trainstream::daemon {
namespace {

constexpr size_t kSumBlockElems = 4096;        // summed block by block, in cache
constexpr size_t kParallelSumElems = 1 << 18;  // larger sums are split over the worker pool

// dst[i] = (sum over r of srcs[r][i]) / divisor for i in [begin, end).
void SumBlock(const std::vector<void*>& srcs, kernels::DType dtype, float* dst, size_t begin,
              size_t end, float divisor) {
  float tmp[kSumBlockElems];
  const size_t es = kernels::DTypeSize(dtype);
  for (size_t b = begin; b < end; b += kSumBlockElems) {
    const size_t n = std::min(kSumBlockElems, end - b);
    float* out = dst + b;
    kernels::ConvertToFloat(static_cast<const char*>(srcs[0]) + b * es, dtype, out, n);
    for (size_t r = 1; r < srcs.size(); ++r) {
      const float* in = tmp;
      if (dtype == kernels::DType::kFloat32) {
        in = static_cast<const float*>(srcs[r]) + b;
      } else {
        kernels::ConvertToFloat(static_cast<const char*>(srcs[r]) + b * es, dtype, tmp, n);
      }
      for (size_t i = 0; i < n; ++i) out[i] += in[i];
    }
    if (divisor != 1.0f) {
      for (size_t i = 0; i < n; ++i) out[i] /= divisor;
    }
  }
}

}  // namespace

using wire::Opcode;
using wire::StateField;

void SumRankGradients(const std::vector<void*>& srcs, kernels::DType dtype, float* dst, size_t n,
                      float divisor, optimizer::WorkerPool* pool) {
  if (n < kParallelSumElems || pool->size() < 2) {
    SumBlock(srcs, dtype, dst, 0, n, divisor);
    return;
  }
  const size_t parts = std::min<size_t>(pool->size(), n / (kParallelSumElems / 4));
  const size_t per = (n + parts - 1) / parts;
  std::mutex mu;
  std::condition_variable cv;
  size_t left = parts;
  for (size_t i = 0; i < parts; ++i) {
    const size_t begin = i * per, end = std::min(n, begin + per);
    pool->Submit(static_cast<unsigned>(i), [&, begin, end] {
      SumBlock(srcs, dtype, dst, begin, end, divisor);
      std::lock_guard<std::mutex> lock(mu);
      if (--left == 0) cv.notify_one();
    });
  }
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return left == 0; });
}

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
  if (cmd.field == StateField::kWeights) {
    if (!load) return Status(StatusCode::kInvalidArgument, "kWeights can only be loaded");
    if (cmd.bytes == 0) return engine.AdoptWeights(cmd.param_id, nullptr, 0);
    const void* weights = resolver(cmd.region_id, cmd.region_offset, cmd.bytes);
    if (weights == nullptr) {
      return Status(StatusCode::kInvalidArgument, "region " + std::to_string(cmd.region_id) + " [" +
                                                      std::to_string(cmd.region_offset) + ", +" +
                                                      std::to_string(cmd.bytes) +
                                                      ") is not a region of this session");
    }
    return engine.AdoptWeights(cmd.param_id, weights, cmd.bytes);
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
                        "from slot), 5 (weights)");
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
