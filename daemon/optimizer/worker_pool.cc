#include "trainstream/optimizer/worker_pool.h"

#include <cstdio>
#include <set>
#include <utility>

#include "trainstream/platform/threads.h"

namespace trainstream::optimizer {
namespace {

thread_local int current_worker = -1;

}  // namespace

std::vector<int> PhysicalCoreCpus() {
  std::vector<int> all = platform::AllowedCpus(), cores;
  if (all.empty()) {
    const unsigned n = std::thread::hardware_concurrency();
    for (unsigned cpu = 0; cpu < (n ? n : 1); ++cpu) all.push_back(static_cast<int>(cpu));
  }
  std::set<std::pair<int, int>> seen;  // (package, core)
  for (int cpu : all) {
    platform::CpuCore core;
    if (!platform::CoreOfCpu(cpu, &core)) return all;
    if (seen.insert({core.package, core.core}).second) cores.push_back(cpu);
  }
  return cores;
}

WorkerPool::WorkerPool(WorkerPoolOptions options) {
  const std::vector<int> cpus = PhysicalCoreCpus();
  const unsigned n = options.threads ? options.threads : static_cast<unsigned>(cpus.size());
  workers_.reserve(n);
  for (unsigned i = 0; i < n; ++i) workers_.push_back(std::make_unique<Worker>());
  for (unsigned i = 0; i < n; ++i) {
    const int cpu = options.pin_to_cores ? cpus[i % cpus.size()] : -1;
    workers_[i]->thread = std::thread([this, i, cpu] { Run(i, cpu); });
  }
}

WorkerPool::~WorkerPool() {
  for (auto& w : workers_) {
    std::lock_guard<std::mutex> lock(w->mu);
    w->stop = true;
    w->cv.notify_one();
  }
  for (auto& w : workers_) w->thread.join();
}

void WorkerPool::Submit(unsigned worker, Task task) {
  Worker& w = *workers_[worker % workers_.size()];
  bool wake;
  {
    std::lock_guard<std::mutex> lock(w.mu);
    w.queue.push_back(std::move(task));
    wake = w.sleeping;
    w.sleeping = false;
  }
  if (wake) w.cv.notify_one();
}

int WorkerPool::CurrentWorker() { return current_worker; }

void WorkerPool::Run(unsigned index, int cpu) {
  current_worker = static_cast<int>(index);
  // "ts-adamw-<i>" in top -H, gdb and /proc/<pid>/task/*/comm (tests count
  // which workers a session's updates ran on by it).
  char name[16];
  std::snprintf(name, sizeof(name), "ts-adamw-%u", index);
  platform::NameCurrentThread(name);
  if (cpu >= 0) platform::PinCurrentThread(cpu);  // best effort
  Worker& w = *workers_[index];
  std::deque<Task> batch;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(w.mu);
      while (w.queue.empty() && !w.stop) {
        w.sleeping = true;
        w.cv.wait(lock);
      }
      if (w.queue.empty()) return;  // stop requested and nothing left
      batch.swap(w.queue);
    }
    for (Task& task : batch) task();
    batch.clear();
  }
}

}  // namespace trainstream::optimizer
