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
  SessionFaultFn on_fault;  // set before planes start
  std::mutex mu;
  std::unordered_map<uint64_t, std::unique_ptr<OptimizerPlane>> planes;  // Guarded by mu.
};

OptimizerService::OptimizerService(unsigned threads) : impl_(std::make_unique<Impl>(threads)) {
  spdlog::info("optimizer: {} AdamW worker threads ({} path)", impl_->pool.size(),
               kernels::IsaName(kernels::BestIsa()));
}

OptimizerService::~OptimizerService() {
  std::unordered_map<uint64_t, std::unique_ptr<OptimizerPlane>> planes;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    planes.swap(impl_->planes);
  }
  planes.clear();  // stops each plane before the pool goes away
}

void OptimizerService::SetFaultHandler(SessionFaultFn on_fault) {
  impl_->on_fault = std::move(on_fault);
}

void OptimizerService::StartPlane(uint64_t id, PlaneOptions options,
                                  std::vector<PlaneMember> members) {
  options.on_fault = impl_->on_fault;
  auto plane =
      std::make_unique<OptimizerPlane>(std::move(options), std::move(members), &impl_->pool);
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->planes[id] = std::move(plane);
}

Status OptimizerService::AddParameters(uint64_t id, PlaneRegistration params) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->planes.find(id);
  if (it == impl_->planes.end())
    return Status(StatusCode::kInvalidArgument,
                  "session " + std::to_string(id) + " has no data plane");
  return it->second->AddParameters(params.options, std::move(params.params), params.adopted,
                                   std::move(params.carried), std::move(params.pool));
}

void OptimizerService::StopPlane(uint64_t id, const std::string& why, int leaver) {
  std::unique_ptr<OptimizerPlane> plane;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    auto it = impl_->planes.find(id);
    if (it == impl_->planes.end()) return;
    plane = std::move(it->second);
    impl_->planes.erase(it);
  }
  // Outside the lock: stopping can take a step's worth of updates.
  plane->Stop(why, leaver);
}

std::string OptimizerService::failure(uint64_t id) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->planes.find(id);
  return it == impl_->planes.end() ? "" : it->second->failure();
}

unsigned OptimizerService::worker_threads() const { return impl_->pool.size(); }

}  // namespace trainstream::daemon
