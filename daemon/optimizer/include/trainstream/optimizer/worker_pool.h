// WorkerPool: a fixed set of threads, each with its own FIFO queue. Work is sent
// to a named worker (not to "any"), so the engine can keep a chunk of memory on
// the thread that first touched it (NUMA locality; docs/adamw.md, "Threads").
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace trainstream::optimizer {

// Logical CPU ids, one per physical core this process may run on (the first
// hyper-thread sibling of each core in the affinity mask). Falls back to every
// allowed CPU when the core topology is unknown (trainstream/platform/threads.h:
// sysfs on Linux).
std::vector<int> PhysicalCoreCpus();

struct WorkerPoolOptions {
  unsigned threads = 0;       // 0: one per physical core (PhysicalCoreCpus().size())
  bool pin_to_cores = false;  // pin worker i to PhysicalCoreCpus()[i % cores]
};

class WorkerPool {
 public:
  using Task = std::function<void()>;

  explicit WorkerPool(WorkerPoolOptions options = {});
  // Runs every task already queued, then joins the threads.
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  unsigned size() const { return static_cast<unsigned>(workers_.size()); }

  // Queues `task` on worker `worker % size()`. Thread-safe. Tasks of one worker
  // run in submission order; a worker drains its whole queue per wake-up, so a
  // burst of small tasks costs one wake-up, not one per task.
  void Submit(unsigned worker, Task task);

  // Index of the calling pool thread, or -1 when called from another thread.
  static int CurrentWorker();

 private:
  struct Worker {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Task> queue;  // Guarded by mu
    bool stop = false;       // Guarded by mu
    bool sleeping = false;   // Guarded by mu: waiting on cv, needs a notify
    std::thread thread;
  };
  void Run(unsigned index, int cpu);

  std::vector<std::unique_ptr<Worker>> workers_;
};

}  // namespace trainstream::optimizer
