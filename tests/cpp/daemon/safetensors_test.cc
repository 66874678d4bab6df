// The safetensors header parser: good files parse, and each kind of bad file the
// issue lists gives an error naming the file, the tensor and what is wrong.
#include "safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "catch_compat.h"

using namespace trainstream::daemon::base;

namespace {

std::string File(const std::string& json, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + json + data;
}

std::string Parse(const std::string& file, SafetensorsHeader* h) {
  return ParseSafetensorsBuffer("m.safetensors", reinterpret_cast<const uint8_t*>(file.data()),
                                file.size(), h);
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

TEST_CASE("ReadSafetensorsHeader reads through an fd", "[safetensors]") {
  char path[] = "/tmp/ts-st-XXXXXX";
  const int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  const std::string f =
      File(R"({"t":{"dtype":"F16","shape":[2,2],"data_offsets":[0,8]}})", std::string(8, '\1'));
  REQUIRE(write(fd, f.data(), f.size()) == static_cast<ssize_t>(f.size()));
  SafetensorsHeader h;
  CHECK(ReadSafetensorsHeader(fd, path, &h) == "");
  CHECK(h.tensors.at(0).shape == std::vector<int64_t>{2, 2});
  REQUIRE(ftruncate(fd, 12) == 0);
  CHECK(Has(ReadSafetensorsHeader(fd, path, &h), "runs past the end of the file (12 bytes)"));
  close(fd);
  unlink(path);
}

TEST_CASE("The shard index maps tensors to plain file names", "[safetensors]") {
  ShardIndex idx;
  CHECK(ParseShardIndex("i.json",
                        R"({"metadata":{"total_size":8},"weight_map":{"a":"s1.safetensors",)"
                        R"("b":"s2.safetensors","c":"s1.safetensors"}})",
                        &idx) == "");
  CHECK(idx.shards == std::vector<std::string>{"s1.safetensors", "s2.safetensors"});
  CHECK(Has(ParseShardIndex("i.json", R"({"weight_map":{"a":"../x.safetensors"}})", &idx),
            "is not a file name in the model's folder"));
  CHECK(Has(ParseShardIndex("i.json", R"({"weight_map":{"a":3}})", &idx), "file name string"));
  CHECK(Has(ParseShardIndex("i.json", R"({"x":{}})", &idx), "\"weight_map\""));
}
