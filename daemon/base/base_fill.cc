#include "base/base_fill.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "trainstream/kernels/quant.h"
#include "trainstream/platform/sys_call.h"
#include "trainstream/platform/threads.h"

namespace trainstream::daemon::base {
namespace {

Status Cancelled() { return Status(StatusCode::kCancelled, kLoadCancelled); }

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// IEEE half -> float, exact (the kernels read fp32 or bf16; fp16 -> fp32 does
// not change a value, so the quantized bytes match quantize_tensor's).
float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    const float v = std::ldexp(static_cast<float>(man), -24);  // zero or subnormal, exact
    return sign ? -v : v;
  }
  const uint32_t bits =
      exp == 0x1f ? sign | 0x7f800000u | (man << 13) : sign | ((exp + 112u) << 23) | (man << 13);
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Reads exactly `bytes` at `offset`; an error names the file and the tensor.
// `stop` is polled between the reads of a piece a short read split.
Status ReadFully(const SourceFile& f, const std::string& tensor, uint64_t offset, uint64_t bytes,
                 char* dst, const CancelCheck& stop) {
  uint64_t done = 0;
  while (done < bytes) {
    if (done != 0 && stop()) return Cancelled();
    const int64_t r = f.file.ReadAt(dst + done, static_cast<size_t>(bytes - done), offset + done);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      const int err = errno;
      return platform::ErrnoStatus(StatusCode::kDataLoss,
                                   f.path + ": reading tensor \"" + tensor + "\"", err);
    }
    if (r == 0) {
      return Status(StatusCode::kDataLoss,
                    f.path + ": reading tensor \"" + tensor +
                        "\": the file ended early (it shrank while loading?)");
    }
    done += static_cast<uint64_t>(r);
  }
  return Status::Ok();
}

// Index of the first non-finite element among n of `src`, or -1. A value is
// non-finite when its exponent bits are all ones, i.e. when its bits without the
// sign are >= `inf`. The max over a chunk is a loop the compiler vectorizes; only a
// chunk that holds one is scanned element by element.
template <typename Bits>
int64_t FirstAtLeast(const Bits* p, uint64_t n, Bits abs_mask, Bits inf) {
  constexpr uint64_t kChunk = 1024;
  for (uint64_t c = 0; c < n; c += kChunk) {
    const uint64_t e = std::min(n, c + kChunk);
    Bits m = 0;
    for (uint64_t i = c; i < e; ++i) m = std::max<Bits>(m, p[i] & abs_mask);
    if (m < inf) continue;
    for (uint64_t i = c; i < e; ++i)
      if ((p[i] & abs_mask) >= inf) return static_cast<int64_t>(i);
  }
  return -1;
}

int64_t FirstNonFinite(SafetensorsDType dtype, const void* src, uint64_t n) {
  switch (dtype) {
    case SafetensorsDType::kF32:
      return FirstAtLeast<uint32_t>(static_cast<const uint32_t*>(src), n, 0x7fffffffu, 0x7f800000u);
    case SafetensorsDType::kBF16:
      return FirstAtLeast<uint16_t>(static_cast<const uint16_t*>(src), n, 0x7fff, 0x7f80);
    default:  // F16 (only floats are quantized)
      return FirstAtLeast<uint16_t>(static_cast<const uint16_t*>(src), n, 0x7fff, 0x7c00);
  }
}

// One unit of work. kCopy: bytes [begin, end) of an unquantized tensor. kAbsMax
// (nvfp4's first pass) and kQuantize: blocks [begin, end) of a quantized one.
enum class PieceKind : uint8_t { kCopy, kAbsMax, kQuantize };

struct Piece {
  uint32_t tensor = 0;
  PieceKind kind = PieceKind::kCopy;
  uint64_t begin = 0;
  uint64_t end = 0;
};

uint64_t PieceBytes(const FillOptions& o) {
  return o.piece_bytes ? o.piece_bytes : kLoadPieceBytes;
}

uint64_t BlocksPerPiece(const PlannedTensor& t, uint64_t piece_bytes) {
  const uint64_t block_bytes =
      static_cast<uint64_t>(t.layout.block_size) * SafetensorsDTypeSize(t.src.dtype);
  return std::max<uint64_t>(1, piece_bytes / block_bytes);
}

// Elements of a quantized tensor's piece of `blocks` blocks starting at `first`.
uint64_t PieceElements(const PlannedTensor& t, uint64_t first, uint64_t end) {
  const uint64_t bs = static_cast<uint64_t>(t.layout.block_size);
  return std::min<uint64_t>(t.src.numel(), end * bs) - first * bs;
}

// Where an F16 piece's fp32 copy starts in the scratch (aligned for floats).
uint64_t Fp32CopyOffset(uint64_t source_bytes) { return AlignUp(source_bytes, 64); }

// The scratch a piece of `t` of `elements` elements needs.
uint64_t PieceScratch(const PlannedTensor& t, uint64_t elements) {
  const uint64_t source = elements * SafetensorsDTypeSize(t.src.dtype);
  if (t.src.dtype != SafetensorsDType::kF16) return source;
  return Fp32CopyOffset(source) + elements * sizeof(float);
}

// The pieces in checkpoint order; an nvfp4 tensor's absmax pass just before its
// quantizing pass. Empty tensors have none.
std::vector<Piece> MakePieces(const BasePlan& plan, uint64_t piece_bytes) {
  std::vector<Piece> out;
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const PlannedTensor& t = plan.tensors[i];
    const auto index = static_cast<uint32_t>(i);
    if (!t.quantized) {
      for (uint64_t b = 0; b < t.src.bytes(); b += piece_bytes)
        out.push_back({index, PieceKind::kCopy, b, std::min(t.src.bytes(), b + piece_bytes)});
      continue;
    }
    const uint64_t per = BlocksPerPiece(t, piece_bytes);
    const auto blocks = static_cast<uint64_t>(t.layout.num_blocks);
    for (PieceKind kind : {PieceKind::kAbsMax, PieceKind::kQuantize}) {
      if (kind == PieceKind::kAbsMax && plan.format != kernels::QuantFormat::kNvfp4) continue;
      for (uint64_t b = 0; b < blocks; b += per)
        out.push_back({index, kind, b, std::min(blocks, b + per)});
    }
  }
  return out;
}

uint64_t ScratchPerThread(const BasePlan& plan, uint64_t piece_bytes) {
  uint64_t most = 0;
  for (const auto& t : plan.tensors) {
    if (!t.quantized) continue;
    const uint64_t blocks = std::min<uint64_t>(BlocksPerPiece(t, piece_bytes),
                                               static_cast<uint64_t>(t.layout.num_blocks));
    most = std::max(most, PieceScratch(t, PieceElements(t, 0, blocks)));
  }
  return most;
}

unsigned ThreadsFor(size_t pieces, const FillOptions& options) {
  const size_t asked = std::max(1u, options.threads);
  return static_cast<unsigned>(std::max<size_t>(1, std::min(asked, pieces)));
}

// The loader threads and the pieces they share (see the header comment).
class Filler {
 public:
  Filler(const ModelSources& sources, const BasePlan& plan, char* segment,
         std::vector<Piece> pieces, uint64_t scratch_per_thread)
      : sources_(sources),
        plan_(plan),
        segment_(segment),
        pieces_(std::move(pieces)),
        scratch_per_thread_(scratch_per_thread),
        tensors_(new TensorState[plan.tensors.size()]) {}
  Filler(const Filler&) = delete;
  Filler& operator=(const Filler&) = delete;

  Status Run(unsigned threads, const std::function<bool(const LoadProgress&)>& progress,
             FillStats* stats);

 private:
  struct TensorState {
    std::atomic<uint32_t> pieces_left{0};
    std::atomic<uint32_t> absmax_left{0};  // nvfp4: absmax pieces still to run
    std::atomic<uint32_t> absmax_bits{0};  // of a float >= 0: uint order is float order
    std::atomic<bool> scale_ready{false};  // set under mu_, after tensor_scale
    float tensor_scale = 0.0f;
  };

  void Work();
  Status RunPiece(size_t i, std::unique_ptr<char[]>* scratch);
  Status Quantize(size_t i, const Piece& p, char* scratch);
  // True once piece i's work cannot matter: the load was cancelled, or a piece
  // before it failed (whose error is the one reported).
  bool Stopped(size_t i) const {
    return cancelled_.load(std::memory_order_relaxed) ||
           first_error_.load(std::memory_order_acquire) < i;
  }
  void Fail(size_t i, Status st);
  void Finish(const Piece& p, uint64_t source_bytes);
  bool WaitForScale(const TensorState& ts, size_t i);
  LoadProgress Snapshot() const;

  const ModelSources& sources_;
  const BasePlan& plan_;
  char* const segment_;
  const std::vector<Piece> pieces_;
  const uint64_t scratch_per_thread_;
  const std::unique_ptr<TensorState[]> tensors_;
  unsigned threads_ = 0;
  uint32_t empty_tensors_ = 0;
  std::atomic<size_t> next_{0};  // the next piece to take
  std::atomic<bool> cancelled_{false};
  std::atomic<size_t> first_error_{std::numeric_limits<size_t>::max()};  // written under mu_
  std::atomic<uint64_t> bytes_done_{0};
  std::atomic<uint64_t> pieces_done_{0};
  std::atomic<uint32_t> tensors_done_{0};
  std::atomic<uint64_t> scratch_allocated_{0};
  std::mutex mu_;
  // Signalled when a tensor's scale is ready, a piece fails, the load is
  // cancelled, or a thread ends.
  std::condition_variable cv_;
  Status error_;          // Guarded by mu_: piece first_error_'s.
  unsigned running_ = 0;  // Guarded by mu_: threads not yet ended.
};

Status Filler::Run(unsigned threads, const std::function<bool(const LoadProgress&)>& progress,
                   FillStats* stats) {
  for (const Piece& p : pieces_) {
    TensorState& ts = tensors_[p.tensor];
    ts.pieces_left.fetch_add(1, std::memory_order_relaxed);
    if (p.kind == PieceKind::kAbsMax) ts.absmax_left.fetch_add(1, std::memory_order_relaxed);
  }
  for (size_t i = 0; i < plan_.tensors.size(); ++i) {
    const PlannedTensor& t = plan_.tensors[i];
    if (tensors_[i].pieces_left.load(std::memory_order_relaxed) == 0) ++empty_tensors_;
    // Written again once known (nvfp4); the other formats keep 0.
    if (t.quantized) *reinterpret_cast<float*>(segment_ + t.tensor_scale_offset) = 0.0f;
  }

  std::vector<std::thread> workers;
  workers.reserve(threads);
  for (unsigned k = 0; k < threads; ++k) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++running_;
    }
    try {
      workers.emplace_back([this, k] {
        char name[16];
        std::snprintf(name, sizeof(name), "ts-load-%u", k);
        platform::NameCurrentThread(name);
        Work();
      });
    } catch (const std::system_error&) {
      std::lock_guard<std::mutex> lock(mu_);
      --running_;  // fewer threads than asked: the ones that started do the work
      break;
    }
  }
  if (workers.empty()) {
    return Status(StatusCode::kResourceExhausted, "cannot start a base loader thread");
  }
  threads_ = static_cast<unsigned>(workers.size());
  {
    std::unique_lock<std::mutex> lock(mu_);
    while (running_ > 0) {
      cv_.wait_for(lock, std::chrono::milliseconds(10));
      if (running_ == 0 || !progress || cancelled_.load()) continue;
      lock.unlock();  // the callback may block on the client: never under mu_
      const bool go_on = progress(Snapshot());
      lock.lock();
      if (!go_on) {
        cancelled_.store(true);
        cv_.notify_all();
      }
    }
  }
  for (auto& w : workers) w.join();
  stats->threads = threads_;
  stats->scratch_peak_bytes = scratch_allocated_.load();
  stats->pieces = pieces_.size();
  stats->pieces_done = pieces_done_.load();
  if (cancelled_.load()) return Cancelled();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_.ok()) return error_;
  }
  if (progress && !progress(Snapshot())) return Cancelled();
  return Status::Ok();
}

LoadProgress Filler::Snapshot() const {
  LoadProgress p;
  p.bytes_read = bytes_done_.load(std::memory_order_relaxed);
  p.bytes_total = plan_.source_bytes;
  p.tensors_done = empty_tensors_ + tensors_done_.load(std::memory_order_relaxed);
  p.tensors_total = static_cast<uint32_t>(plan_.tensors.size());
  p.threads = threads_;
  return p;
}

void Filler::Work() {
  std::unique_ptr<char[]> scratch;  // this thread's, allocated at its first quantized piece
  for (;;) {
    const size_t i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i >= pieces_.size() || Stopped(i)) break;
    Status st = RunPiece(i, &scratch);
    // A piece that stopped because it could no longer matter reports nothing.
    if (!st.ok() && !Stopped(i)) Fail(i, std::move(st));
  }
  std::lock_guard<std::mutex> lock(mu_);
  --running_;
  cv_.notify_all();
}

void Filler::Fail(size_t i, Status st) {
  std::lock_guard<std::mutex> lock(mu_);
  if (i < first_error_.load(std::memory_order_relaxed)) {
    first_error_.store(i, std::memory_order_release);
    error_ = std::move(st);
  }
  cv_.notify_all();
}

Status Filler::RunPiece(size_t i, std::unique_ptr<char[]>* scratch) {
  const Piece& p = pieces_[i];
  const PlannedTensor& t = plan_.tensors[p.tensor];
  if (p.kind == PieceKind::kCopy) {
    Status st =
        ReadFully(sources_.files[t.file], t.src.name, t.src.begin + p.begin, p.end - p.begin,
                  segment_ + t.offset + p.begin, [this, i] { return Stopped(i); });
    if (!st.ok()) return st;
    Finish(p, p.end - p.begin);
    return Status::Ok();
  }
  if (!*scratch) {
    scratch->reset(new (std::nothrow) char[scratch_per_thread_]);
    if (!*scratch) {
      return Status(StatusCode::kResourceExhausted,
                    "cannot allocate " + std::to_string(scratch_per_thread_) +
                        " bytes of scratch to quantize tensor \"" + t.src.name + "\"");
    }
    scratch_allocated_.fetch_add(scratch_per_thread_, std::memory_order_relaxed);
  }
  return Quantize(i, p, scratch->get());
}

Status Filler::Quantize(size_t i, const Piece& p, char* scratch) {
  const PlannedTensor& t = plan_.tensors[p.tensor];
  const SourceFile& f = sources_.files[t.file];
  TensorState& ts = tensors_[p.tensor];
  const uint64_t esize = SafetensorsDTypeSize(t.src.dtype);
  const uint64_t first = p.begin * static_cast<uint64_t>(t.layout.block_size);
  const uint64_t n = PieceElements(t, p.begin, p.end);
  Status st = ReadFully(f, t.src.name, t.src.begin + first * esize, n * esize, scratch,
                        [this, i] { return Stopped(i); });
  if (!st.ok()) return st;
  const int64_t bad = FirstNonFinite(t.src.dtype, scratch, n);
  if (bad >= 0) {
    return Status(StatusCode::kInvalidArgument,
                  f.path + ": tensor \"" + t.src.name +
                      "\" has a non-finite value (NaN or inf) at element " +
                      std::to_string(first + static_cast<uint64_t>(bad)) +
                      "; only finite weights can be quantized (load it with format none)");
  }
  const void* src = scratch;
  kernels::DType type = kernels::DType::kBFloat16;
  if (t.src.dtype == SafetensorsDType::kF32) {
    type = kernels::DType::kFloat32;
  } else if (t.src.dtype == SafetensorsDType::kF16) {
    const auto* h = reinterpret_cast<const uint16_t*>(scratch);
    auto* out = reinterpret_cast<float*>(scratch + Fp32CopyOffset(n * esize));
    for (uint64_t k = 0; k < n; ++k) out[k] = HalfToFloat(h[k]);
    src = out;
    type = kernels::DType::kFloat32;
  }
  kernels::QuantCpuOptions one_thread;  // the other loader threads have the other cores
  one_thread.num_threads = 1;
  if (p.kind == PieceKind::kAbsMax) {
    uint32_t bits = 0;
    const float amax = kernels::AbsMaxCpu(type, src, static_cast<int64_t>(n), one_thread);
    std::memcpy(&bits, &amax, sizeof(bits));
    uint32_t seen = ts.absmax_bits.load(std::memory_order_relaxed);
    while (bits > seen && !ts.absmax_bits.compare_exchange_weak(seen, bits)) {
    }
    if (ts.absmax_left.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      const uint32_t all = ts.absmax_bits.load(std::memory_order_relaxed);
      float tensor_amax;
      std::memcpy(&tensor_amax, &all, sizeof(tensor_amax));
      ts.tensor_scale = kernels::Nvfp4TensorScale(tensor_amax);
      *reinterpret_cast<float*>(segment_ + t.tensor_scale_offset) = ts.tensor_scale;
      {
        std::lock_guard<std::mutex> lock(mu_);
        ts.scale_ready.store(true, std::memory_order_release);
      }
      cv_.notify_all();
    }
    Finish(p, 0);  // its bytes count once, when they are quantized
    return Status::Ok();
  }
  float tensor_scale = 0.0f;
  if (plan_.format == kernels::QuantFormat::kNvfp4) {
    if (!WaitForScale(ts, i)) return Cancelled();
    tensor_scale = ts.tensor_scale;
  }
  const kernels::QuantBuffers out{reinterpret_cast<uint8_t*>(segment_ + t.offset),
                                  segment_ + t.scales_offset, nullptr};
  kernels::QuantizeBlockRangeCpu(plan_.format, t.layout, type, src, static_cast<int64_t>(p.begin),
                                 static_cast<int64_t>(p.end), out, tensor_scale, one_thread);
  Finish(p, n * esize);
  return Status::Ok();
}

bool Filler::WaitForScale(const TensorState& ts, size_t i) {
  if (ts.scale_ready.load(std::memory_order_acquire)) return true;
  // The absmax pieces come before this one, so threads that never wait hold
  // them: this wait ends (or the load stops).
  std::unique_lock<std::mutex> lock(mu_);
  while (!ts.scale_ready.load(std::memory_order_acquire)) {
    if (Stopped(i)) return false;
    cv_.wait_for(lock, std::chrono::milliseconds(10));
  }
  return true;
}

void Filler::Finish(const Piece& p, uint64_t source_bytes) {
  bytes_done_.fetch_add(source_bytes, std::memory_order_relaxed);
  pieces_done_.fetch_add(1, std::memory_order_relaxed);
  if (tensors_[p.tensor].pieces_left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  // The tensor is complete: its checkpoint pages are not needed again.
  const PlannedTensor& t = plan_.tensors[p.tensor];
  sources_.files[t.file].file.DropFromCache(t.src.begin, t.src.bytes());
  tensors_done_.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

unsigned FillThreads(const BasePlan& plan, const FillOptions& options) {
  return ThreadsFor(MakePieces(plan, PieceBytes(options)).size(), options);
}

uint64_t FillScratchBytes(const BasePlan& plan, const FillOptions& options) {
  return FillThreads(plan, options) * ScratchPerThread(plan, PieceBytes(options));
}

Status FillBase(const ModelSources& sources, const BasePlan& plan, const std::string& key,
                char* segment, const FillOptions& options,
                const std::function<bool(const LoadProgress&)>& progress, FillStats* stats) {
  *stats = FillStats{};
  Status st = WriteBaseManifest(plan, key, segment);
  if (!st.ok()) return st;
  const uint64_t piece_bytes = PieceBytes(options);
  std::vector<Piece> pieces = MakePieces(plan, piece_bytes);
  const unsigned threads = ThreadsFor(pieces.size(), options);
  Filler filler(sources, plan, segment, std::move(pieces), ScratchPerThread(plan, piece_bytes));
  return filler.Run(threads, progress, stats);
}

}  // namespace trainstream::daemon::base
