// The client side of the shared-memory data plane (docs/design.md, "Data plane").
//
// Python hands this module plain integers (the address and length of regions the
// control client mapped) and tensors; it never sees gRPC. A DataPlane owns the
// producer end of the session's command ring and the consumer end of its
// completion ring:
//
//   post_grad      copy a gradient into its staging slot, then post GRAD_READY.
//                  CPU tensors: a plain copy, posted at once. CUDA tensors: an
//                  async D2H copy on a dedicated stream; a poster thread posts
//                  GRAD_READY once the copy's event has completed, so the caller
//                  (an autograd hook) never waits on the host.
//   poll           the next completion (PARAM_READY, STEP_DONE, ...), GIL released.
//   copy_param     copy new weights from the param slot into the parameter (H2D
//                  on a dedicated stream; the compute stream waits on an event,
//                  never the host).
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>

#include "check.h"
#include "torch_dtype.h"
#include "trainstream/platform/shared_word.h"
#include "trainstream/wire/grad_pool.h"
#include "trainstream/wire/ring.h"
#include "trainstream/wire/session_control.h"

#ifdef TRAINSTREAM_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#endif

namespace py = pybind11;

namespace trainstream::python {
namespace {

using wire::CommandRecord;
using wire::CompletionRecord;
using wire::Opcode;
using wire::RingView;
using wire::SessionControlHeader;

// Raised (as trainstream.DaemonError on the Python side) when the daemon closed
// the session or stopped consuming.
struct DaemonGone : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A view's element type by name: a wire DType's (wire::ParseDType) or "uint8", bytes.
at::ScalarType ScalarTypeOf(const std::string& name) {
  if (name == "uint8") return at::kByte;
  wire::DType dtype;
  if (wire::ParseDType(name, &dtype)) return ToScalarType(dtype);
  throw std::invalid_argument("dtype must be one of " + std::string(wire::kDTypeNames) +
                              ", uint8; got " + name);
}

// A tensor viewing `numel` elements at `address`. The caller keeps the mapping
// alive for as long as the tensor is used (Python holds the MappedRegion).
torch::Tensor TensorFromAddress(uintptr_t address, std::vector<int64_t> shape,
                                const std::string& dtype) {
  if (address == 0) throw std::invalid_argument("address must be non-zero");
  auto options = torch::TensorOptions().dtype(ScalarTypeOf(dtype)).device(torch::kCPU);
  return torch::from_blob(reinterpret_cast<void*>(address), shape, options);
}

class DataPlane {
 public:
  DataPlane(uintptr_t control_address, uint64_t control_bytes, int64_t timeout_ms)
      : header_(reinterpret_cast<SessionControlHeader*>(control_address)), timeout_ms_(timeout_ms) {
    if (control_bytes < sizeof(SessionControlHeader) ||
        header_->magic != wire::kSessionControlMagic ||
        header_->version != wire::kSessionControlVersion ||
        header_->completion_ring_offset >= control_bytes ||
        header_->command_ring_offset >= control_bytes) {
      throw std::invalid_argument(
          "not a TrainStream session control region (bad magic, version or offsets)");
    }
    auto* base = reinterpret_cast<char*>(header_);
    commands_ = RingView(base + header_->command_ring_offset);
    completions_ = RingView(base + header_->completion_ring_offset);
    if (!commands_.valid() || !completions_.valid() ||
        commands_.header()->record_size != sizeof(CommandRecord) ||
        completions_.header()->record_size != sizeof(CompletionRecord)) {
      throw std::invalid_argument("session control region has malformed rings");
    }
  }

  ~DataPlane() { StopPoster(); }

  DataPlane(const DataPlane&) = delete;
  DataPlane& operator=(const DataPlane&) = delete;

  bool closing() const { return header_->closing.load(std::memory_order_acquire) != 0; }

  // pool_pos >= 0: `slot` is the gradient pool extent at that position
  // (trainstream/wire/grad_pool.h), named in the record; the caller posts
  // extents in claim order, so a CPU copy first lets queued CUDA posts go.
  // copy false: the slot already holds the gradient (a replay).
  uint64_t PostGrad(uint64_t param_id, const torch::Tensor& grad, torch::Tensor slot, uint64_t step,
                    double lr, double beta1, double beta2, double eps, double weight_decay,
                    int64_t pool_pos, bool copy) {
    TS_CHECK(grad.numel() == slot.numel(), "gradient of param ", param_id, " has ", grad.numel(),
             " elements but its staging slot holds ", slot.numel());
    CommandRecord rec = MakeRecord(Opcode::kGradReady);
    if (pool_pos >= 0) {
      rec.flags = wire::kFlagPooledGrad;
      rec.region_offset = static_cast<uint64_t>(pool_pos);
      rec.bytes = static_cast<uint64_t>(slot.nbytes());
    }
    rec.param_id = param_id;
    rec.step = step;
    rec.lr = lr;
    rec.beta1 = beta1;
    rec.beta2 = beta2;
    rec.eps = eps;
    rec.weight_decay = weight_decay;
#ifdef TRAINSTREAM_WITH_CUDA
    if (grad.is_cuda() && copy) {
      PostAfterCopy(grad, slot, rec);
      return rec.seq;
    }
#endif
    {
      py::gil_scoped_release release;
      if (pool_pos >= 0) WaitPosterIdle();
      if (copy) slot.view(grad.sizes()).copy_(grad.detach());
    }
    Push(rec);
    return rec.seq;
  }

  uint64_t PostStepEnd(uint64_t step, uint64_t grads_posted) {
    WaitPosterIdle();  // every GRAD_READY of the step goes first
    CommandRecord rec = MakeRecord(Opcode::kStepEnd);
    rec.step = step;
    rec.grads_posted = grads_posted;
    Push(rec);
    return rec.seq;
  }

  uint64_t PostState(bool load, uint64_t param_id, uint32_t field, uint64_t region_id,
                     uint64_t region_offset, uint64_t bytes, uint64_t step) {
    CommandRecord rec = MakeRecord(load ? Opcode::kLoadState : Opcode::kExportState);
    rec.param_id = param_id;
    rec.field = static_cast<wire::StateField>(field);
    rec.region_id = region_id;
    rec.region_offset = region_offset;
    rec.bytes = bytes;
    rec.step = step;
    Push(rec);
    return rec.seq;
  }

  // Data-parallel group, local rank 0 with several machines: param_id's sum
  // slot holds the all-reduced gradient of `step` (answers REDUCE_READY).
  uint64_t PostGradReduced(uint64_t param_id, uint64_t step) {
    CommandRecord rec = MakeRecord(Opcode::kGradReduced);
    rec.param_id = param_id;
    rec.step = step;
    Push(rec);
    return rec.seq;
  }

  uint64_t PostSync() {
    WaitPosterIdle();
    CommandRecord rec = MakeRecord(Opcode::kSync);
    Push(rec);
    return rec.seq;
  }

  // The next completion as a dict, or None after `timeout_ms` with nothing.
  py::object Poll(int64_t timeout_ms) {
    CompletionRecord rec{};
    bool got = false;
    {
      py::gil_scoped_release release;
      const auto deadline =
          std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
      while (true) {
        const int64_t left = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                 deadline - std::chrono::steady_clock::now())
                                 .count();
        const int64_t slice = std::min<int64_t>(std::max<int64_t>(left, 0), 50'000'000);
        if (PopCompletion(&rec, slice)) {
          got = true;
          break;
        }
        if (left <= 0 || closing()) break;
      }
    }
    if (!got) return py::none();
    py::dict d;
    d["opcode"] = static_cast<uint32_t>(rec.opcode);
    d["status"] = static_cast<int32_t>(rec.status);
    d["seq"] = rec.seq;
    d["param_id"] = rec.param_id;
    d["step"] = rec.step;
    d["grad_norm"] = rec.grad_norm;
    d["params_updated"] = rec.params_updated;
    d["message"] = std::string(rec.message, strnlen(rec.message, sizeof(rec.message)));
    return d;
  }

  // param.copy_(slot). For a CUDA parameter the copy is issued on the H2D stream
  // and the current stream waits for it (no host wait).
  void CopyParam(torch::Tensor param, const torch::Tensor& slot) {
    TS_CHECK(param.numel() == slot.numel(), "parameter has ", param.numel(),
             " elements but its staging slot holds ", slot.numel());
    torch::NoGradGuard no_grad;
#ifdef TRAINSTREAM_WITH_CUDA
    if (param.is_cuda()) {
      c10::cuda::CUDAGuard guard(param.device());
      auto& s = H2DStream(param.device().index());
      {
        c10::cuda::CUDAStreamGuard stream_guard(s);
        param.copy_(slot.view(param.sizes()), /*non_blocking=*/true);
      }
      at::cuda::CUDAEvent done;
      done.record(s);
      done.block(c10::cuda::getCurrentCUDAStream(param.device().index()));
      return;
    }
#endif
    param.copy_(slot.view(param.sizes()));  // param may be non-contiguous
  }

  // Blocks until every async gradient post has been pushed to the ring.
  void Flush() {
    py::gil_scoped_release release;
    WaitPosterIdle();
  }

  uint64_t commands_pending() const { return commands_.size(); }

 private:
  CommandRecord MakeRecord(Opcode op) {
    CommandRecord rec{};
    rec.opcode = op;
    rec.seq = next_seq_.fetch_add(1, std::memory_order_relaxed);
    return rec;
  }

  // Several threads may post (autograd hooks, the poster thread, step()); the
  // ring has one producer, so posts are serialised here.
  void Push(const CommandRecord& rec) {
    std::lock_guard<std::mutex> lock(push_mu_);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms_);
    while (!commands_.TryPush(&rec)) {
      // The daemon may itself be waiting for room on the completion ring; move
      // completions aside so neither side waits on the other.
      StashCompletions();
      if (closing())
        throw DaemonGone("the daemon closed this session (shutdown or session torn down)");
      if (std::chrono::steady_clock::now() > deadline) {
        throw DaemonGone("the daemon stopped consuming commands (ring full for " +
                         std::to_string(timeout_ms_) + " ms)");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  // The one consumer of completions_: Poll and StashCompletions both hold
  // pop_mu_ (a blocked Poll holds it for at most one 50 ms slice).
  bool PopCompletion(CompletionRecord* rec, int64_t timeout_ns) {
    std::lock_guard<std::mutex> lock(pop_mu_);
    if (!stash_.empty()) {
      *rec = stash_.front();
      stash_.pop_front();
      return true;
    }
    return completions_.Pop(rec, timeout_ns);
  }

  void StashCompletions() {
    std::lock_guard<std::mutex> lock(pop_mu_);
    CompletionRecord rec{};
    while (completions_.TryPop(&rec)) stash_.push_back(rec);
  }

#ifdef TRAINSTREAM_WITH_CUDA
  struct PendingPost {
    at::cuda::CUDAEvent copied;
    CommandRecord record;
  };

  using StreamMap = std::unordered_map<c10::DeviceIndex, c10::cuda::CUDAStream>;

  // The copy stream of `device` in `streams` (d2h_streams_ or h2d_streams_),
  // taken from torch's pool on first use.
  c10::cuda::CUDAStream& CopyStream(StreamMap& streams, c10::DeviceIndex device) {
    std::lock_guard<std::mutex> lock(stream_mu_);
    auto it = streams.find(device);
    if (it == streams.end())
      it = streams.emplace(device, c10::cuda::getStreamFromPool(false, device)).first;
    return it->second;
  }
  c10::cuda::CUDAStream& D2HStream(c10::DeviceIndex device) {
    return CopyStream(d2h_streams_, device);
  }
  c10::cuda::CUDAStream& H2DStream(c10::DeviceIndex device) {
    return CopyStream(h2d_streams_, device);
  }

  void PostAfterCopy(const torch::Tensor& grad, torch::Tensor slot, const CommandRecord& rec) {
    const auto device = grad.device().index();
    c10::cuda::CUDAGuard guard(grad.device());
    auto current = c10::cuda::getCurrentCUDAStream(device);
    auto& s = D2HStream(device);
    // The copy stream must see the gradient as the compute stream produced it.
    at::cuda::CUDAEvent produced;
    produced.record(current);
    produced.block(s);
    {
      c10::cuda::CUDAStreamGuard stream_guard(s);
      slot.view(grad.sizes()).copy_(grad.detach(), /*non_blocking=*/true);
    }
    // Keep the gradient's memory alive until the copy has run.
    grad.record_stream(s);
    PendingPost pending{at::cuda::CUDAEvent(), rec};
    pending.copied.record(s);
    EnsurePoster();
    {
      std::lock_guard<std::mutex> lock(poster_mu_);
      queue_.push_back(std::move(pending));
      ++in_flight_;
    }
    poster_cv_.notify_one();
  }

  void EnsurePoster() {
    std::lock_guard<std::mutex> lock(poster_mu_);
    if (!poster_.joinable()) poster_ = std::thread([this] { PosterLoop(); });
  }

  void PosterLoop() {
    while (true) {
      std::unique_lock<std::mutex> lock(poster_mu_);
      poster_cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      PendingPost pending = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      pending.copied.synchronize();
      try {
        Push(pending.record);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> relock(poster_mu_);
        poster_error_ = e.what();
      }
      lock.lock();
      --in_flight_;
      idle_cv_.notify_all();
    }
  }
#endif

  void WaitPosterIdle() {
#ifdef TRAINSTREAM_WITH_CUDA
    std::unique_lock<std::mutex> lock(poster_mu_);
    idle_cv_.wait(lock, [this] { return in_flight_ == 0; });
    if (!poster_error_.empty()) {
      std::string e = poster_error_;
      poster_error_.clear();
      throw DaemonGone(e);
    }
#endif
  }

  void StopPoster() {
#ifdef TRAINSTREAM_WITH_CUDA
    {
      std::lock_guard<std::mutex> lock(poster_mu_);
      stop_ = true;
    }
    poster_cv_.notify_all();
    if (poster_.joinable()) poster_.join();
#endif
  }

  SessionControlHeader* header_;  // not owned; Python keeps the mapping alive
  RingView commands_;
  RingView completions_;
  int64_t timeout_ms_;
  std::atomic<uint64_t> next_seq_{1};
  std::mutex push_mu_;  // serialises producers of commands_
  std::mutex pop_mu_;   // guards stash_ and TryPop on completions_
  std::deque<CompletionRecord> stash_;

#ifdef TRAINSTREAM_WITH_CUDA
  std::mutex stream_mu_;   // guards the two stream maps
  StreamMap d2h_streams_;  // Guarded by stream_mu_
  StreamMap h2d_streams_;  // Guarded by stream_mu_
  std::mutex poster_mu_;   // guards queue_, in_flight_, stop_, poster_error_, poster_
  std::condition_variable poster_cv_;
  std::condition_variable idle_cv_;
  std::deque<PendingPost> queue_;
  uint64_t in_flight_ = 0;
  bool stop_ = false;
  std::string poster_error_;
  std::thread poster_;
#endif
};

// Pins a host range for fast, async CUDA copies (docs/design.md, "Memory ownership and segment
// kinds"): once per segment, never per step. Returns false (and the reason) when CUDA is absent.
py::tuple RegisterHost(uintptr_t address, uint64_t bytes, bool read_only) {
#ifdef TRAINSTREAM_WITH_CUDA
  // Mapped: the zero-copy AdamW (optimizer_mode="gpu") reads moments through it.
  unsigned flags = cudaHostRegisterPortable | cudaHostRegisterMapped;
  if (read_only) flags |= cudaHostRegisterReadOnly;
  cudaError_t err = cudaHostRegister(reinterpret_cast<void*>(address), bytes, flags);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error state
    return py::make_tuple(false, std::string(cudaGetErrorString(err)));
  }
  return py::make_tuple(true, std::string());
#else
  return py::make_tuple(false, std::string("built without CUDA"));
#endif
}

void UnregisterHost(uintptr_t address) {
#ifdef TRAINSTREAM_WITH_CUDA
  if (cudaHostUnregister(reinterpret_cast<void*>(address)) != cudaSuccess) cudaGetLastError();
#endif
}

// A client waiting for room in a gradient staging pool (trainstream/wire/grad_pool.h):
// sleeps until the daemon moves `released` (release_seq differs from `seen_seq`) or
// `timeout_ms` passes, without the GIL. Returns the release_seq it last saw. The
// store of `waiters` precedes the kernel's read of release_seq (futex_wait orders
// them), and the daemon increments release_seq before it reads `waiters`, so a
// release between the caller's check and the sleep is never missed.
uint32_t GradPoolWait(uintptr_t header_address, uint32_t seen_seq, int64_t timeout_ms) {
  auto* h = reinterpret_cast<wire::GradPoolHeader*>(header_address);
  py::gil_scoped_release release;
  h->waiters.store(1, std::memory_order_seq_cst);
  uint32_t now = h->release_seq.load(std::memory_order_seq_cst);
  if (now == seen_seq) {
    // A negative timeout returns at once, as it always has (never "forever").
    platform::SharedWordWait(&h->release_seq, seen_seq, std::max<int64_t>(timeout_ms, 0) * 1000000);
    now = h->release_seq.load(std::memory_order_acquire);
  }
  h->waiters.store(0, std::memory_order_release);
  return now;
}

}  // namespace

void RegisterDataPlaneBindings(py::module_& m) {
  py::register_exception<DaemonGone>(m, "DaemonGone", PyExc_RuntimeError);
  m.def("tensor_from_address", &TensorFromAddress, py::arg("address"), py::arg("shape"),
        py::arg("dtype"),
        "A CPU tensor viewing memory at `address` (not owned: keep the mapping alive).");
  m.def("register_host", &RegisterHost, py::arg("address"), py::arg("bytes"),
        py::arg("read_only") = false);
  m.def("unregister_host", &UnregisterHost, py::arg("address"));
  m.def("grad_pool_wait", &GradPoolWait, py::arg("header_address"), py::arg("seen_seq"),
        py::arg("timeout_ms"));
  py::class_<DataPlane>(m, "DataPlane")
      .def(py::init<uintptr_t, uint64_t, int64_t>(), py::arg("control_address"),
           py::arg("control_bytes"), py::arg("timeout_ms") = 30000)
      .def("post_grad", &DataPlane::PostGrad, py::arg("param_id"), py::arg("grad"), py::arg("slot"),
           py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
           py::arg("weight_decay"), py::arg("pool_pos") = -1, py::arg("copy") = true)
      .def("post_step_end", &DataPlane::PostStepEnd, py::arg("step"), py::arg("grads_posted"))
      .def("post_state", &DataPlane::PostState, py::arg("load"), py::arg("param_id"),
           py::arg("field"), py::arg("region_id"), py::arg("region_offset"), py::arg("bytes"),
           py::arg("step") = 0)
      .def("post_grad_reduced", &DataPlane::PostGradReduced, py::arg("param_id"), py::arg("step"))
      .def("post_sync", &DataPlane::PostSync)
      .def("poll", &DataPlane::Poll, py::arg("timeout_ms"))
      .def("copy_param", &DataPlane::CopyParam, py::arg("param"), py::arg("slot"))
      .def("flush", &DataPlane::Flush)
      .def_property_readonly("closing", &DataPlane::closing)
      .def_property_readonly("commands_pending", &DataPlane::commands_pending);
}

}  // namespace trainstream::python
