#include "base/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <utility>

#include "trainstream/platform/sys_call.h"

namespace trainstream::daemon::base {
namespace {

using nlohmann::json;

struct DTypeInfo {
  const char* name;
  SafetensorsDType dtype;
  uint64_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {"F64", SafetensorsDType::kF64, 8},        {"F32", SafetensorsDType::kF32, 4},
    {"F16", SafetensorsDType::kF16, 2},        {"BF16", SafetensorsDType::kBF16, 2},
    {"I64", SafetensorsDType::kI64, 8},        {"I32", SafetensorsDType::kI32, 4},
    {"I16", SafetensorsDType::kI16, 2},        {"I8", SafetensorsDType::kI8, 1},
    {"U8", SafetensorsDType::kU8, 1},          {"BOOL", SafetensorsDType::kBool, 1},
    {"F8_E4M3", SafetensorsDType::kF8E4M3, 1}, {"F8_E5M2", SafetensorsDType::kF8E5M2, 1},
};

uint64_t Fnv1a64(std::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

// Builds the DOM of one JSON text and enforces what nlohmann's plain parser does
// not: no duplicate keys (it would keep the last silently), at most
// kMaxJsonDepth levels, and at most `max_entries` members of the root object
// (`uncounted` aside). Fed by json::sax_parse.
//
// Why not json::parse with a callback: that parser, to drop discarded values,
// rescans the parent object at every end_object, so a header of n tensors took
// O(n^2) (32k tensors 4.8 s, 200k over a minute). Here a key costs one map
// lookup, O(log n), and every other event O(1).
//
// Past the entry limit the DOM is no longer built: the rest of the root object
// is only scanned to count its members, so the error can name the count.
// `cancelled` (may be empty) is polled every kCancelPollEvents events.
class StrictSax {
 public:
  StrictSax(json* root, uint64_t max_entries, std::string_view uncounted,
            const CancelCheck& cancelled)
      : root_(root), max_entries_(max_entries), uncounted_(uncounted), cancelled_(cancelled) {}

  // "" after a complete parse, else why it stopped (parse errors throw instead).
  const std::string& error() const { return error_; }
  uint64_t entries() const { return entries_; }
  // The root had more than max_entries members; entries() counts them all.
  bool limit_hit() const { return limit_hit_; }

  bool null() { return Value(nullptr); }
  bool boolean(bool v) { return Value(v); }
  bool number_integer(json::number_integer_t v) { return Value(v); }
  bool number_unsigned(json::number_unsigned_t v) { return Value(v); }
  bool number_float(json::number_float_t v, const json::string_t&) { return Value(v); }
  bool string(json::string_t& v) { return Value(std::move(v)); }
  bool binary(json::binary_t&) { return Fail("binary value"); }  // not in JSON text

  bool start_object(std::size_t) { return Open(json::object()); }
  bool start_array(std::size_t) { return Open(json::array()); }
  bool end_object() { return Close(); }
  bool end_array() { return Close(); }

  bool key(json::string_t& k) {
    if (!Tick()) return false;
    const bool root_member = depth_ == 1;
    if (root_member && max_entries_ != 0 && k != uncounted_ && ++entries_ > max_entries_) {
      over_limit_ = true;  // from here on: count, build nothing
    }
    if (over_limit_) return true;
    json& object = *open_.back();
    if (object.contains(k)) return Fail("duplicate key \"" + k + "\"");
    member_ = &object[std::move(k)];
    return true;
  }

  // The parser's syntax errors: reported as before (json::exception).
  template <class Exception>
  bool parse_error(std::size_t, const std::string&, const Exception& ex) {
    throw ex;
  }

 private:
  static constexpr uint64_t kCancelPollEvents = 4096;

  bool Tick() {
    if (++events_ % kCancelPollEvents == 0 && cancelled_ && cancelled_()) {
      return Fail("parse cancelled");
    }
    return true;
  }

  bool Fail(std::string why) {
    error_ = std::move(why);
    return false;  // sax_parse stops here
  }

  // Places `v` where the parser is: the root, the next array element or the
  // member whose key came last. Returns where it went (null past the limit).
  json* Place(json&& v) {
    if (over_limit_) return nullptr;
    if (open_.empty()) {
      *root_ = std::move(v);
      return root_;
    }
    json& parent = *open_.back();
    if (parent.is_array()) {
      parent.push_back(std::move(v));
      return &parent.back();
    }
    *member_ = std::move(v);
    return member_;
  }

  bool Value(json&& v) {
    if (!Tick()) return false;
    Place(std::move(v));
    return true;
  }

  bool Open(json&& empty) {
    if (!Tick()) return false;
    if (++depth_ > kMaxJsonDepth) {
      return Fail("nesting deeper than " + std::to_string(kMaxJsonDepth) +
                  " levels (a safetensors header is an object of objects of arrays)");
    }
    json* placed = Place(std::move(empty));
    if (placed != nullptr) open_.push_back(placed);
    return true;
  }

  bool Close() {
    if (!Tick()) return false;
    --depth_;
    if (over_limit_) {
      if (depth_ > 0) return true;
      // The root closed: every member is counted, nothing more to learn.
      limit_hit_ = true;
      return Fail("more than " + std::to_string(max_entries_) + " entries");
    }
    open_.pop_back();
    return true;
  }

  json* const root_;
  const uint64_t max_entries_;
  const std::string_view uncounted_;
  const CancelCheck& cancelled_;
  std::vector<json*> open_;  // the objects and arrays being filled, innermost last
  json* member_ = nullptr;   // the member the next value of the innermost object fills
  int depth_ = 0;
  uint64_t entries_ = 0;
  uint64_t events_ = 0;
  bool over_limit_ = false;  // past max_entries_: counting only
  bool limit_hit_ = false;
  std::string error_;
};

// What StrictParse found, beyond its error.
struct StrictParseResult {
  std::string error;  // "" when `out` holds the document
  bool over_limit = false;
  uint64_t entries = 0;  // root members counted (all of them when over_limit)
};

// Parses `text` as JSON under StrictSax's rules.
StrictParseResult StrictParse(std::string_view text, json* out, uint64_t max_entries = 0,
                              std::string_view uncounted = {},
                              const CancelCheck& cancelled = nullptr) {
  StrictParseResult r;
  StrictSax sax(out, max_entries, uncounted, cancelled);
  try {
    json::sax_parse(text.begin(), text.end(), &sax, json::input_format_t::json,
                    /*strict=*/true, /*ignore_comments=*/false);
  } catch (const json::exception& e) {
    r.error = std::string("malformed JSON: ") + e.what();
    return r;
  }
  r.error = sax.error();
  r.over_limit = sax.limit_hit();
  r.entries = sax.entries();
  return r;
}

// Every refusal of the parser: the file is not a checkpoint the daemon accepts.
Status Invalid(std::string message) {
  return Status(StatusCode::kInvalidArgument, std::move(message));
}

std::string Quote(const std::string& s) {
  // Names come from the file: keep the message printable and bounded.
  std::string out = "\"";
  for (size_t i = 0; i < s.size() && i < 200; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  if (s.size() > 200) out += "...";
  return out + "\"";
}

// Multiplies with an overflow check.
bool MulOverflows(uint64_t a, uint64_t b, uint64_t* out) {
  return __builtin_mul_overflow(a, b, out);
}

Status ParseTensor(const std::string& where, const json& v, uint64_t data_bytes,
                   SafetensorsTensor* t) {
  if (!v.is_object()) {
    return Invalid(where +
                   ": must be an object with \"dtype\", \"shape\" and \"data_offsets\", got " +
                   v.type_name());
  }
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (it.key() != "dtype" && it.key() != "shape" && it.key() != "data_offsets") {
      return Invalid(where + ": unknown field " + Quote(it.key()) +
                     " (accepted: dtype, shape, data_offsets)");
    }
  }
  if (!v.contains("dtype") || !v["dtype"].is_string()) {
    return Invalid(where +
                   ": \"dtype\" is missing or not a string (accepted: " + kSafetensorsDTypes + ")");
  }
  const std::string dtype = v["dtype"].get<std::string>();
  if (!ParseSafetensorsDType(dtype, &t->dtype)) {
    return Invalid(where + ": dtype " + Quote(dtype) +
                   " is not one this reader knows (accepted: " + kSafetensorsDTypes + ")");
  }
  if (!v.contains("shape") || !v["shape"].is_array()) {
    return Invalid(where + ": \"shape\" is missing or not an array of non-negative integers");
  }
  uint64_t numel = 1;
  for (const json& d : v["shape"]) {
    if (!d.is_number_unsigned()) {
      return Invalid(where + ": shape " + v["shape"].dump() + " holds " + d.dump() +
                     ", not a non-negative integer");
    }
    const uint64_t dim = d.get<uint64_t>();
    if (dim > static_cast<uint64_t>(INT64_MAX) || MulOverflows(numel, dim, &numel)) {
      return Invalid(where + ": shape " + v["shape"].dump() +
                     " has more elements than fit in 64 bits");
    }
    t->shape.push_back(static_cast<int64_t>(dim));
  }
  uint64_t expected = 0;
  if (MulOverflows(numel, SafetensorsDTypeSize(t->dtype), &expected)) {
    return Invalid(where + ": shape " + v["shape"].dump() + " of " + dtype +
                   " overflows 64 bits of bytes");
  }
  if (!v.contains("data_offsets") || !v["data_offsets"].is_array() ||
      v["data_offsets"].size() != 2 || !v["data_offsets"][0].is_number_unsigned() ||
      !v["data_offsets"][1].is_number_unsigned()) {
    return Invalid(where + ": \"data_offsets\" must be [begin, end], two non-negative integers");
  }
  t->begin = v["data_offsets"][0].get<uint64_t>();
  t->end = v["data_offsets"][1].get<uint64_t>();
  if (t->begin > t->end) {
    return Invalid(where + ": data_offsets [" + std::to_string(t->begin) + ", " +
                   std::to_string(t->end) + "] end before they begin");
  }
  if (t->end > data_bytes) {
    return Invalid(where + ": data_offsets [" + std::to_string(t->begin) + ", " +
                   std::to_string(t->end) + "] run past the data area (" +
                   std::to_string(data_bytes) +
                   " bytes after the header): the file is truncated or the offsets are wrong");
  }
  if (t->end - t->begin != expected) {
    return Invalid(where + ": shape " + v["shape"].dump() + " of " + dtype + " is " +
                   std::to_string(expected) + " bytes but data_offsets [" +
                   std::to_string(t->begin) + ", " + std::to_string(t->end) + "] span " +
                   std::to_string(t->end - t->begin));
  }
  return Status::Ok();
}

}  // namespace

const char* const kSafetensorsDTypes =
    "F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL, F8_E4M3, F8_E5M2";

const char* SafetensorsDTypeName(SafetensorsDType d) {
  for (const auto& x : kDTypes)
    if (x.dtype == d) return x.name;
  return "?";
}

uint64_t SafetensorsDTypeSize(SafetensorsDType d) {
  for (const auto& x : kDTypes)
    if (x.dtype == d) return x.size;
  return 0;
}

bool ParseSafetensorsDType(std::string_view name, SafetensorsDType* out) {
  for (const auto& x : kDTypes) {
    if (name == x.name) {
      *out = x.dtype;
      return true;
    }
  }
  return false;
}

uint64_t SafetensorsTensor::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);  // checked when parsed
  return n;
}

Status ParseSafetensorsJson(const std::string& file_label, std::string_view text,
                            uint64_t file_size, SafetensorsHeader* out,
                            const CancelCheck& cancelled) {
  *out = SafetensorsHeader();
  out->header_bytes = text.size();
  out->data_start = 8 + text.size();
  out->file_size = file_size;
  out->header_hash = Fnv1a64(text);
  if (out->data_start > file_size) {
    return Invalid(file_label + ": the header (" + std::to_string(text.size()) +
                   " bytes) runs past the end of the file (" + std::to_string(file_size) +
                   " bytes)");
  }
  const uint64_t data_bytes = file_size - out->data_start;
  json doc;
  // Remembers that `cancelled` fired, so a parse it stopped reads as CANCELLED.
  bool fired = false;
  const CancelCheck check = [&] { return fired = fired || (cancelled && cancelled()); };
  const StrictParseResult parsed = StrictParse(text, &doc, kMaxTensors, "__metadata__", check);
  if (parsed.over_limit) {
    return Invalid(file_label + ": header: lists " + std::to_string(parsed.entries) +
                   " tensors, more than the " + std::to_string(kMaxTensors) +
                   " a checkpoint may hold (accepted: at most " + std::to_string(kMaxTensors) +
                   " tensors per file and in all shards together)");
  }
  if (!parsed.error.empty()) {
    return Status(fired ? StatusCode::kCancelled : StatusCode::kInvalidArgument,
                  file_label + ": header: " + parsed.error);
  }
  Status st;
  if (!doc.is_object()) {
    return Invalid(file_label + ": header: must be a JSON object of tensors, got " +
                   doc.type_name());
  }
  for (auto it = doc.begin(); it != doc.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__") {
      if (!it->is_object())
        return Invalid(file_label + ": __metadata__ must be an object of strings");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) {
          return Invalid(file_label + ": __metadata__ field " + Quote(m.key()) +
                         " must be a string, got " + m->type_name());
        }
        out->metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    if (name.empty()) return Invalid(file_label + ": a tensor has an empty name");
    if (out->tensors.size() % 4096 == 4095 && cancelled && cancelled()) {
      return Status(StatusCode::kCancelled, file_label + ": header: parse cancelled");
    }
    SafetensorsTensor t;
    t.name = name;
    st = ParseTensor(file_label + ": tensor " + Quote(name), *it, data_bytes, &t);
    if (!st.ok()) return st;
    out->tensors.push_back(std::move(t));
  }
  std::sort(out->tensors.begin(), out->tensors.end(),
            [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  // The data area must be covered exactly: no overlap, no hole, nothing after.
  uint64_t cursor = 0;
  const SafetensorsTensor* prev = nullptr;
  for (const auto& t : out->tensors) {
    if (t.begin < cursor) {
      return Invalid(file_label + ": tensors " + Quote(prev->name) + " [" +
                     std::to_string(prev->begin) + ", " + std::to_string(prev->end) + ") and " +
                     Quote(t.name) + " [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                     ") overlap");
    }
    if (t.begin > cursor) {
      return Invalid(file_label + ": bytes [" + std::to_string(cursor) + ", " +
                     std::to_string(t.begin) + ") of the data area belong to no tensor (before " +
                     Quote(t.name) + "); safetensors data must be fully indexed, without holes");
    }
    cursor = t.end;
    prev = &t;
  }
  if (cursor != data_bytes) {
    return Invalid(file_label + ": the tensors end at byte " + std::to_string(cursor) +
                   " of the data area but the file has " + std::to_string(data_bytes) +
                   " data bytes: trailing bytes, or a wrong header length");
  }
  return Status::Ok();
}

namespace {

// The 8-byte little-endian header length at the start of a file of `size`
// (>= 8) bytes, checked against the limit and the file's end.
Status DecodeHeaderLength(const std::string& file_label, const uint8_t len_bytes[8], uint64_t size,
                          uint64_t* n_out) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len_bytes[i];
  if (n > kMaxHeaderBytes) {
    return Invalid(file_label + ": header length " + std::to_string(n) + " exceeds the " +
                   std::to_string(kMaxHeaderBytes) + "-byte limit (not a safetensors file?)");
  }
  if (n > size - 8) {
    return Invalid(file_label + ": header length " + std::to_string(n) +
                   " runs past the end of the file (" + std::to_string(size) +
                   " bytes): truncated or not a safetensors file");
  }
  *n_out = n;
  return Status::Ok();
}

Status TooShort(const std::string& file_label, uint64_t size) {
  return Invalid(file_label + ": truncated: " + std::to_string(size) +
                 " bytes, shorter than the 8-byte header length");
}

}  // namespace

Status ParseSafetensorsBuffer(const std::string& file_label, const uint8_t* data, uint64_t size,
                              SafetensorsHeader* out) {
  if (size < 8) return TooShort(file_label, size);
  uint64_t n = 0;
  if (Status st = DecodeHeaderLength(file_label, data, size, &n); !st.ok()) return st;
  return ParseSafetensorsJson(
      file_label, std::string_view(reinterpret_cast<const char*>(data) + 8, n), size, out);
}

Status ReadSafetensorsHeader(const platform::ReadOnlyFile& file, const std::string& file_label,
                             SafetensorsHeader* out, const CancelCheck& cancelled) {
  uint64_t size = 0;
  if (int err = file.CurrentSize(&size); err != 0)
    return Invalid(platform::ErrnoText(file_label + ": cannot seek", err));
  uint8_t len_bytes[8];
  if (size < 8) return TooShort(file_label, size);
  if (file.ReadAt(len_bytes, 8, 0) != 8) {
    const int err = errno;
    return Invalid(platform::ErrnoText(file_label + ": cannot read the header length", err));
  }
  uint64_t n = 0;
  if (Status st = DecodeHeaderLength(file_label, len_bytes, size, &n); !st.ok()) return st;
  std::string text(n, '\0');
  uint64_t done = 0;
  while (done < n) {
    const int64_t r = file.ReadAt(text.data() + done, n - done, 8 + done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      const int err = errno;
      return Invalid(platform::ErrnoText(file_label + ": cannot read the header", err));
    }
    done += static_cast<uint64_t>(r);
  }
  return ParseSafetensorsJson(file_label, text, size, out, cancelled);
}

Status ParseShardIndex(const std::string& file_label, std::string_view text, ShardIndex* out) {
  *out = ShardIndex();
  json doc;
  const std::string err = StrictParse(text, &doc).error;
  if (!err.empty()) return Invalid(file_label + ": " + err);
  if (!doc.is_object() || !doc.contains("weight_map") || !doc["weight_map"].is_object()) {
    return Invalid(file_label +
                   ": must be an object with a \"weight_map\" object (tensor name -> shard "
                   "file name)");
  }
  if (doc["weight_map"].size() > kMaxTensors) {
    return Invalid(file_label + ": weight_map lists " + std::to_string(doc["weight_map"].size()) +
                   " tensors, more than the " + std::to_string(kMaxTensors) +
                   " a checkpoint may hold (accepted: at most " + std::to_string(kMaxTensors) +
                   ")");
  }
  std::set<std::string> shards;
  for (auto it = doc["weight_map"].begin(); it != doc["weight_map"].end(); ++it) {
    if (!it->is_string()) {
      return Invalid(file_label + ": weight_map[" + Quote(it.key()) +
                     "] must be a file name string");
    }
    const std::string file = it->get<std::string>();
    if (file.empty() || file == "." || file == ".." || file.find('/') != std::string::npos ||
        file.find('\0') != std::string::npos) {
      return Invalid(file_label + ": weight_map[" + Quote(it.key()) + "] = " + Quote(file) +
                     " is not a file name in the model's folder (no '/', not '.' or '..')");
    }
    out->weight_map[it.key()] = file;
    shards.insert(file);
  }
  if (shards.empty()) return Invalid(file_label + ": weight_map is empty");
  out->shards.assign(shards.begin(), shards.end());
  return Status::Ok();
}

}  // namespace trainstream::daemon::base
