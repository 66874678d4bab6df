#include "planes/optimizer_service.h"

#include <spdlog/spdlog.h>

#include <mutex>
#include <unordered_map>

#include "trainstream/kernels/adamw.h"
#include "trainstream/optimizer/worker_pool.h"

namespace trainstream::daemon {

struct OptimizerService::Impl {
  explicit Impl(unsigned threads) : pool(optimizer::WorkerPoolOptions{threads, false}) {}
  optimizer::WorkerPool pool;
  SessionFaultFn on_fault;  // set before sessions start
  std::mutex mu;            // guards sessions
  std::unordered_map<uint64_t, std::unique_ptr<OptimizerPlane>> sessions;
};

OptimizerService::OptimizerService(unsigned threads) : impl_(std::make_unique<Impl>(threads)) {
  spdlog::info("optimizer: {} AdamW worker threads ({} path)", impl_->pool.size(),
               kernels::IsaName(kernels::BestIsa()));
}

OptimizerService::~OptimizerService() {
  std::unordered_map<uint64_t, std::unique_ptr<OptimizerPlane>> sessions;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    sessions.swap(impl_->sessions);
  }
  sessions.clear();  // stops each plane before the pool goes away
}

void OptimizerService::SetFaultHandler(SessionFaultFn on_fault) {
  impl_->on_fault = std::move(on_fault);
}

void OptimizerService::StartSession(uint64_t session_id, const ControlRings& rings,
                                    RegionResolver resolver) {
  PlaneOptions options;
  options.name = "session " + std::to_string(session_id);
  options.on_fault = impl_->on_fault;
  std::vector<PlaneMember> members;
  members.push_back(PlaneMember{0, session_id, rings, std::move(resolver)});
  auto plane =
      std::make_unique<OptimizerPlane>(std::move(options), std::move(members), &impl_->pool);
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->sessions[session_id] = std::move(plane);
}

Status OptimizerService::AddParameters(uint64_t session_id, const SessionOptimizerOptions& options,
                                       std::vector<ParamBinding> params, bool adopted,
                                       std::vector<CarriedNorm> carried,
                                       std::unique_ptr<GradientPool> pool) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->sessions.find(session_id);
  if (it == impl_->sessions.end())
    return Status(StatusCode::kInvalidArgument,
                  "session " + std::to_string(session_id) + " has no data plane");
  return it->second->AddParameters(options, std::move(params), adopted, std::move(carried),
                                   std::move(pool));
}

void OptimizerService::EndSession(uint64_t session_id) {
  std::unique_ptr<OptimizerPlane> plane;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    auto it = impl_->sessions.find(session_id);
    if (it == impl_->sessions.end()) return;
    plane = std::move(it->second);
    impl_->sessions.erase(it);
  }
  plane.reset();  // outside the lock: stopping can take a step's worth of updates
}

unsigned OptimizerService::worker_threads() const { return impl_->pool.size(); }

optimizer::WorkerPool* OptimizerService::pool() { return &impl_->pool; }

}  // namespace trainstream::daemon
