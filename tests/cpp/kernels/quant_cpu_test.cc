// CPU quantize/dequantize: every vectorized path equals the scalar reference byte for
// byte (random and adversarial tensors); the NF4 layout matches a hand-computed
// bitsandbytes example; values on each format's grid round-trip exactly.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "catch_compat.h"
#include "trainstream/kernels/quant.h"

namespace tk = trainstream::kernels;

namespace {

struct Quantized {
  tk::QuantLayout layout;
  std::vector<uint8_t> data;
  std::vector<uint8_t> scales;
  float tensor_scale = 0.0f;
};

Quantized Quantize(tk::QuantFormat fmt, const std::vector<float>& x, int64_t block, tk::Isa isa,
                   int threads = 0) {
  Quantized q;
  q.layout = tk::MakeQuantLayout(fmt, static_cast<int64_t>(x.size()), block);
  q.data.assign(q.layout.data_bytes, 0xAB);  // poison: every byte must be written
  q.scales.assign(q.layout.scale_bytes(), 0xAB);
  tk::QuantCpuOptions opts;
  opts.isa = isa;
  opts.num_threads = threads;
  tk::QuantizeCpu(fmt, q.layout, tk::DType::kFloat32, x.data(),
                  {q.data.data(), q.scales.data(), &q.tensor_scale}, opts);
  return q;
}

std::vector<float> Dequantize(tk::QuantFormat fmt, const Quantized& q, tk::Isa isa) {
  std::vector<float> y(q.layout.numel);
  tk::QuantCpuOptions opts;
  opts.isa = isa;
  tk::DequantizeCpu(fmt, q.layout, {q.data.data(), q.scales.data(), q.tensor_scale},
                    tk::DType::kFloat32, y.data(), opts);
  return y;
}

std::vector<std::pair<std::string, std::vector<float>>> TestTensors() {
  std::vector<std::pair<std::string, std::vector<float>>> out;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> gauss(300001);  // not a multiple of any block
  for (float& v : gauss) v = normal(rng);
  out.emplace_back("gaussian", gauss);
  std::vector<float> zeros_mixed = gauss;
  for (int i = 64; i < 256; ++i) zeros_mixed[i] = 0.0f;  // all-zero blocks
  out.emplace_back("zero blocks", zeros_mixed);
  out.emplace_back("all zero", std::vector<float>(1000, 0.0f));
  std::vector<float> outlier = gauss;
  outlier[12345] = 3.0e4f;
  out.emplace_back("one huge outlier", outlier);
  std::vector<float> sub(4099);
  std::uniform_int_distribution<uint32_t> bits(1, 0x007FFFFFu);
  for (float& v : sub) {
    uint32_t b = bits(rng) | (rng() & 0x80000000u);
    std::memcpy(&v, &b, 4);
  }
  out.emplace_back("subnormals", sub);
  std::vector<float> mixed = gauss;
  for (int i = 0; i < 200; ++i) mixed[i * 97] = sub[i];
  out.emplace_back("subnormals among normals", mixed);
  out.emplace_back("tiny sizes", std::vector<float>{0.5f, -0.25f, 3.0f});
  out.emplace_back("big range", std::vector<float>{1e30f, -1e-30f, 65504.0f, -3.0e38f, 1.0f});
  return out;
}

const tk::QuantFormat kFormats[] = {tk::QuantFormat::kInt8, tk::QuantFormat::kNf4,
                                    tk::QuantFormat::kFp8, tk::QuantFormat::kNvfp4};

}  // namespace

TEST_CASE("the kernels take the wire's float32 and bfloat16, not float16") {
  // Element types are the wire's DType (quant.h); fp16 is the caller's to widen.
  static_assert(std::is_same_v<tk::DType, trainstream::wire::DType>);
  CHECK(tk::QuantTakesDType(tk::DType::kFloat32));
  CHECK(tk::QuantTakesDType(tk::DType::kBFloat16));
  CHECK_FALSE(tk::QuantTakesDType(tk::DType::kFloat16));
  CHECK_FALSE(tk::QuantTakesDType(static_cast<tk::DType>(0)));
}

TEST_CASE("vectorized and threaded paths equal the scalar reference byte for byte") {
  for (const auto& [name, x] : TestTensors()) {
    for (tk::QuantFormat fmt : kFormats) {
      for (int64_t block : {64, 2, 126}) {
        const Quantized ref = Quantize(fmt, x, block, tk::Isa::kScalar, 1);
        for (tk::Isa isa : {tk::Isa::kScalar, tk::Isa::kAvx2, tk::Isa::kAvx512}) {
          if (!tk::IsaSupported(isa)) continue;
          INFO(name << " " << tk::QuantFormatName(fmt) << " block " << block << " "
                    << tk::IsaName(isa));
          const Quantized got = Quantize(fmt, x, block, isa, 3);
          REQUIRE(got.data == ref.data);
          REQUIRE(got.scales == ref.scales);
          REQUIRE(got.tensor_scale == ref.tensor_scale);
          const std::vector<float> a = Dequantize(fmt, ref, tk::Isa::kScalar);
          const std::vector<float> b = Dequantize(fmt, got, isa);
          REQUIRE(std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
        }
      }
    }
  }
}

// The base loader quantizes a tensor piece by piece, on several threads, from a
// scratch that holds only the piece: the bytes must be QuantizeCpu's.
TEST_CASE("quantizing a tensor in pieces gives QuantizeCpu's bytes") {
  for (const auto& [name, x] : TestTensors()) {
    for (tk::QuantFormat fmt : kFormats) {
      for (int64_t block : {64, 2, 126}) {
        const Quantized ref = Quantize(fmt, x, block, tk::Isa::kScalar, 1);
        const tk::QuantLayout& l = ref.layout;
        for (int64_t per_piece : {int64_t{1}, int64_t{7}, l.num_blocks}) {
          INFO(name << " " << tk::QuantFormatName(fmt) << " block " << l.block_size << " "
                    << per_piece << " blocks per piece");
          std::vector<uint8_t> data(l.data_bytes, 0xAB), scales(l.scale_bytes(), 0xAB);
          float untouched = -1.0f;
          const tk::QuantBuffers out{data.data(), scales.data(), &untouched};
          float amax = 0.0f;
          for (int64_t b = 0; b < l.num_blocks; b += per_piece) {
            const int64_t begin = b * l.block_size;
            const int64_t end = std::min(l.numel, (b + per_piece) * l.block_size);
            amax =
                std::max(amax, tk::AbsMaxCpu(tk::DType::kFloat32, x.data() + begin, end - begin));
          }
          const float tensor_scale =
              fmt == tk::QuantFormat::kNvfp4 ? tk::Nvfp4TensorScale(amax) : 0.0f;
          REQUIRE(tensor_scale == ref.tensor_scale);
          // Last piece first: the order must not matter.
          for (int64_t b = (l.num_blocks - 1) / per_piece * per_piece; b >= 0; b -= per_piece) {
            // A private copy of the piece, as the loader's scratch holds it.
            const int64_t begin = b * l.block_size;
            const int64_t end = std::min(l.numel, (b + per_piece) * l.block_size);
            const std::vector<float> piece(x.begin() + begin, x.begin() + end);
            tk::QuantizeBlockRangeCpu(fmt, l, tk::DType::kFloat32, piece.data(), b,
                                      std::min(l.num_blocks, b + per_piece), out, tensor_scale);
          }
          REQUIRE(data == ref.data);
          REQUIRE(scales == ref.scales);
          REQUIRE(untouched == -1.0f);
        }
      }
    }
  }
}

TEST_CASE("NF4 bytes match a hand-computed bitsandbytes example") {
  // Block 4: {2, -2, 0, 1} -> absmax 2, normalized {1, -1, 0, 0.5} -> codes
  // {15, 0, 7, 12} (0.5 lies between thresholds 0.389 and 0.502). Element 2j goes in
  // the high nibble: 0xF0, 0x7C. Second block {0.25, pad, pad, pad} -> {15, 7, 7, 7}.
  const Quantized q =
      Quantize(tk::QuantFormat::kNf4, {2.0f, -2.0f, 0.0f, 1.0f, 0.25f}, 4, tk::Isa::kScalar);
  REQUIRE(q.layout.padding() == 3);
  REQUIRE(q.data == std::vector<uint8_t>{0xF0, 0x7C, 0xF7, 0x77});
  float scales[2];
  std::memcpy(scales, q.scales.data(), 8);
  REQUIRE(scales[0] == 2.0f);
  REQUIRE(scales[1] == 0.25f);
  // bitsandbytes' all-zero block: absmax 0, 0 * (1/0) = NaN, code 0 everywhere.
  const Quantized z =
      Quantize(tk::QuantFormat::kNf4, std::vector<float>(64, 0.0f), 64, tk::Isa::kScalar);
  REQUIRE(z.data == std::vector<uint8_t>(32, 0x00));
  for (float v : Dequantize(tk::QuantFormat::kNf4, z, tk::Isa::kScalar)) REQUIRE(v == 0.0f);
}

TEST_CASE("values on each format's grid round-trip exactly") {
  std::mt19937 rng(11);
  for (tk::QuantFormat fmt : kFormats) {
    INFO(tk::QuantFormatName(fmt));
    // Random bytes and power-of-two scales give values on the grid; quantizing those
    // values must give back the same values (the bytes may differ only where two
    // codes mean the same number, e.g. +0 and -0).
    const int64_t block = tk::EffectiveBlockSize(fmt, 64);
    const int64_t n = block * 50;
    Quantized q;
    q.layout = tk::MakeQuantLayout(fmt, n, block);
    q.data.resize(q.layout.data_bytes);
    for (auto& b : q.data) b = static_cast<uint8_t>(rng());
    q.scales.resize(q.layout.scale_bytes());
    for (int64_t b = 0; b < q.layout.num_blocks; ++b) {
      const int e = static_cast<int>(rng() % 20) - 10;
      if (fmt == tk::QuantFormat::kInt8 || fmt == tk::QuantFormat::kNf4) {
        const float s = (fmt == tk::QuantFormat::kInt8 ? 127.0f : 1.0f) * std::ldexp(1.0f, e);
        std::memcpy(&q.scales[b * 4], &s, 4);
      } else {
        q.scales[b] = static_cast<uint8_t>(fmt == tk::QuantFormat::kFp8 ? 127 + e : 0x38 + e);
      }
    }
    q.tensor_scale = 0.25f;
    // nvfp4 re-derives its tensor scale from the tensor's amax: one block at the top of
    // the e4m3 range (448 * 6 * 0.25 / 2688 = 0.25) makes it come back unchanged.
    if (fmt == tk::QuantFormat::kNvfp4) q.scales[0] = 0x7E;
    // Make every block reach its scale so the re-derived scale equals the original.
    for (int64_t b = 0; b < q.layout.num_blocks; ++b) {
      const int64_t s = b * block;
      switch (fmt) {
        case tk::QuantFormat::kInt8:
          q.data[s] = 127;
          for (int64_t i = 0; i < block; ++i)
            if (q.data[s + i] == 0x80) q.data[s + i] = 0x81;  // -128 is not a code
          break;
        case tk::QuantFormat::kNf4:
          q.data[s / 2] = static_cast<uint8_t>(0xF0 | (q.data[s / 2] & 0xF));
          break;
        case tk::QuantFormat::kFp8:
          for (int64_t i = 0; i < block; ++i)
            if ((q.data[s + i] & 0x7F) == 0x7F) q.data[s + i] = 0;  // NaN codes
          q.data[s] = 0x7E;                                         // 448
          break;
        case tk::QuantFormat::kNvfp4:
          q.data[s / 2] = static_cast<uint8_t>(0x70 | (q.data[s / 2] & 0xF));  // 6
          break;
      }
    }
    const std::vector<float> x = Dequantize(fmt, q, tk::Isa::kScalar);
    const Quantized again = Quantize(fmt, x, block, tk::BestIsa());
    const std::vector<float> y = Dequantize(fmt, again, tk::BestIsa());
    for (int64_t i = 0; i < n; ++i) {
      INFO("i = " << i);
      REQUIRE(x[i] == y[i]);
    }
  }
}

TEST_CASE("bf16 input gives the bytes of the same values in fp32") {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> bf(1000);
  std::vector<float> f(1000);
  for (int i = 0; i < 1000; ++i) {
    bf[i] = tk::FloatToBf16Bits(normal(rng));
    f[i] = tk::Bf16BitsToFloat(bf[i]);
  }
  for (tk::QuantFormat fmt : kFormats) {
    const Quantized a = Quantize(fmt, f, 64, tk::BestIsa());
    Quantized b;
    b.layout = a.layout;
    b.data.resize(a.data.size());
    b.scales.resize(a.scales.size());
    tk::QuantizeCpu(fmt, b.layout, tk::DType::kBFloat16, bf.data(),
                    {b.data.data(), b.scales.data(), &b.tensor_scale});
    REQUIRE(a.data == b.data);
    REQUIRE(a.scales == b.scales);
    REQUIRE(a.tensor_scale == b.tensor_scale);
  }
}

TEST_CASE("argument checks name the problem and what is accepted") {
  REQUIRE(tk::QuantArgsError(tk::QuantFormat::kInt8, 64).empty());
  REQUIRE(tk::QuantArgsError(tk::QuantFormat::kNf4, 2).empty());
  const std::string e = tk::QuantArgsError(tk::QuantFormat::kNf4, 63);
  REQUIRE(e.find("block_size=63") != std::string::npos);
  REQUIRE(e.find("even") != std::string::npos);
  REQUIRE_FALSE(tk::QuantArgsError(tk::QuantFormat::kInt8, 0).empty());
  tk::QuantFormat f;
  REQUIRE_FALSE(tk::ParseQuantFormat("int4", &f));
  REQUIRE(tk::ParseQuantFormat("nvfp4", &f));
  REQUIRE(f == tk::QuantFormat::kNvfp4);
}
