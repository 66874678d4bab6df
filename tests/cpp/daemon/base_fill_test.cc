// FillBase (daemon/base/base_fill.h): the segment a load writes does not depend on
// the threads or the piece size, every quantized tensor is QuantizeCpu's bytes of
// the whole tensor, errors name the file, the tensor and (non-finite values) the
// first bad element whatever the threads, the scratch stays within what
// FillScratchBytes promised the budget, and a cancelled load stops.
#include "base/base_fill.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "base/base_loader.h"
#include "base/model_sources.h"
#include "catch_compat.h"
#include "shard_files.h"
#include "trainstream/kernels/quant.h"

using namespace trainstream::daemon::base;
using trainstream::daemon::base::testing::AddShard;
namespace tk = trainstream::kernels;
using trainstream::Status;
using trainstream::StatusCode;

namespace {

struct TestTensor {
  std::string name;
  std::string dtype;  // the header's spelling
  std::vector<int64_t> shape;
  std::string bytes;
};

uint64_t Numel(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

// Random finite values (about N(0, 1)) of `dtype`, as the checkpoint's bytes.
std::string RandomBytes(const std::string& dtype, uint64_t n, std::mt19937* rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::string out;
  for (uint64_t i = 0; i < n; ++i) {
    const float v = normal(*rng);
    uint32_t f;
    std::memcpy(&f, &v, 4);
    if (dtype == "F32") {
      out.append(reinterpret_cast<const char*>(&f), 4);
    } else if (dtype == "BF16") {
      const uint16_t b = static_cast<uint16_t>(f >> 16);
      out.append(reinterpret_cast<const char*>(&b), 2);
    } else if (dtype == "F16") {
      // A half with a random sign, exponent 10..20 and mantissa: finite, normal.
      const uint16_t h =
          static_cast<uint16_t>(((f >> 16) & 0x8000u) | ((10 + rng->operator()() % 11) << 10) |
                                (rng->operator()() & 0x3ffu));
      out.append(reinterpret_cast<const char*>(&h), 2);
    } else {  // I64 and other dtypes: any bytes
      for (int k = 0; k < 8; ++k) out.push_back(static_cast<char>(rng->operator()()));
    }
  }
  return out;
}

std::string SafetensorsFile(const std::vector<TestTensor>& tensors) {
  std::string json = "{", data;
  for (const auto& t : tensors) {
    std::string shape;
    for (int64_t d : t.shape) shape += (shape.empty() ? "" : ",") + std::to_string(d);
    json += (json.size() > 1 ? "," : "") +
            ("\"" + t.name + "\":{\"dtype\":\"" + t.dtype + "\",\"shape\":[" + shape +
             "],\"data_offsets\":[" + std::to_string(data.size()) + "," +
             std::to_string(data.size() + t.bytes.size()) + "]}");
    data += t.bytes;
  }
  json += "}";
  std::string out(8, '\0');
  const uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + json + data;
}

// Two shards of block weights (sizes that are no multiple of any block), norms,
// an embedding and an integer tensor.
std::vector<std::vector<TestTensor>> Checkpoint(const std::string& dtype, uint32_t seed) {
  std::mt19937 rng(seed);
  auto make = [&](const std::string& name, const std::string& dt, std::vector<int64_t> shape) {
    TestTensor t{name, dt, shape, ""};
    t.bytes = RandomBytes(dt, Numel(shape), &rng);
    return t;
  };
  return {{make("model.embed_tokens.weight", dtype, {50, 64}),
           make("model.layers.0.input_layernorm.weight", dtype, {257}),
           make("model.layers.0.mlp.up_proj.weight", dtype, {300, 257}),
           make("model.layers.0.self_attn.o_proj.weight", dtype, {40, 25})},
          {make("model.layers.1.mlp.down_proj.weight", dtype, {128, 512}),
           make("model.layers.1.position", "I64", {33}), make("model.norm.weight", dtype, {64})}};
}

ModelSources Open(const std::vector<std::vector<TestTensor>>& shards) {
  ModelSources sources;
  for (const auto& shard : shards) AddShard(SafetensorsFile(shard), &sources);
  return sources;
}

BasePlan Plan(const ModelSources& sources, const std::string& format, int64_t block) {
  BasePlan plan;
  REQUIRE(ParseBaseFormat(format, block, &plan).ok());
  REQUIRE(PlanBase(sources, &plan).ok());
  return plan;
}

struct Filled {
  Status status;
  std::vector<char> segment;
  FillStats stats;
};

Filled Fill(const ModelSources& sources, const BasePlan& plan, unsigned threads,
            uint64_t piece_bytes) {
  Filled out;
  out.segment.assign(plan.total_bytes, 0);
  FillOptions options;
  options.threads = threads;
  options.piece_bytes = piece_bytes;
  out.status = FillBase(sources, plan, "key", out.segment.data(), options, nullptr, &out.stats);
  return out;
}

float HalfBitsToFloat(uint16_t h) {
  const int exp = (h >> 10) & 0x1f;
  const float mag = exp == 0 ? std::ldexp(static_cast<float>(h & 0x3ff), -24)
                             : std::ldexp(static_cast<float>((h & 0x3ff) | 0x400), exp - 25);
  return (h & 0x8000) ? -mag : mag;
}

const char* const kFormats[] = {"int8", "nf4", "fp8", "nvfp4"};

}  // namespace

TEST_CASE("1 thread and N threads, any piece size, write the same segment", "[base_fill]") {
  for (const std::string dtype : {"BF16", "F32", "F16"}) {
    const auto shards = Checkpoint(dtype, 11);
    const ModelSources sources = Open(shards);
    for (const std::string format : {"none", "int8", "nf4", "fp8", "nvfp4"}) {
      const int64_t block = format == "int8" ? 126 : 64;
      const BasePlan plan = Plan(sources, format, block);
      INFO(dtype << " " << format);
      const Filled one = Fill(sources, plan, 1, 0);
      REQUIRE(one.status.ok());
      CHECK(one.stats.threads == 1);
      // 1000 bytes: not a whole number of blocks; 64: less than one block.
      for (auto [threads, piece] : {std::pair<unsigned, uint64_t>{4, 1000}, {3, 64}, {2, 0}}) {
        INFO(threads << " threads, " << piece << "-byte pieces");
        const Filled many = Fill(sources, plan, threads, piece);
        REQUIRE(many.status.ok());
        CHECK(many.stats.threads == threads);
        CHECK(many.stats.pieces_done == many.stats.pieces);
        REQUIRE(many.segment == one.segment);
      }
    }
  }
}

TEST_CASE("Quantized tensors are QuantizeCpu's bytes, the others the checkpoint's", "[base_fill]") {
  for (const std::string dtype : {"BF16", "F32", "F16"}) {
    const auto shards = Checkpoint(dtype, 5);
    const ModelSources sources = Open(shards);
    for (const std::string format : kFormats) {
      const int64_t block = format == "int8" ? 126 : 64;
      const BasePlan plan = Plan(sources, format, block);
      const Filled got = Fill(sources, plan, 4, 1000);
      REQUIRE(got.status.ok());
      INFO(dtype << " " << format);
      size_t k = 0;
      CHECK(plan.quantized_tensors == 3);
      for (const auto& shard : shards) {
        for (const auto& src : shard) {
          const PlannedTensor& t = plan.tensors[k++];
          REQUIRE(t.src.name == src.name);
          const char* at = got.segment.data() + t.offset;
          if (!t.quantized) {
            CHECK(std::string(at, t.bytes) == src.bytes);
            continue;
          }
          const uint64_t n = Numel(src.shape);
          std::vector<float> f32(n);
          tk::DType type = tk::DType::kFloat32;
          const void* in = f32.data();
          if (dtype == "F32") {
            std::memcpy(f32.data(), src.bytes.data(), n * 4);
          } else if (dtype == "F16") {
            for (uint64_t i = 0; i < n; ++i) {
              uint16_t h;
              std::memcpy(&h, src.bytes.data() + 2 * i, 2);
              f32[i] = HalfBitsToFloat(h);
            }
          } else {
            type = tk::DType::kBFloat16;
            in = src.bytes.data();
          }
          std::vector<uint8_t> data(t.layout.data_bytes), scales(t.layout.scale_bytes());
          float tensor_scale = 0.0f;
          tk::QuantizeCpu(plan.format, t.layout, type, in,
                          {data.data(), scales.data(), &tensor_scale});
          INFO(t.src.name);
          CHECK(std::memcmp(at, data.data(), data.size()) == 0);
          CHECK(std::memcmp(got.segment.data() + t.scales_offset, scales.data(), scales.size()) ==
                0);
          float stored;
          std::memcpy(&stored, got.segment.data() + t.tensor_scale_offset, 4);
          CHECK(stored == tensor_scale);
        }
      }
    }
  }
}

TEST_CASE("A non-finite value is reported at its first element whatever the threads",
          "[base_fill]") {
  auto shards = Checkpoint("BF16", 3);
  // up_proj: a NaN at 5000 and an inf at 9000; down_proj (later): a NaN at 7.
  auto poke = [](TestTensor* t, uint64_t i, uint16_t bits) {
    std::memcpy(&t->bytes[2 * i], &bits, 2);
  };
  poke(&shards[0][2], 9000, 0x7f80);
  poke(&shards[0][2], 5000, 0xffc1);
  poke(&shards[1][0], 7, 0x7fc0);
  const ModelSources sources = Open(shards);
  for (const std::string format : kFormats) {
    const BasePlan plan = Plan(sources, format, 64);
    for (auto [threads, piece] : {std::pair<unsigned, uint64_t>{1, 0}, {4, 1000}, {2, 64}}) {
      INFO(format << " " << threads << " threads, pieces of " << piece);
      const Filled got = Fill(sources, plan, threads, piece);
      CHECK(got.status.code() == StatusCode::kInvalidArgument);
      CHECK(got.status.message() ==
            sources.files[0].path +
                ": tensor \"model.layers.0.mlp.up_proj.weight\" has a non-finite value (NaN or "
                "inf) at element 5000; only finite weights can be quantized (load it with format "
                "none)");
    }
  }
  // Unquantized, the same values are just bytes.
  CHECK(Fill(sources, Plan(sources, "none", 0), 4, 1000).status.ok());
}

TEST_CASE("A file that shrank names the file and the first tensor it cut", "[base_fill]") {
  const auto shards = Checkpoint("BF16", 9);
  ModelSources sources;
  int writer = -1;  // the first shard, writable
  AddShard(SafetensorsFile(shards[0]), &sources, 0, &writer);
  for (size_t i = 1; i < shards.size(); ++i) AddShard(SafetensorsFile(shards[i]), &sources);
  for (const std::string format : {"none", "nf4"}) {
    const BasePlan plan = Plan(sources, format, 64);
    // Cut the first shard in the middle of up_proj (its third tensor).
    const PlannedTensor& up = plan.tensors[2];
    REQUIRE(up.src.name == "model.layers.0.mlp.up_proj.weight");
    REQUIRE(ftruncate(writer, static_cast<off_t>(up.src.begin + 10000)) == 0);
    for (auto [threads, piece] : {std::pair<unsigned, uint64_t>{1, 0}, {4, 1000}}) {
      INFO(format << " " << threads << " threads");
      const Filled got = Fill(sources, plan, threads, piece);
      CHECK(got.status.code() == StatusCode::kDataLoss);
      CHECK(got.status.message() == sources.files[0].path +
                                        ": reading tensor \"model.layers.0.mlp.up_proj.weight\": "
                                        "the file ended early (it shrank while loading?)");
    }
    const std::string whole = SafetensorsFile(shards[0]);
    REQUIRE(pwrite(writer, whole.data(), whole.size(), 0) == static_cast<ssize_t>(whole.size()));
  }
  close(writer);
}

TEST_CASE("The scratch stays within what FillScratchBytes reserves", "[base_fill]") {
  for (const std::string dtype : {"BF16", "F16"}) {
    const ModelSources sources = Open(Checkpoint(dtype, 1));
    INFO(dtype);
    FillOptions options;
    options.threads = 4;
    options.piece_bytes = 1000;
    const BasePlan plan = Plan(sources, "nf4", 64);
    // 7 blocks of 64 two-byte values per piece; an F16 piece adds its fp32 copy
    // (at a 64-byte aligned offset).
    const uint64_t per_thread = dtype == "BF16" ? 7 * 64 * 2 : 896 + 7 * 64 * 4;
    CHECK(FillThreads(plan, options) == 4);
    CHECK(FillScratchBytes(plan, options) == 4 * per_thread);
    const Filled got = Fill(sources, plan, 4, 1000);
    REQUIRE(got.status.ok());
    CHECK(got.stats.scratch_peak_bytes > 0);
    CHECK(got.stats.scratch_peak_bytes <= FillScratchBytes(plan, options));
    CHECK(got.stats.scratch_peak_bytes % per_thread == 0);

    const BasePlan none = Plan(sources, "none", 0);
    CHECK(FillScratchBytes(none, options) == 0);
    CHECK(Fill(sources, none, 4, 1000).stats.scratch_peak_bytes == 0);
  }
  // Never more threads than pieces.
  ModelSources one;
  AddShard(SafetensorsFile({{"w", "U8", {10}, std::string(10, 'x')}}), &one);
  FillOptions many;
  many.threads = 8;
  CHECK(FillThreads(Plan(one, "none", 0), many) == 1);
}

TEST_CASE("A cancelled load stops before its remaining pieces", "[base_fill]") {
  // One U8 tensor of 1 GiB (a hole: nothing on disk), 1024 pieces of 1 MiB: far more
  // than two threads read in the 10 ms before the first progress call.
  const uint64_t bytes = 1ull << 30;
  ModelSources sources;
  const std::string json = R"({"big":{"dtype":"U8","shape":[)" + std::to_string(bytes) +
                           R"(],"data_offsets":[0,)" + std::to_string(bytes) + "]}}";
  std::string header(8, '\0');
  for (int i = 0; i < 8; ++i) header[i] = static_cast<char>((json.size() >> (8 * i)) & 0xff);
  AddShard(header + json, &sources, bytes);
  const BasePlan plan = Plan(sources, "none", 0);
  // Anonymous pages: only the pieces read before the stop get memory.
  void* segment = mmap(nullptr, plan.total_bytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  REQUIRE(segment != MAP_FAILED);
  FillOptions options;
  options.threads = 2;
  FillStats stats;
  std::vector<LoadProgress> seen;
  const Status st = FillBase(
      sources, plan, "key", static_cast<char*>(segment), options,
      [&](const LoadProgress& p) {
        seen.push_back(p);
        return false;
      },
      &stats);
  munmap(segment, plan.total_bytes);
  CHECK(st.code() == StatusCode::kCancelled);
  CHECK(st.message() == kLoadCancelled);
  REQUIRE(seen.size() == 1);
  CHECK(seen[0].threads == 2);
  CHECK(seen[0].tensors_done == 0);
  CHECK(stats.pieces == bytes / kLoadPieceBytes);
  CHECK(stats.pieces_done < stats.pieces);
}
