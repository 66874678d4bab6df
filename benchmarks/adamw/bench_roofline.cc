// trainstream-bench-roofline: the host's DRAM ceiling for the AdamW engine's access
// patterns. Each worker streams over its own contiguous range (first touched by
// itself), with the engine's byte pattern per element and next to no arithmetic, so
// the figure is what memory allows, not what the update's math costs:
//
//   adamw-fp32  read p, g, m, v (fp32); write p, m, v in place       28 B/element
//   adamw-bf16  read p (fp32), g, m, v (bf16); write p, m, v in
//               place, and a bf16 weight copy with streaming stores  20 B/element
//   read        sum one fp32 array                                    4 B/element
//   write       fill one fp32 array with streaming stores             4 B/element
//
// The AdamW engine cannot update faster than `gb_s / bytes` parameters a second
// (docs/adamw.md compares its figures to these). Not a test: figures depend on the
// machine.
//
//   trainstream-bench-roofline --elems 67108864 --threads 1,4,8,16 --iters 10 [--json]
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "bench_args.h"
#include "trainstream/optimizer/worker_pool.h"

namespace {

namespace to = trainstream::optimizer;
namespace bench = trainstream::bench;

constexpr size_t kAlign = 64;  // elements per range boundary: whole cache lines

struct Args {
  size_t elems = size_t{1} << 26;
  std::vector<unsigned> threads{0};
  std::vector<std::string> patterns{"adamw-fp32", "adamw-bf16", "read", "write"};
  int iters = 10;
  int warmup = 2;
  bool json = false;
};

[[noreturn]] void Usage(const char* msg) {
  std::fprintf(stderr,
               "%s\nusage: trainstream-bench-roofline [--elems N] [--threads 1,2,...|0=physical "
               "cores] [--patterns adamw-fp32,adamw-bf16,read,write] [--iters N] [--warmup N] "
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
    try {
      if (flag == "--elems") {
        a.elems = std::stoull(value());
      } else if (flag == "--threads") {
        a.threads.clear();
        for (const auto& t : bench::SplitCommas(value())) a.threads.push_back(std::stoul(t));
      } else if (flag == "--patterns") {
        a.patterns = bench::SplitCommas(value());
      } else if (flag == "--iters") {
        a.iters = std::stoi(value());
      } else if (flag == "--warmup") {
        a.warmup = std::stoi(value());
      } else if (flag == "--json") {
        a.json = true;
      } else {
        Usage(("unknown flag " + flag).c_str());
      }
    } catch (const std::logic_error&) {
      Usage(("bad value for " + flag).c_str());
    }
  }
  if (a.elems < kAlign) Usage("--elems must be at least 64");
  if (a.iters < 1 || a.warmup < 0) Usage("--iters must be >= 1 and --warmup >= 0");
  for (const auto& p : a.patterns) {
    if (p != "adamw-fp32" && p != "adamw-bf16" && p != "read" && p != "write")
      Usage(("unknown pattern " + p + " (accepted: adamw-fp32, adamw-bf16, read, write)").c_str());
  }
  return a;
}

double BytesPerElem(const std::string& pattern) {
  if (pattern == "adamw-fp32") return 28;
  if (pattern == "adamw-bf16") return 20;
  return 4;
}

void StreamStore4f(float* dst, const float* src) {
#if defined(__SSE2__)
  _mm_stream_ps(dst, _mm_loadu_ps(src));
#else
  std::memcpy(dst, src, 16);
#endif
}

// The arrays of one pattern; each worker owns [begin, end) of every one.
struct Arrays {
  float* p = nullptr;
  float* g = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  uint16_t* g16 = nullptr;
  uint16_t* m16 = nullptr;
  uint16_t* v16 = nullptr;
  uint16_t* slot = nullptr;
  double sink = 0;  // keeps the read pattern's sum alive
};

#if defined(__AVX512F__)
constexpr size_t kLanes = 16;
using VecF = __m512;
inline VecF LoadF(const float* x) { return _mm512_loadu_ps(x); }
inline void StoreF(float* x, VecF v) { _mm512_storeu_ps(x, v); }
inline VecF Fma(VecF a, float b, VecF c) { return _mm512_fmadd_ps(a, _mm512_set1_ps(b), c); }
inline VecF Add(VecF a, VecF b) { return _mm512_add_ps(a, b); }
inline VecF Zero() { return _mm512_setzero_ps(); }
inline float Sum(VecF v) { return _mm512_reduce_add_ps(v); }
inline VecF LoadBf16(const uint16_t* x) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m256i Truncate(VecF v) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
}
inline void StoreBf16(uint16_t* x, VecF v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), Truncate(v));
}
inline void StreamBf16(uint16_t* x, VecF v) {
  _mm256_stream_si256(reinterpret_cast<__m256i*>(x), Truncate(v));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr size_t kLanes = 8;
using VecF = __m256;
inline VecF LoadF(const float* x) { return _mm256_loadu_ps(x); }
inline void StoreF(float* x, VecF v) { _mm256_storeu_ps(x, v); }
inline VecF Fma(VecF a, float b, VecF c) { return _mm256_fmadd_ps(a, _mm256_set1_ps(b), c); }
inline VecF Add(VecF a, VecF b) { return _mm256_add_ps(a, b); }
inline VecF Zero() { return _mm256_setzero_ps(); }
inline float Sum(VecF v) {
  alignas(32) float x[8];
  _mm256_store_ps(x, v);
  return x[0] + x[1] + x[2] + x[3] + x[4] + x[5] + x[6] + x[7];
}
inline VecF LoadBf16(const uint16_t* x) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m128i Truncate(VecF v) {
  const __m256i u = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
}
inline void StoreBf16(uint16_t* x, VecF v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(x), Truncate(v));
}
inline void StreamBf16(uint16_t* x, VecF v) {
  _mm_stream_si128(reinterpret_cast<__m128i*>(x), Truncate(v));
}
#else
#define TRAINSTREAM_ROOFLINE_SCALAR 1
#endif

#if defined(TRAINSTREAM_ROOFLINE_SCALAR)
void Fp32Range(Arrays& a, size_t begin, size_t end) {
  float* __restrict p = a.p;
  const float* __restrict g = a.g;
  float* __restrict m = a.m;
  float* __restrict v = a.v;
  for (size_t i = begin; i < end; ++i) {
    const float mi = m[i] * 0.9f + g[i];
    const float vi = v[i] * 0.999f + g[i];
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] + mi * 1e-3f;
  }
}

float Bits2F(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

uint32_t F2Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

void Bf16Range(Arrays& a, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    const float gi = Bits2F(uint32_t{a.g16[i]} << 16);
    const float mi = Bits2F(uint32_t{a.m16[i]} << 16) * 0.9f + gi;
    const float vi = Bits2F(uint32_t{a.v16[i]} << 16) * 0.999f + gi;
    a.m16[i] = static_cast<uint16_t>(F2Bits(mi) >> 16);
    a.v16[i] = static_cast<uint16_t>(F2Bits(vi) >> 16);
    a.p[i] = a.p[i] + mi * 1e-3f;
    a.slot[i] = static_cast<uint16_t>(F2Bits(a.p[i]) >> 16);
  }
}

void ReadRange(Arrays& a, size_t begin, size_t end, double* out) {
  float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (size_t i = begin; i < end; i += 4) {
    s0 += a.p[i];
    s1 += a.p[i + 1];
    s2 += a.p[i + 2];
    s3 += a.p[i + 3];
  }
  *out = static_cast<double>(s0 + s1 + s2 + s3);
}
#else
// Ranges are multiples of 64 elements and the arrays page-aligned: whole vectors,
// aligned streaming stores.
void Fp32Range(Arrays& a, size_t begin, size_t end) {
  for (size_t i = begin; i < end; i += kLanes) {
    const VecF g = LoadF(a.g + i);
    const VecF m = Fma(LoadF(a.m + i), 0.9f, g);
    const VecF v = Fma(LoadF(a.v + i), 0.999f, g);
    StoreF(a.m + i, m);
    StoreF(a.v + i, v);
    StoreF(a.p + i, Fma(m, 1e-3f, LoadF(a.p + i)));
  }
}

void Bf16Range(Arrays& a, size_t begin, size_t end) {
  for (size_t i = begin; i < end; i += kLanes) {
    const VecF g = LoadBf16(a.g16 + i);
    const VecF m = Fma(LoadBf16(a.m16 + i), 0.9f, g);
    const VecF v = Fma(LoadBf16(a.v16 + i), 0.999f, g);
    StoreBf16(a.m16 + i, m);
    StoreBf16(a.v16 + i, v);
    const VecF p = Fma(m, 1e-3f, LoadF(a.p + i));
    StoreF(a.p + i, p);
    StreamBf16(a.slot + i, p);
  }
}

void ReadRange(Arrays& a, size_t begin, size_t end, double* out) {
  VecF s0 = Zero(), s1 = Zero(), s2 = Zero(), s3 = Zero();
  for (size_t i = begin; i < end; i += 4 * kLanes) {
    s0 = Add(s0, LoadF(a.p + i));
    s1 = Add(s1, LoadF(a.p + i + kLanes));
    s2 = Add(s2, LoadF(a.p + i + 2 * kLanes));
    s3 = Add(s3, LoadF(a.p + i + 3 * kLanes));
  }
  *out = static_cast<double>(Sum(Add(Add(s0, s1), Add(s2, s3))));
}
#endif

void WriteRange(Arrays& a, size_t begin, size_t end) {
  alignas(16) const float zeros[4] = {0, 0, 0, 0};
  for (size_t i = begin; i < end; i += 4) StreamStore4f(a.p + i, zeros);
}

void* MapOrDie(size_t bytes) {
  void* ptr = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (ptr == MAP_FAILED) {
    std::fprintf(stderr, "out of memory mapping %zu bytes\n", bytes);
    std::exit(1);
  }
  madvise(ptr, bytes, MADV_HUGEPAGE);
  return ptr;
}

// Runs fn(worker, begin, end) on every worker over its range and waits for all.
template <typename Fn>
void OnEveryWorker(to::WorkerPool& pool, size_t elems, Fn fn) {
  const unsigned n = pool.size();
  const size_t per = (elems / n + kAlign - 1) / kAlign * kAlign;
  std::mutex mu;
  std::condition_variable cv;
  unsigned left = n;
  for (unsigned w = 0; w < n; ++w) {
    const size_t begin = std::min(elems, w * per);
    const size_t end = std::min(elems, begin + per);
    pool.Submit(w, [&, w, begin, end] {
      fn(w, begin, end);
      std::lock_guard<std::mutex> lock(mu);
      if (--left == 0) cv.notify_one();
    });
  }
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return left == 0; });
}

void RunPattern(const Args& args, to::WorkerPool& pool, const std::string& pattern) {
  const size_t n = args.elems / kAlign * kAlign;
  Arrays a;
  const bool fp32 = pattern == "adamw-fp32", bf16 = pattern == "adamw-bf16";
  std::vector<std::pair<void*, size_t>> maps;
  auto map = [&](size_t bytes) {
    maps.emplace_back(MapOrDie(bytes), bytes);
    return maps.back().first;
  };
  a.p = static_cast<float*>(map(n * 4));
  if (fp32) {
    a.g = static_cast<float*>(map(n * 4));
    a.m = static_cast<float*>(map(n * 4));
    a.v = static_cast<float*>(map(n * 4));
  }
  if (bf16) {
    a.g16 = static_cast<uint16_t*>(map(n * 2));
    a.m16 = static_cast<uint16_t*>(map(n * 2));
    a.v16 = static_cast<uint16_t*>(map(n * 2));
    a.slot = static_cast<uint16_t*>(map(n * 2));
  }
  // First touch by the worker that streams the range (its NUMA node).
  OnEveryWorker(pool, n, [&](unsigned, size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      a.p[i] = 1.0f;
      if (fp32) a.g[i] = a.m[i] = a.v[i] = 0.5f;
      if (bf16) a.g16[i] = a.m16[i] = a.v16[i] = a.slot[i] = 0x3f00;  // 0.5
    }
  });
  std::vector<double> sums(pool.size());
  auto pass = [&] {
    OnEveryWorker(pool, n, [&](unsigned w, size_t b, size_t e) {
      if (fp32)
        Fp32Range(a, b, e);
      else if (bf16)
        Bf16Range(a, b, e);
      else if (pattern == "read")
        ReadRange(a, b, e, &sums[w]);
      else
        WriteRange(a, b, e);
    });
    _mm_sfence();
  };
  for (int i = 0; i < args.warmup; ++i) pass();
  double best = 1e30;
  for (int i = 0; i < args.iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    pass();
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  for (double s : sums) a.sink += s;
  const double bytes = BytesPerElem(pattern) * static_cast<double>(n);
  const double gb_s = bytes / best / 1e9;
  const double gelems_s = static_cast<double>(n) / best / 1e9;
  if (args.json) {
    std::printf(
        "{\"pattern\": \"%s\", \"elems\": %zu, \"threads\": %u, \"bytes_per_elem\": %.0f, "
        "\"best_s\": %.6f, \"gb_s\": %.2f, \"gelems_per_s\": %.4f, \"sink\": %.1f}\n",
        pattern.c_str(), n, pool.size(), BytesPerElem(pattern), best, gb_s, gelems_s, a.sink);
  } else {
    std::printf("%-11s %3u threads  %7.2f GB/s  %6.3f Gelem/s (%2.0f B/elem, best of %d)\n",
                pattern.c_str(), pool.size(), gb_s, gelems_s, BytesPerElem(pattern), args.iters);
  }
  std::fflush(stdout);
  for (auto& [ptr, bytes] : maps) munmap(ptr, bytes);
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = Parse(argc, argv);
  for (unsigned t : args.threads) {
    to::WorkerPool pool(to::WorkerPoolOptions{t, /*pin_to_cores=*/true});
    for (const auto& pattern : args.patterns) RunPattern(args, pool, pattern);
  }
  return 0;
}
