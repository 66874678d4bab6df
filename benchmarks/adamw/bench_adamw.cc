// trainstream-bench-adamw: AdamW engine throughput (parameters updated per second
// and the DRAM traffic that implies) for given sizes, threads and precisions.
// Not a test: figures depend on the machine. bench_torch_adamw.py runs this and
// torch's CPU AdamW on the same sizes and prints the ratios.
//
//   trainstream-bench-adamw --params 67108864 --tensor-elems 4194304 --threads 1,2
//       --grad-dtype fp32,bf16 --moment-dtype fp32,bf16 --param-dtype bf16,master --iters 10 --json
//
// --param-dtype master: fp32 parameters whose slot is the master itself (no
// separate weight copy; what torch's own fp32 AdamW does); bf16-split: bf16 parameters
// whose slot is the fp32 master's upper half (Note [Split master]). --check chunk (the
// default) uses the engine's per-chunk eager check (one gradient read);
// --check param the exact per-parameter check (two reads for multi-chunk tensors).
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench_args.h"
#include "trainstream/kernels/adamw.h"
#include "trainstream/kernels/bf16.h"
#include "trainstream/kernels/cpu_features.h"
#include "trainstream/optimizer/adamw_engine.h"
#include "trainstream/optimizer/worker_pool.h"

namespace {

namespace tk = trainstream::kernels;
namespace to = trainstream::optimizer;
namespace bench = trainstream::bench;

struct Args {
  size_t params = size_t{1} << 26;
  size_t tensor_elems = size_t{1} << 22;
  size_t chunk_elems = 0;  // 0: the engine's default
  std::vector<unsigned> threads{0};
  std::vector<std::string> grad_dtypes{"fp32"}, moment_dtypes{"fp32"}, param_dtypes{"bf16"};
  std::string isa = "auto";
  std::string mode = "eager";   // eager | deferred (clipping on)
  std::string check = "chunk";  // eager non-finite check: chunk | param
  bool pin = true;
  bool durable = false;  // commit records and the redo journal (docs/recovery.md)
  int iters = 10;
  int warmup = 2;
  bool json = false;
};

[[noreturn]] void Usage(const char* msg) {
  std::fprintf(
      stderr,
      "%s\nusage: trainstream-bench-adamw [--params N] [--tensor-elems N] [--threads "
      "1,2,...|0=physical cores] [--grad-dtype fp32,bf16,fp16] [--moment-dtype fp32,bf16] "
      "[--param-dtype fp32,bf16,fp16,master,bf16-split] [--isa auto|scalar|avx2|avx512] [--mode "
      "eager|deferred] [--check chunk|param] [--chunk-elems N (0: engine default)] [--pin 0|1] "
      "[--durable 0|1 (recovery records; needs --check param)] [--iters N] [--warmup N] "
      "[--json]\n",
      msg);
  std::exit(2);
}

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) Usage(("missing value for " + flag).c_str());
      return argv[++i];
    };
    if (flag == "--params")
      a.params = std::stoull(value());
    else if (flag == "--tensor-elems")
      a.tensor_elems = std::stoull(value());
    else if (flag == "--threads") {
      a.threads.clear();
      for (const auto& t : bench::SplitCommas(value()))
        a.threads.push_back(static_cast<unsigned>(std::stoul(t)));
    } else if (flag == "--grad-dtype")
      a.grad_dtypes = bench::SplitCommas(value());
    else if (flag == "--moment-dtype")
      a.moment_dtypes = bench::SplitCommas(value());
    else if (flag == "--param-dtype")
      a.param_dtypes = bench::SplitCommas(value());
    else if (flag == "--isa")
      a.isa = value();
    else if (flag == "--mode")
      a.mode = value();
    else if (flag == "--check")
      a.check = value();
    else if (flag == "--chunk-elems")
      a.chunk_elems = std::stoull(value());
    else if (flag == "--pin")
      a.pin = value() != "0";
    else if (flag == "--durable")
      a.durable = value() == "1";
    else if (flag == "--iters")
      a.iters = std::stoi(value());
    else if (flag == "--warmup")
      a.warmup = std::stoi(value());
    else if (flag == "--json")
      a.json = true;
    else if (flag == "--help" || flag == "-h")
      Usage("");
    else
      Usage(("unknown flag " + flag).c_str());
  }
  if (a.mode != "eager" && a.mode != "deferred") Usage("--mode must be eager or deferred");
  if (a.check != "chunk" && a.check != "param") Usage("--check must be chunk or param");
  if (a.durable && a.check != "param") Usage("--durable 1 needs --check param");
  if (a.params == 0 || a.tensor_elems == 0 || a.iters <= 0) Usage("sizes and iters must be > 0");
  return a;
}

tk::DType DTypeOrDie(const std::string& s) {
  tk::DType d;
  if (!tk::ParseDType(s, &d)) {
    Usage(
        ("unknown dtype " + s + " (accepted: " + std::string(trainstream::wire::kDTypeNames) + ")")
            .c_str());
  }
  return d;
}

void* AllocUntouched(size_t bytes) {
  // Page-aligned and not written here: the engine's Init touches it first.
  // 2 MiB-aligned and advised for transparent huge pages (fewer TLB misses
  // over six streams per core), where the kernel allows it.
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t size = (bytes + kHuge - 1) / kHuge * kHuge;
  void* p = std::aligned_alloc(kHuge, size);
  if (!p) {
    std::fprintf(stderr, "out of memory allocating %zu bytes\n", bytes);
    std::exit(1);
  }
  madvise(p, size, MADV_HUGEPAGE);  // best effort
  return p;
}

// out_is_master: fp32 parameters whose slot is the master; split: bf16 parameters whose
// slot is the master's upper half (Note [Split master] in kernels/bf16.h).
void RunOne(const Args& a, unsigned threads, tk::DType gd, tk::DType md, tk::DType pd,
            bool out_is_master, bool split, tk::Isa isa) {
  to::WorkerPool pool(to::WorkerPoolOptions{threads, a.pin});
  to::EngineOptions opt;
  opt.moment_dtype = md;
  opt.isa = isa;
  opt.max_grad_norm = a.mode == "deferred" ? 1e9 : 0;  // deferred path, coefficient stays 1
  opt.eager_check_per_chunk = a.check == "chunk";
  if (a.chunk_elems != 0) opt.chunk_elems = a.chunk_elems;
  to::AdamWEngine engine(&pool, opt);

  std::vector<void*> allocations;
  size_t left = a.params;
  uint64_t id = 0;
  // A table of realistic magnitudes, tiled (values do not change speed; a
  // per-element generator would dominate the benchmark's run time).
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.f, 1e-3f);
  std::vector<float> table((size_t{1} << 20) + 7);
  for (float& f : table) f = normal(rng);
  size_t table_pos = 0;
  // --durable: the records a state segment holds (Note [Optimizer state
  // outlives the daemon]), here in process memory; sized before any is handed out.
  const size_t tensors = (a.params + a.tensor_elems - 1) / a.tensor_elems;
  const size_t chunk = std::max<size_t>(opt.chunk_elems, 64);
  const uint64_t slot_bytes =
      trainstream::wire::JournalSlotLayoutFor(trainstream::wire::kSubChunkElems, tk::DTypeSize(md))
          .bytes;
  auto header = std::make_unique<trainstream::wire::RecoveryHeader>();
  std::vector<trainstream::wire::ParamRecord> records(a.durable ? tensors : 0);
  std::vector<trainstream::wire::ChunkProgress> progress(
      a.durable ? tensors * ((a.tensor_elems + chunk - 1) / chunk) : 0);
  std::vector<uint64_t> torch_steps(tensors);
  std::vector<char> journal(a.durable ? pool.size() * slot_bytes : 0);
  size_t chunks_used = 0;
  while (left > 0) {
    const size_t n = std::min(left, a.tensor_elems);
    to::ParamBinding b;
    b.param_id = id++;
    b.numel = n;
    b.param_dtype = pd;
    b.grad_dtype = gd;
    if (split)
      b.master_lo = static_cast<uint16_t*>(AllocUntouched(n * 2));
    else
      b.master = static_cast<float*>(AllocUntouched(n * 4));
    b.exp_avg = AllocUntouched(n * tk::DTypeSize(md));
    b.exp_avg_sq = AllocUntouched(n * tk::DTypeSize(md));
    void* grad = AllocUntouched(n * tk::DTypeSize(gd));
    b.grad_slot = grad;
    b.param_slot =
        out_is_master ? static_cast<void*>(b.master) : AllocUntouched(n * tk::DTypeSize(pd));
    std::vector<float> tmp(n);
    for (float& f : tmp) {
      f = table[table_pos];
      table_pos = table_pos + 1 == table.size() ? 0 : table_pos + 1;
    }
    for (size_t i = 0; i < n; ++i) {
      if (gd == tk::DType::kFloat32)
        static_cast<float*>(grad)[i] = tmp[i];
      else if (gd == tk::DType::kBFloat16)
        static_cast<uint16_t*>(grad)[i] = tk::FloatToBf16Rne(tmp[i]);
      else
        static_cast<uint16_t*>(grad)[i] = tk::FloatToFp16Rne(tmp[i]);
      const float w = tmp[i] * 1000;
      if (pd == tk::DType::kFloat32)
        static_cast<float*>(b.param_slot)[i] = w;
      else if (pd == tk::DType::kBFloat16)
        static_cast<uint16_t*>(b.param_slot)[i] = tk::FloatToBf16Rne(w);
      else
        static_cast<uint16_t*>(b.param_slot)[i] = tk::FloatToFp16Rne(w);
    }
    for (void* p : {split ? static_cast<void*>(b.master_lo) : static_cast<void*>(b.master),
                    b.exp_avg, b.exp_avg_sq, grad}) {
      allocations.push_back(p);
    }
    if (!out_is_master) allocations.push_back(b.param_slot);
    if (a.durable) {
      to::DurableRecords& d = b.durable;
      d.record = &records[b.param_id];
      d.record->chunks = (n + chunk - 1) / chunk;
      d.progress = &progress[chunks_used];
      chunks_used += d.record->chunks;
      d.torch_step = &torch_steps[b.param_id];
      d.entry = b.param_id;
      d.journal = journal.data();
      d.journal_slot_bytes = slot_bytes;
      d.journal_slots = pool.size();
      d.header = header.get();
    }
    if (trainstream::Status st = engine.AddParam(b); !st.ok()) Usage(st.message().c_str());
    left -= n;
  }
  engine.Init();

  tk::AdamWHyperParams hp;
  auto run_step = [&](uint64_t step) {
    for (uint64_t p = 0; p < id; ++p) engine.SubmitGrad(p, step, hp);
    engine.StepEnd(step);
    engine.WaitIdle();
  };
  uint64_t step = 1;
  for (int i = 0; i < a.warmup; ++i) run_step(step++);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < a.iters; ++i) run_step(step++);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / a.iters;

  // Bytes each parameter moves through DRAM per step: the update reads master,
  // gradient and moments and writes master, moments and the weight copy (if
  // any, stored non-temporally); the exact per-parameter check (or deferred
  // mode) reads multi-chunk gradients a second time. A split master is 2 + 2 bytes
  // read and written, its upper half being the weight copy.
  const bool second_grad_read =
      (a.mode == "deferred" || a.check == "param") && a.tensor_elems > opt.chunk_elems;
  const double bytes = 4.0 * 2 + (second_grad_read ? 2.0 : 1.0) * tk::DTypeSize(gd) +
                       4.0 * tk::DTypeSize(md) + (out_is_master || split ? 0 : tk::DTypeSize(pd));
  const char* pname = out_is_master ? "master" : split ? "bf16-split" : tk::DTypeName(pd);
  const double gparams = static_cast<double>(a.params) / seconds / 1e9;
  if (a.json) {
    std::printf(
        "{\"bench\": \"adamw\", \"params\": %zu, \"tensor_elems\": %zu, \"threads\": %u, "
        "\"grad_dtype\": \"%s\", \"moment_dtype\": \"%s\", \"param_dtype\": \"%s\", \"isa\": "
        "\"%s\", \"mode\": \"%s\", \"check\": \"%s\", \"durable\": %s, \"iters\": %d, "
        "\"seconds_per_step\": %.6f, \"gparams_per_s\": %.4f, \"bytes_per_param\": %.0f, "
        "\"gb_per_s\": %.2f}\n",
        a.params, a.tensor_elems, pool.size(), tk::DTypeName(gd), tk::DTypeName(md), pname,
        tk::IsaName(isa), a.mode.c_str(), a.check.c_str(), a.durable ? "true" : "false", a.iters,
        seconds, gparams, bytes, gparams * bytes);
  } else {
    std::printf(
        "threads %2u  grad %-4s moments %-4s param %-6s isa %-6s %s/%s%s: %8.3f ms/step  %6.3f "
        "Gparam/s  %6.1f GB/s (%.0f B/param)\n",
        pool.size(), tk::DTypeName(gd), tk::DTypeName(md), pname, tk::IsaName(isa), a.mode.c_str(),
        a.check.c_str(), a.durable ? "/durable" : "", seconds * 1e3, gparams, gparams * bytes,
        bytes);
  }
  std::fflush(stdout);
  for (void* p : allocations) std::free(p);
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = Parse(argc, argv);
  tk::Isa isa = tk::BestIsa();
  if (a.isa != "auto") {
    if (!tk::ParseIsa(a.isa, &isa)) Usage(("unknown isa " + a.isa).c_str());
    if (!tk::IsaSupported(isa)) Usage(("this CPU cannot run isa " + a.isa).c_str());
  }
  for (unsigned t : a.threads) {
    for (const auto& g : a.grad_dtypes) {
      for (const auto& m : a.moment_dtypes) {
        for (const auto& p : a.param_dtypes) {
          const bool master = p == "master", split = p == "bf16-split";
          const tk::DType pd = master  ? tk::DType::kFloat32
                               : split ? tk::DType::kBFloat16
                                       : DTypeOrDie(p);
          RunOne(a, t, DTypeOrDie(g), DTypeOrDie(m), pd, master, split, isa);
        }
      }
    }
  }
  return 0;
}
