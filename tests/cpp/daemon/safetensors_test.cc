// The safetensors header parser: good files parse, and each kind of bad file the
// issue lists gives an error naming the file, the tensor and what is wrong. Also
// the tensor cap and cancellation of the parser and of PlanBase (FillBase:
// base_fill_test.cc).
#include "base/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "base/base_loader.h"
#include "base/model_sources.h"
#include "catch_compat.h"
#include "shard_files.h"

using namespace trainstream::daemon::base;
using trainstream::daemon::base::testing::AddShard;

namespace {

std::string File(const std::string& json, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + json + data;
}

// What a parser call answered: "" when it accepted the input, else its message
// (every refusal is INVALID_ARGUMENT).
std::string Answer(const trainstream::Status& st) {
  if (st.ok()) return "";
  CHECK(st.code() == trainstream::StatusCode::kInvalidArgument);
  return st.message();
}

std::string Parse(const std::string& file, SafetensorsHeader* h) {
  return Answer(ParseSafetensorsBuffer(
      "m.safetensors", reinterpret_cast<const uint8_t*>(file.data()), file.size(), h));
}

bool Has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("A well-formed file parses, tensors sorted by offset", "[safetensors]") {
  const std::string json = R"({"__metadata__":{"format":"pt"},)"
                           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]},)"
                           R"("a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},)"
                           R"("e":{"dtype":"I8","shape":[0,3],"data_offsets":[12,12]}}   )";
  SafetensorsHeader h;
  REQUIRE(Parse(File(json, std::string(12, 'x')), &h) == "");
  REQUIRE(h.tensors.size() == 3);
  CHECK(h.tensors[0].name == "a");
  CHECK(h.tensors[0].dtype == SafetensorsDType::kBF16);
  CHECK(h.tensors[1].name == "b");
  CHECK(h.tensors[1].numel() == 2);
  CHECK(h.tensors[2].name == "e");
  CHECK(h.tensors[2].bytes() == 0);
  CHECK(h.metadata.at("format") == "pt");
  CHECK(h.data_start == 8 + json.size());
}

TEST_CASE("Every dtype the format defines is accepted with its size", "[safetensors]") {
  const std::pair<const char*, uint64_t> all[] = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8},     {"I32", 4},
      {"I16", 2}, {"I8", 1},  {"U8", 1},  {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}};
  for (auto [name, size] : all) {
    const std::string json = std::string(R"({"t":{"dtype":")") + name +
                             R"(","shape":[3],"data_offsets":[0,)" + std::to_string(3 * size) +
                             "]}}";
    SafetensorsHeader h;
    INFO(name);
    CHECK(Parse(File(json, std::string(3 * size, '\0')), &h) == "");
  }
}

TEST_CASE("Truncated files and header lengths past the end are refused", "[safetensors]") {
  SafetensorsHeader h;
  auto e = Parse(std::string("\x05\x00\x00", 3), &h);
  CHECK(Has(e, "m.safetensors: truncated: 3 bytes"));
  std::string f = File(R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", "1234");
  e = Parse(f.substr(0, 20), &h);
  CHECK(Has(e, "header length"));
  CHECK(Has(e, "runs past the end of the file (20 bytes)"));
  // Data cut short: the offsets run past the data area.
  e = Parse(f.substr(0, f.size() - 2), &h);
  CHECK(Has(e, "tensor \"t\""));
  CHECK(Has(e, "run past the data area (2 bytes"));
  std::string huge(8, '\xff');
  e = Parse(huge + "{}", &h);
  CHECK(Has(e, "exceeds the"));
}

TEST_CASE("Malformed JSON, duplicate keys and deep nesting are refused", "[safetensors]") {
  SafetensorsHeader h;
  CHECK(Has(Parse(File(R"({"t":{"dtype":"F32",)", ""), &h), "malformed JSON"));
  CHECK(Has(Parse(File("[1,2]", ""), &h), "must be a JSON object of tensors, got array"));
  auto e = Parse(File(R"({"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                      R"("t":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                      "ab"),
                 &h);
  CHECK(Has(e, "duplicate key \"t\""));
  CHECK(Has(Parse(File(std::string(10000, '[') + std::string(10000, ']'), ""), &h),
            "nesting deeper than"));
  CHECK(Has(Parse(File(R"({"__metadata__":{"a":1}})", ""), &h), "__metadata__ field \"a\""));
}

TEST_CASE("Unknown dtypes, bad shapes and bad offsets name the tensor", "[safetensors]") {
  SafetensorsHeader h;
  auto e = Parse(File(R"({"w":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}})", "a"), &h);
  CHECK(Has(e, "tensor \"w\": dtype \"F4\" is not one this reader knows (accepted: F64"));
  e = Parse(File(R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", "abcd"), &h);
  CHECK(Has(e, "not a non-negative integer"));
  e = Parse(File(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", "abcdefgh"), &h);
  CHECK(Has(e, "tensor \"w\": shape [3] of F32 is 12 bytes but data_offsets [0, 8] span 8"));
  e = Parse(File(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})",
                 "abcdefgh"),
            &h);
  CHECK(Has(e, "has more elements than fit in 64 bits"));
  e = Parse(File(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[2,1]}})", "ab"), &h);
  CHECK(Has(e, "end before they begin"));
  e = Parse(File(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0]}})", "a"), &h);
  CHECK(Has(e, "\"data_offsets\" must be [begin, end]"));
  e = Parse(File(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":1}})", "a"), &h);
  CHECK(Has(e, "unknown field \"x\""));
}

TEST_CASE("Overlaps, holes and trailing bytes in the data area are refused", "[safetensors]") {
  SafetensorsHeader h;
  auto e = Parse(File(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                      R"("b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})",
                      "abc"),
                 &h);
  CHECK(Has(e, "tensors \"a\" [0, 2) and \"b\" [1, 3) overlap"));
  e = Parse(File(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})", "ab"), &h);
  CHECK(Has(e, "bytes [0, 1) of the data area belong to no tensor"));
  e = Parse(File(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "ab"), &h);
  CHECK(Has(e, "trailing bytes"));
}

TEST_CASE("ReadSafetensorsHeader reads through an open file", "[safetensors]") {
  const std::string path = trainstream::daemon::base::testing::NewTemporaryFile("ts-st");
  const std::string f =
      File(R"({"t":{"dtype":"F16","shape":[2,2],"data_offsets":[0,8]}})", std::string(8, '\1'));
  trainstream::daemon::base::testing::WriteWholeFile(path, f);
  trainstream::platform::ReadOnlyFile file;
  REQUIRE(trainstream::platform::ReadOnlyFile::Open(nullptr, path, &file) == 0);
  SafetensorsHeader h;
  CHECK(Answer(ReadSafetensorsHeader(file, path, &h)) == "");
  CHECK(h.tensors.at(0).shape == std::vector<int64_t>{2, 2});
  std::filesystem::resize_file(path, 12);
  CHECK(Has(Answer(ReadSafetensorsHeader(file, path, &h)),
            "runs past the end of the file (12 bytes)"));
  file = trainstream::platform::ReadOnlyFile();
  std::remove(path.c_str());
}

TEST_CASE("The shard index maps tensors to plain file names", "[safetensors]") {
  ShardIndex idx;
  CHECK(Answer(ParseShardIndex("i.json",
                               R"({"metadata":{"total_size":8},"weight_map":{"a":"s1.safetensors",)"
                               R"("b":"s2.safetensors","c":"s1.safetensors"}})",
                               &idx)) == "");
  CHECK(idx.shards == std::vector<std::string>{"s1.safetensors", "s2.safetensors"});
  CHECK(Has(Answer(ParseShardIndex("i.json", R"({"weight_map":{"a":"../x.safetensors"}})", &idx)),
            "is not a file name in the model's folder"));
  CHECK(Has(Answer(ParseShardIndex("i.json", R"({"weight_map":{"a":3}})", &idx)),
            "file name string"));
  CHECK(Has(Answer(ParseShardIndex("i.json", R"({"x":{}})", &idx)), "\"weight_map\""));
}

namespace {

// A header of `n` empty U8 tensors ("t0", "t1", ...), then one 4-byte tensor
// "last" so the data area is not empty.
std::string ManyTensors(uint64_t n, bool metadata = false) {
  std::string json = metadata ? R"({"__metadata__":{"format":"pt"},)" : "{";
  json.reserve(n * 56 + 128);
  for (uint64_t i = 0; i < n; ++i) {
    json += "\"t" + std::to_string(i) + R"(":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},)";
  }
  json += R"("last":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  return File(json, "abcd");
}

}  // namespace

// A header of many tensors took quadratic time. The parse is now linear
// (benchmarks/safetensors_header.py measures it, docs/base-cache.md, "Bad
// input"); these pin the results at and past the cap.
TEST_CASE("A header at the tensor cap parses completely", "[safetensors]") {
  SafetensorsHeader h;
  REQUIRE(Parse(ManyTensors(kMaxTensors - 1, /*metadata=*/true), &h) == "");
  REQUIRE(h.tensors.size() == kMaxTensors);
  CHECK(h.metadata.at("format") == "pt");
  // Sorted by offset: the empty tensors at 0 come before the one at [0, 4).
  CHECK(h.tensors.back().name == "last");
  CHECK(h.tensors.back().bytes() == 4);
  std::set<std::string> names;
  for (const auto& t : h.tensors) names.insert(t.name);
  CHECK(names.size() == kMaxTensors);
  CHECK(names.count("t0") == 1);
  CHECK(names.count("t" + std::to_string(kMaxTensors - 2)) == 1);
}

TEST_CASE("A header over the tensor cap is refused with the count and the cap", "[safetensors]") {
  SafetensorsHeader h;
  const std::string e = Parse(ManyTensors(kMaxTensors + 99), &h);
  CHECK(Has(e, "m.safetensors: header: lists " + std::to_string(kMaxTensors + 100) +
                   " tensors, more than the " + std::to_string(kMaxTensors)));
  CHECK(Has(e, "accepted: at most " + std::to_string(kMaxTensors) + " tensors per file"));
  CHECK(h.tensors.empty());
}

TEST_CASE("Duplicate keys are refused inside a tensor too", "[safetensors]") {
  SafetensorsHeader h;
  auto e =
      Parse(File(R"({"t":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "a"), &h);
  CHECK(Has(e, "header: duplicate key \"dtype\""));
  e = Parse(File(R"({"__metadata__":{"a":"x","a":"y"}})", ""), &h);
  CHECK(Has(e, "header: duplicate key \"a\""));
}

TEST_CASE("A parse stops once its CancelCheck says so", "[safetensors]") {
  const std::string file = ManyTensors(20000);
  const std::string_view json(file.data() + 8, file.size() - 8 - 4);
  SafetensorsHeader h;
  int polls = 0;
  CHECK(Answer(ParseSafetensorsJson("m.safetensors", json, file.size(), &h, [&] {
          ++polls;
          return false;
        })) == "");
  CHECK(h.tensors.size() == 20001);
  CHECK(polls > 10);  // polled all along the parse, not once
  int left = 3;
  const trainstream::Status st =
      ParseSafetensorsJson("m.safetensors", json, file.size(), &h, [&] { return --left < 0; });
  CHECK(st.code() == trainstream::StatusCode::kCancelled);
  CHECK(st.message() == "m.safetensors: header: parse cancelled");
}

TEST_CASE("A shard index over the tensor cap is refused", "[safetensors]") {
  std::string json = R"({"weight_map":{)";
  for (uint64_t i = 0; i <= kMaxTensors; ++i) {
    json += (i ? ",\"t" : "\"t") + std::to_string(i) + R"(":"s.safetensors")";
  }
  json += "}}";
  ShardIndex idx;
  CHECK(Has(Answer(ParseShardIndex("i.json", json, &idx)),
            "i.json: weight_map lists " + std::to_string(kMaxTensors + 1) +
                " tensors, more than the " + std::to_string(kMaxTensors)));
}

TEST_CASE("PlanBase refuses more than the tensor cap over all shards", "[base_loader]") {
  ModelSources sources;
  AddShard(ManyTensors(kMaxTensors / 2), &sources);
  AddShard(ManyTensors(kMaxTensors / 2), &sources);
  BasePlan plan;
  REQUIRE(ParseBaseFormat("none", 0, &plan).ok());
  trainstream::Status st = PlanBase(sources, &plan);
  // Each shard alone is under the cap; together they are not. (The second
  // repeats the first's names: the cap is checked before the names are.)
  CHECK(st.code() == trainstream::StatusCode::kInvalidArgument);
  CHECK(Has(st.message(), "/models/m: the shards list more than " + std::to_string(kMaxTensors) +
                              " tensors together"));
}

TEST_CASE("PlanBase stops with CANCELLED when asked", "[base_loader]") {
  ModelSources sources;
  AddShard(ManyTensors(20000), &sources);
  BasePlan plan;
  REQUIRE(ParseBaseFormat("none", 0, &plan).ok());
  int left = 2;
  trainstream::Status st = PlanBase(sources, &plan, [&] { return --left < 0; });
  CHECK(st.code() == trainstream::StatusCode::kCancelled);
  CHECK(st.message() == kLoadCancelled);
  REQUIRE(PlanBase(sources, &plan).ok());
}
